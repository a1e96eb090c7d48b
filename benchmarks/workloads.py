"""The canonical workloads W1, W2 and W3 (definitions in the project's GPU notes), one per process.

- ``w1`` offline throughput: Qwen3-0.6B shape, dummy bf16 weights, 256 requests, seed 0, prompt
  lengths uniform in [100, 1024] of random ids in [0, 10000), output lengths uniform in
  [100, 1024], ignore_eos, temperature 0.6 (nano-vllm's bench.py). Figure: output tokens / wall s.
- ``w2`` batch-1 decode: Llama-3.1-8B shape, dummy bf16 weights, a 128-token prompt, 256 output
  tokens, greedy. Figure: median ms between engine steps 8..256 (after a 16-step warm-up
  request), i.e. per output token; also the mean over one whole ``LLM.generate`` request.
- ``w3`` prefix reuse: Qwen3-0.6B shape, 512 requests, each one of 4 shared 2048-token prefixes +
  128 unique tokens, 128 output tokens, greedy, ignore_eos; prefix caching on and off, each
  engine in a child process of its own. Figures: output tok/s and mean TTFT (s) for each, and
  the on/off ratios.
- ``w4`` TensorRT-LLM's published workload: Llama-3.1-8B shape, dummy weights, ISL/OSL 1000/1000
  (512 requests) and 128/128 (2,048 requests) of random ids, ignore_eos, greedy, ``max_num_seqs``
  512; each ISL/OSL in a child process of its own (``--isl-osl`` runs one here). Figure: output
  tok/s beside TensorRT-LLM's FP8 figures on one H200 (17,744 / 27,911).
- ``w5`` long prompts: Llama-3.1-8B shape, batch 1, a 32,768- and a 130,944-token prompt (random
  ids) + 128 output tokens each, greedy, one engine (max_model_len 131,072). Figures per prompt:
  TTFT (s) and ms per output token.

Only kvserve's public API is used (``LLM``, ``SamplingParams``, ``RequestOutput.metrics``; W2 also
``LLM.llm_engine``'s ``add_request`` / ``step`` / ``abort_request``, as vLLM's ``LLMEngine`` has them), with
``load_format="dummy"`` and a config written here from the shapes, so the same script measures an
older checkout: ``PYTHONPATH=<other checkout> python3 benchmarks/workloads.py --workload w1``.

Usage (repo root):
    PYTHONPATH=. python3 benchmarks/workloads.py --workload w1|w2|w3|w4|w5 [--kv-cache-dtype fp8_e4m3]
        [--engine-arg quantization=fp8 ...] [--out FILE.json]
    python3 benchmarks/workloads.py --workload w1 --tiny   # tiny random model on the CPU, < 1 min
Prints one JSON line (device, torch/triton versions, commit, command, figures); --out writes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], model_type="qwen3", bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16",
)
LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, architectures=["LlamaForCausalLM"], model_type="llama", bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16",
)
_TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
SHAPES = {"w1": QWEN3_06B, "w2": LLAMA31_8B, "w3": QWEN3_06B}
SHAPES["w4"] = LLAMA31_8B
SHAPES["w5"] = LLAMA31_8B

# Workload sizes: the canonical ones, and the --tiny ones (CPU check of the script, no figure).
SIZES = {
    "w1": dict(requests=256, min_in=100, max_in=1024, min_out=100, max_out=1024, vocab=10000),
    "w2": dict(prompt_len=128, output_len=256, vocab=10000),
    "w3": dict(requests=512, prefix_len=2048, suffix_len=128, output_len=128, vocab=10000),
}
TINY_SIZES = {
    "w1": dict(requests=16, min_in=16, max_in=96, min_out=8, max_out=48, vocab=2000),
    "w2": dict(prompt_len=16, output_len=32, vocab=2000),
    "w3": dict(requests=16, prefix_len=128, suffix_len=16, output_len=8, vocab=2000),
}
SIZES["w5"] = dict(prompt_lens=[32768, 130944], output_len=128, vocab=10000)
TINY_SIZES["w5"] = dict(prompt_lens=[96, 700], output_len=8, vocab=2000)
# Engine arguments of each workload (as the figures in BENCHMARKS.md were taken).
ENGINE = {
    "w1": dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
               gpu_memory_utilization=0.9),
    "w2": dict(dtype="bfloat16", max_model_len=4096, kv_cache_memory="4GiB"),
    "w3": dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, kv_cache_memory="24GiB"),
}
# W4: ISL/OSL -> requests, and TensorRT-LLM's published FP8 output tok/s on one H200
W4_SIZES = {"1000/1000": dict(requests=512, isl=1000, osl=1000, vocab=10000, trtllm=17744),
            "128/128": dict(requests=2048, isl=128, osl=128, vocab=10000, trtllm=27911)}
W4_TINY_SIZES = {"1000/1000": dict(requests=8, isl=40, osl=24, vocab=2000, trtllm=17744),
                 "128/128": dict(requests=16, isl=16, osl=16, vocab=2000, trtllm=27911)}
ENGINE["w4"] = dict(dtype="bfloat16", max_model_len=2048, max_num_seqs=512, max_num_batched_tokens=8192,
                    gpu_memory_utilization=0.9)
# 131,072 tokens of bf16 KV at the 8B shape are 16 GiB; a lone prompt prefills in 32,768-token
# chunks (8,192 beside other requests: long_prefill_token_threshold)
ENGINE["w5"] = dict(dtype="bfloat16", max_model_len=131072, max_num_seqs=4, kv_cache_memory="20GiB",
                    max_num_batched_tokens=32768, long_prefill_token_threshold=8192)
TINY_ENGINE = dict(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=16, kv_cache_memory="64MiB")


def write_config(workload: str, tiny: bool, root: str) -> str:
    """Write the Hugging Face config.json of the workload's shape; returns its directory."""
    cfg = dict(SHAPES[workload], **(_TINY if tiny else {}))
    path = os.path.join(root, f"{cfg['model_type']}-{'tiny' if tiny else workload}-config")
    try:  # through transformers' config class, as the earlier figures were taken
        from transformers import AutoConfig

        kw = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
        AutoConfig.for_model(cfg["model_type"], **kw).save_pretrained(path)
    except ImportError:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    return path


def environment() -> dict:
    """Device, versions, the commit of the kvserve tree imported, and this command."""
    import torch

    import kvserve

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    src = os.path.dirname(os.path.dirname(os.path.abspath(kvserve.__file__)))
    commit = os.environ.get("KVSERVE_COMMIT")  # first: a copied tree may carry stale git metadata
    if not commit:
        try:
            commit = subprocess.check_output(["git", "-C", src, "rev-parse", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL).strip()
        except Exception:
            commit = "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or platform.machine())
    return dict(device=device, torch=torch.__version__, triton=triton_version, python=platform.python_version(),
                commit=commit, kvserve_src=src, command=" ".join([sys.executable] + sys.argv))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_llm(workload: str, a: argparse.Namespace, **extra):
    from kvserve import LLM

    args = dict(TINY_ENGINE if a.tiny else ENGINE[workload])
    if a.kv_cache_dtype:
        args["kv_cache_dtype"] = a.kv_cache_dtype
    args.update(extra)
    args.update(a.engine_args)
    path = write_config(workload, a.tiny, a.tmp)
    return LLM(model=path, load_format="dummy", skip_tokenizer_init=True, disable_log_stats=True, **args), args


def w1_requests(s: dict) -> tuple:
    """W1's requests (seed 0): ``(prompt lengths, output lengths, prompts, SamplingParams list)``."""
    import numpy as np

    from kvserve import SamplingParams

    rng = np.random.default_rng(0)
    in_lens = rng.integers(s["min_in"], s["max_in"] + 1, s["requests"])
    out_lens = rng.integers(s["min_out"], s["max_out"] + 1, s["requests"])
    prompts = [rng.integers(0, s["vocab"], n).tolist() for n in in_lens]
    params = [SamplingParams(temperature=0.6, max_tokens=int(n), ignore_eos=True) for n in out_lens]
    return in_lens, out_lens, prompts, params


def w1(a: argparse.Namespace) -> dict:
    """Output tokens per wall second of 256 requests submitted at once."""
    from kvserve import SamplingParams

    s = (TINY_SIZES if a.tiny else SIZES)["w1"]
    in_lens, out_lens, prompts, params = w1_requests(s)
    llm, args = make_llm("w1", a)
    llm.generate([list(range(100))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == int(out_lens.sum()), (n_out, int(out_lens.sum()))
    return dict(output_tok_per_s=round(n_out / wall, 1), wall_s=round(wall, 3), output_tokens=n_out,
                prompt_tokens=int(in_lens.sum()), num_requests=s["requests"], engine_args=args)


def _step_times(llm, prompt: list[int], steps: int) -> list[float]:
    """Wall ms between ``steps`` consecutive engine steps of one request decoding alone
    (``LLM.llm_engine``'s add_request / step / abort_request; the request is aborted after).
    No device sync inside the loop: with async scheduling a step's return marks its token
    reaching the host, so in steady state the interval is the time per token a user sees."""
    from kvserve import SamplingParams

    eng = llm.llm_engine
    rid = eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True))
    _sync()
    stamps = [time.perf_counter()]
    for _ in range(steps):
        eng.step()
        stamps.append(time.perf_counter())
    eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def w2(a: argparse.Namespace) -> dict:
    """Median ms per output token of one request decoding alone (steps 8.. of 256, after a
    16-step warm-up request), and the mean over a whole ``LLM.generate`` request."""
    import numpy as np

    from kvserve import SamplingParams

    s = (TINY_SIZES if a.tiny else SIZES)["w2"]
    rng = np.random.default_rng(0)
    llm, args = make_llm("w2", a)
    _step_times(llm, rng.integers(0, s["vocab"], s["prompt_len"]).tolist(), 16)  # warm-up
    times = _step_times(llm, rng.integers(0, s["vocab"], s["prompt_len"]).tolist(), s["output_len"])
    o = llm.generate([rng.integers(0, s["vocab"], s["prompt_len"]).tolist()],
                     SamplingParams(temperature=0, max_tokens=s["output_len"], ignore_eos=True), use_tqdm=False)[0]
    n = len(o.outputs[0].token_ids)
    e2e = (o.metrics.finished_time - o.metrics.first_token_time) / (n - 1) * 1e3
    return dict(ms_per_token=round(statistics.median(times[8:]), 3), ms_per_token_mean_generate=round(e2e, 3),
                prompt_len=s["prompt_len"], output_len=s["output_len"], engine_args=args)


def w3_prompts(s: dict, seed: int = 0) -> list[list[int]]:
    """Request i: shared prefix i % 4 + its own suffix (benchmarks/w3_prefix.py's workload)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, s["vocab"], s["prefix_len"]).tolist() for _ in range(4)]
    return [prefixes[i % 4] + rng.integers(0, s["vocab"], s["suffix_len"]).tolist() for i in range(s["requests"])]


def w3_one(a: argparse.Namespace, caching: bool) -> dict:
    """One engine (prefix caching on or off) on W3: throughput and mean TTFT."""
    from kvserve import SamplingParams

    s = (TINY_SIZES if a.tiny else SIZES)["w3"]
    prompts = w3_prompts(s)
    llm, args = make_llm("w3", a, enable_prefix_caching=caching)
    llm.generate([list(range(64))] * 4, use_tqdm=False)  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=s["output_len"], ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    _sync()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return dict(wall_s=round(wall, 3), output_tok_per_s=round(n_out / wall, 1),
                mean_ttft_s=round(statistics.fmean(ttft), 4),
                cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
                prompt_tokens=sum(map(len, prompts)), num_requests=s["requests"], engine_args=args)


def w3(a: argparse.Namespace) -> dict:
    """Prefix caching on vs off, each engine in a child process (an engine's shutdown may leave
    device memory behind, which would slow the next engine in the same process)."""
    res = {}
    for mode in ("on", "off"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--workload", "w3", "--prefix-caching", mode,
                   "--out", f.name, "--tmp", a.tmp]
            cmd += ["--tiny"] * a.tiny + (["--kv-cache-dtype", a.kv_cache_dtype] if a.kv_cache_dtype else [])
            for k, v in a.engine_args.items():
                cmd += ["--engine-arg", f"{k}={json.dumps(v)}"]
            subprocess.run(cmd, check=True, stdout=sys.stderr)
            res[mode] = json.load(open(f.name))[f"caching_{mode}"]
    on, off = res["on"], res["off"]
    return dict(caching_on=on, caching_off=off, speedup=round(off["wall_s"] / on["wall_s"], 3),
                ttft_ratio=round(on["mean_ttft_s"] / off["mean_ttft_s"], 3))


def w5(a: argparse.Namespace) -> dict:
    """Long prompts at batch 1: each prompt length alone, TTFT (s, arrival to first token) and
    ms per output token after it (first to last token), one engine for all lengths (a
    1,024-token warm-up request first)."""
    import numpy as np

    from kvserve import SamplingParams

    s = (TINY_SIZES if a.tiny else SIZES)["w5"]
    rng = np.random.default_rng(0)
    llm, args = make_llm("w5", a)
    warm = min(1024, s["prompt_lens"][0])
    llm.generate([rng.integers(0, s["vocab"], warm).tolist()], SamplingParams(max_tokens=4), use_tqdm=False)
    res = {}
    for n in s["prompt_lens"]:
        sp = SamplingParams(temperature=0, max_tokens=s["output_len"], ignore_eos=True)
        _sync()
        o = llm.generate([rng.integers(0, s["vocab"], n).tolist()], sp, use_tqdm=False)[0]
        m, k = o.metrics, len(o.outputs[0].token_ids)
        res[str(n)] = dict(ttft_s=round(m.first_token_time - m.arrival_time, 3),
                           ms_per_token=round((m.finished_time - m.first_token_time) / max(k - 1, 1) * 1e3, 3),
                           output_tokens=k)
    return dict(prompts=res, output_len=s["output_len"], engine_args=args)


def w4_one(a: argparse.Namespace) -> dict:
    """One ISL/OSL of W4 in this process: output tokens per wall second of all requests at once."""
    import numpy as np

    from kvserve import SamplingParams

    s = (W4_TINY_SIZES if a.tiny else W4_SIZES)[a.isl_osl]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, s["vocab"], s["isl"]).tolist() for _ in range(s["requests"])]
    llm, args = make_llm("w4", a)
    llm.generate([list(range(100))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=s["osl"], ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    _sync()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == s["requests"] * s["osl"], n_out
    tps = n_out / wall
    print(f"W4 {a.isl_osl}: {tps:,.0f} output tok/s (TensorRT-LLM FP8, one H200: {s['trtllm']:,}; "
          f"{tps / s['trtllm']:.2f}x)", file=sys.stderr, flush=True)
    return dict(output_tok_per_s=round(tps, 1), wall_s=round(wall, 3), output_tokens=n_out,
                num_requests=s["requests"], isl=s["isl"], osl=s["osl"], trtllm_fp8_tok_per_s=s["trtllm"],
                vs_trtllm=round(tps / s["trtllm"], 3), engine_args=args)


def w4(a: argparse.Namespace) -> dict:
    """Both ISL/OSLs, 1000/1000 then 128/128, each engine in a child process (see ``w3``)."""
    res = {}
    for io in W4_SIZES:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--workload", "w4", "--isl-osl", io,
                   "--out", f.name, "--tmp", a.tmp]
            cmd += ["--tiny"] * a.tiny + (["--kv-cache-dtype", a.kv_cache_dtype] if a.kv_cache_dtype else [])
            for k, v in a.engine_args.items():
                cmd += ["--engine-arg", f"{k}={json.dumps(v)}"]
            subprocess.run(cmd, check=True, stdout=sys.stderr)
            res[io] = json.load(open(f.name))[io]
    return res


def _engine_arg(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True, choices=("w1", "w2", "w3", "w4", "w5"))
    ap.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8_e4m3, int8, int4 (default: the engine's)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="any other LLM(...) argument, VALUE as JSON where it parses (repeatable)")
    ap.add_argument("--prefix-caching", choices=("on", "off", "both"), default="both",
                    help="w3: one engine (on/off) in this process, or both in child processes")
    ap.add_argument("--isl-osl", choices=tuple(W4_SIZES), default=None,
                    help="w4: one ISL/OSL in this process (default: both, each in a child process)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU, small sizes (checks the script)")
    ap.add_argument("--out", default=None, help="write the JSON record to this file")
    ap.add_argument("--tmp", default=os.path.join(tempfile.gettempdir(), "kvserve-workloads"),
                    help="where the model configs are written")
    a = ap.parse_args()
    a.engine_args = dict(map(_engine_arg, a.engine_arg))
    if a.tiny:
        import torch

        torch.set_num_threads(1)  # a tiny model: extra threads only wait on a shared CPU
    if a.workload == "w3" and a.prefix_caching != "both":
        figures = {f"caching_{a.prefix_caching}": w3_one(a, a.prefix_caching == "on")}
    elif a.workload == "w4" and a.isl_osl:
        figures = {a.isl_osl: w4_one(a)}
    elif a.workload == "w4":
        figures = w4(a)
    else:
        figures = {"w1": w1, "w2": w2, "w3": w3, "w5": w5}[a.workload](a)
    rec = dict(workload=a.workload.upper() + (" (tiny)" if a.tiny else ""), kv_cache_dtype=a.kv_cache_dtype,
               **figures, **environment(), date=time.strftime("%Y-%m-%d", time.gmtime()))
    line = json.dumps(rec)
    print(line, flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
