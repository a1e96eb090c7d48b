"""GPU: Gemma 3 at the 270M shape (dummy weights, HF config written by
hand; no GGUF on the GPU machine).

1. ``equality``: float32 greedy tokens of the engine (Triton kernels, CUDA graphs, chunked
   prefill of 256 tokens, batched) vs transformers on the same weights, 8 prompts of 1..1500
   tokens (three past the 512-token window); also each prompt alone.
2. ``bf16``: the same prompts in bfloat16, engine vs transformers bf16: share of equal tokens
   (bf16 rounding makes exact equality a non-goal; reported, not asserted).
3. ``throughput``: bf16 output tok/s of 64 requests (prompts U[1000, 2000], 256 new tokens,
   ignore_eos) and the batch-1 decode time per token at a 2K-token context.

Usage (GPU machine, repo root): ``PYTHONPATH=. python benchmarks/gpu_gemma3.py --out $OUT``;
``--cpu-smoke`` runs every part at toy sizes on the CPU (checks the script, no figures).
Writes ``gemma3_<part>.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# google/gemma-3-270m's text config (config.json of the release), written out by hand.
GEMMA3_270M = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=512, _sliding_window_pattern=6,
    layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(18)],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None, final_logit_softcapping=None,
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
)
SMOKE = dict(GEMMA3_270M, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
             num_attention_heads=2, head_dim=32, sliding_window=16,
             layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(6)])


def env(device: str) -> dict:
    import transformers

    commit = os.environ.get("KVSERVE_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:
            commit = "unknown"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return dict(device=name, torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), commit=commit, command=" ".join([sys.executable] + sys.argv))


def make_checkpoint(tmp: str, shape: dict, device: str):
    """An HF Gemma 3 model with N(0, 0.02) weights (norms N(0, 0.1): zero-centred), saved."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**{k: v for k, v in shape.items() if k != "model_type"})
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(cfg).to(device=device, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.1 if "norm" in name else 0.02)
    path = os.path.join(tmp, "gemma3-270m-dummy")
    hf.save_pretrained(path)
    return path, hf


def prompts_for(vocab: int, smoke: bool) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lens = [1, 7, 33, 100, 511, 600, 1000, 1500] if not smoke else [1, 5, 15, 17, 40, 70]
    return [torch.randint(3, min(vocab, 50000), (n,), generator=g).tolist() for n in lens]


def hf_greedy(hf, prompts, new, device):
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(y[0, len(ids):].tolist())
    return out


def engine(path: str, dtype: str, device: str, **kw):
    from kvserve import LLM

    extra = dict(gpu_memory_utilization=0.5) if device == "cuda" else dict(kv_cache_memory="64MiB")
    return LLM(model=path, skip_tokenizer_init=True, dtype=dtype, device=device, max_model_len=4096,
               disable_log_stats=True, **extra, **kw)


def equality(tmp: str, shape: dict, device: str, smoke: bool) -> dict:
    from kvserve import SamplingParams

    path, hf = make_checkpoint(tmp, shape, device)
    prompts = prompts_for(shape["vocab_size"], smoke)
    new = 24
    ref32 = hf_greedy(hf, prompts, new, device)
    ref16 = hf_greedy(hf.to(torch.bfloat16), prompts, new, device)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    res = dict(prompt_lens=[len(p) for p in prompts], new_tokens=new, window=shape["sliding_window"])
    for dtype, ref in (("float32", ref32), ("bfloat16", ref16)):
        llm = engine(path, dtype, device, max_num_batched_tokens=256)
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        same = sum(a == b for x, y in zip(batched, ref) for a, b in zip(x, y))
        res[dtype] = dict(
            batched_equal=batched == ref, alone_equal=alone == ref, batch_invariant=batched == alone,
            equal_token_share=round(same / (new * len(prompts)), 4),
            first_diff=[next((k for k in range(new) if a[k] != b[k]), None) for a, b in zip(batched, ref)],
            backend=llm.llm_engine.config.attention_config.attention_backend,
            cuda_graphs=device == "cuda" and not llm.llm_engine.config.model_config.enforce_eager)
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    return res


def throughput(tmp: str, shape: dict, device: str, smoke: bool) -> dict:
    import numpy as np
    from transformers import Gemma3TextConfig

    from kvserve import LLM, SamplingParams

    path = os.path.join(tmp, "gemma3-270m-config")
    Gemma3TextConfig(**{k: v for k, v in shape.items() if k != "model_type"}).save_pretrained(path)
    rng = np.random.default_rng(0)
    n_req, lo, hi, new = (64, 1000, 2001, 256) if not smoke else (4, 20, 60, 8)
    in_lens = rng.integers(lo, hi, n_req)
    prompts = [rng.integers(3, 50000 if not smoke else 500, n).tolist() for n in in_lens]
    extra = dict(gpu_memory_utilization=0.85) if device == "cuda" else dict(kv_cache_memory="64MiB")
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32",
              skip_tokenizer_init=True, device=device, max_model_len=4096, max_num_seqs=256,
              disable_log_stats=True, **extra)
    llm.generate([list(range(3, 103))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    sync()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # Batch-1 decode per token at a 2K context: (time of 2K prompt + 129 tokens) - (2K + 1 token), / 128.
    ctx = [int(x) for x in rng.integers(3, 500, 2048 if not smoke else 64)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=129 if not smoke else 9, ignore_eos=True)
    times = {}
    for name, sp in (("one", one), ("many", many)):
        best = float("inf")
        for rep in range(3):
            c = list(ctx)
            c[0] = 3 + rep  # a fresh prompt each time: no prefix-cache hit
            sync()
            t = time.perf_counter()
            llm.generate([c + [7 + len(times)]], sp, use_tqdm=False)
            sync()
            best = min(best, time.perf_counter() - t)
        times[name] = best
    steps = (many.max_tokens - 1)
    cfg = llm.llm_engine.config
    res = dict(workload=f"{n_req} requests, prompts U[{lo},{hi - 1}], {new} new tokens, ignore_eos, greedy",
               dtype=cfg.model_config.dtype, output_tok_per_s=round(n_out / wall, 1), wall_s=round(wall, 2),
               output_tokens=n_out, prompt_tokens=int(in_lens.sum()),
               decode_ms_per_token_batch1_ctx2k=round(1000 * (times["many"] - times["one"]) / steps, 3),
               num_kv_blocks=cfg.cache_config.num_blocks, backend=cfg.attention_config.attention_backend)
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-gpu15a")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--parts", default="equality,throughput")
    a = ap.parse_args()
    os.makedirs(a.tmp, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    device = "cpu" if a.cpu_smoke else "cuda"
    shape = SMOKE if a.cpu_smoke else GEMMA3_270M
    e = env(device)
    rows = []
    for part in a.parts.split(","):
        t0 = time.perf_counter()
        try:
            r = {"equality": equality, "throughput": throughput}[part](a.tmp, shape, device, a.cpu_smoke)
        except Exception as exc:  # report and go on with the next part
            traceback.print_exc()
            r = dict(error=f"{type(exc).__name__}: {exc}")
        r = {**r, **e, "part_s": round(time.perf_counter() - t0, 1)}
        json.dump(r, open(os.path.join(a.out, f"gemma3_{part}.json"), "w"), indent=1)
        if "error" in r:
            rows.append((part, r["error"][:100]))
        elif part == "equality":
            for dt in ("float32", "bfloat16"):
                d = r[dt]
                rows.append((f"greedy {dt} batched/alone/invariant",
                             f"{d['batched_equal']}/{d['alone_equal']}/{d['batch_invariant']} "
                             f"(equal tokens {d['equal_token_share']:.1%}, {d['backend']}, graphs {d['cuda_graphs']})"))
        else:
            rows.append(("throughput output tok/s", f"{r['output_tok_per_s']} ({r['wall_s']} s, {r['dtype']})"))
            rows.append(("batch-1 decode ms/token @2K ctx", f"{r['decode_ms_per_token_batch1_ctx2k']}"))
    print(f"\n{e['device']} torch {e['torch']} transformers {e['transformers']} commit {e['commit'][:10]}")
    for k, v in rows:
        print(f"{k:40s} {v}")


if __name__ == "__main__":
    main()
