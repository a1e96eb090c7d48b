"""GPU: quantized weights at the Llama-3.1-8B shape (dummy weights quantized at load).

Parts (each optional): ``kernels`` — one linear layer per format at the 8B projection shapes, M = 1, 4,
16, 64, CUDA-event timed, with GB/s of weight bytes beside the roofline; quantized formats twice, with
the PyTorch kernels (path ``torch``) and the Triton GEMV (path ``triton``, CUDA; ``--sweep`` adds its
configuration sweep to the JSON); ``w2`` — W2 (batch-1 decode, 128-token prompt)
per format (bf16 | fp8 | int8 | int4) beside its own roofline (weight bytes / HBM bandwidth);
``w1`` — W1-style throughput (64 requests) per format. JSON records to --out/weight_quant.json, table last.

    PYTHONPATH=. python3 benchmarks/gpu_weight_quant.py --out $OUT --parts kernels,w2,w1 [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode import HBM_BYTES_PER_S, LLAMA31_8B, _config_dir, decode_latency  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
            bos_token_id=1, eos_token_id=2)


def _layer(lin, fmt: str, triton: bool):
    """``fmt`` layer built with (``triton``) or without the Triton GEMV (``KVSERVE_TRITON_GEMV`` is read at load)."""
    from kvserve.layers.quantization import QuantizedLinear

    if fmt == "bf16":
        return lin
    old = os.environ.get("KVSERVE_TRITON_GEMV")
    os.environ["KVSERVE_TRITON_GEMV"] = "1" if triton else "0"
    try:
        return QuantizedLinear.from_dense(lin, fmt, torch.bfloat16)
    finally:
        if old is None:
            del os.environ["KVSERVE_TRITON_GEMV"]
        else:
            os.environ["KVSERVE_TRITON_GEMV"] = old


def kernels(device: str, formats: list[str], smoke: bool, smollm2: bool = False, sweep: bool = False) -> list[dict]:
    """One linear layer per format and path (``torch``: PyTorch kernels; ``triton``: the Triton GEMV, CUDA only),
    M = 1, 4, 16 (and 64), with GB/s of weight bytes and the roofline (weight bytes / HBM bandwidth)."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
    if smollm2:
        shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    if smoke:
        shapes = [(256, 128), (96, 256)]
    out = []
    for n, k in shapes:
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        for fmt in [f for f in formats if "@" not in f]:
            for path in (["torch"] if fmt == "bf16" else ["torch", "triton"] if device == "cuda" else ["torch"]):
                try:
                    layer = _layer(lin, fmt, path == "triton")
                    # copies cycled per timed call: >= 256 MB of weights, so L2 (50 MB) holds none of them
                    nb = n * k * 2 if fmt == "bf16" else sum(b.numel() * b.element_size() for b in layer.buffers())
                    copies = [layer] + [_layer(_clone(lin), fmt, path == "triton") for _ in
                                        range(0 if device != "cuda" else min(15, -(-(256 << 20) // nb) - 1))]
                except Exception as e:  # a format this device cannot run
                    out.append(dict(part="kernel", format=fmt, path=path, n=n, k=k, error=repr(e)[:200]))
                    continue
                nbytes = (n * k * 2) if fmt == "bf16" else sum(b.numel() * b.element_size() for b in layer.buffers())
                for m in (1, 4, 16, 64):
                    if fmt == "int8" and path == "torch" and m > 1 and not smoke:
                        continue  # _weight_int8pack_mm on CUDA: ~100 GB/s at M=1 and worse above (seconds here)
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                    try:
                        ms = _time([lambda c=c: c(x) for c in copies], device, 3 if smoke else 20)
                    except Exception as e:
                        out.append(dict(part="kernel", format=fmt, path=path, n=n, k=k, m=m, error=repr(e)[:200]))
                        continue
                    out.append(dict(part="kernel", format=fmt, path=path, n=n, k=k, m=m, us=round(ms * 1e3, 2),
                                    weight_bytes=nbytes, weight_gb_s=round(nbytes / ms / 1e6, 1),
                                    roofline_us=round(nbytes / HBM_BYTES_PER_S * 1e6, 2)))
                if sweep and path == "triton":
                    out.extend(_sweep(copies, fmt, n, k, device))
                del layer, copies
        del lin
    return out


def _clone(lin):
    c = torch.nn.Linear(lin.in_features, lin.out_features, bias=False, device=lin.weight.device,
                        dtype=lin.weight.dtype)
    c.weight.data.copy_(lin.weight.data)
    return c


def _sweep(layers, fmt: str, n: int, k: int, device: str) -> list[dict]:
    """Triton GEMV configurations around the static table's (for retuning ``gemv_config``)."""
    from kvserve.layers.quantization import triton_gemv as tg

    fcode = dict(fp8=tg.FMT_FP8, int8=tg.FMT_INT8, int4=tg.FMT_INT4)[fmt]

    def args(p):
        return dict(fp8=lambda: (p.w_rows, p.scale_rows, None), int8=lambda: (p.q, p.scale, None),
                    int4=lambda: (p.packed, p.scale_t, p.min_t))[fmt]()

    all_args = [args(layer.packed) for layer in layers]
    g = getattr(layers[0].packed, "group_size", 0) if fmt == "int4" else 0
    nbytes = sum(b.numel() * b.element_size() for b in layers[0].buffers())
    out = []
    i4 = fcode == tg.FMT_INT4
    for m in ((1,) if i4 else (1, 16)):  # int4 M=1: the open question (wider tiles reuse x across rows)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        bm = 1 if m == 1 else 16
        for bn in (((16, 32, 64, 128) if i4 else (8, 16, 32)) if m == 1 else (32, 64)):
            for bk in (((512, 1024) if m == 1 else (128,)) if fcode != tg.FMT_INT4 else
                       ((2 * g, 4 * g) if m == 1 else (g,))):
                for split in (((1, 2, 4, 8, 16) if i4 else (1, 2, 4, 8)) if m == 1 else (1, 2, 4)):
                    for warps in ((4, 8) if i4 else (4,)):
                        cfg = (bm, bn, bk, bk // g if g else 1, split, warps)
                        try:
                            ms = _time([lambda a=a: tg.wgemv(x, fcode, *a, n, g, config=cfg) for a in all_args],
                                       device, 10)
                        except Exception as e:
                            out.append(dict(part="sweep", format=fmt, n=n, k=k, m=m, cfg=cfg, error=repr(e)[:100]))
                            continue
                        out.append(dict(part="sweep", format=fmt, n=n, k=k, m=m, cfg=cfg, us=round(ms * 1e3, 2),
                                        weight_gb_s=round(nbytes / ms / 1e6, 1)))
    return out


def _time(fns, device: str, iters: int) -> float:
    """Median ms per call of ``fns`` (called in turn). CUDA: replayed from a CUDA graph of the calls (as
    decode runs them: no Python launch overhead), per call = replay time / calls."""
    for fn in fns:
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        reps = max(1, 32 // len(fns))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for fn in fns:
                    fn()
        graph.replay()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / (reps * len(fns)))
        del graph
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        for fn in fns:
            fn()
        times.append((time.perf_counter() - t) * 1e3 / len(fns))
    return statistics.median(times)


def _llm(path: str, fmt: str, device: str, smoke: bool, **kw):
    from kvserve import LLM

    q = None if fmt == "bf16" else fmt
    return LLM(model=path, load_format="dummy", dtype="bfloat16", quantization=q, skip_tokenizer_init=True,
               device=device, max_model_len=2048 if not smoke else 256,
               kv_cache_memory="4GiB" if not smoke else "32MiB", disable_log_stats=True, **kw)


def w2(path: str, fmt: str, device: str, smoke: bool) -> dict:
    """``fmt`` may end in ``@torch`` / ``@triton``: force the PyTorch kernels / the Triton GEMV (``int4@triton``)."""
    from kvserve.layers.quantization import weight_bytes

    base, _, kernel = fmt.partition("@")
    old = os.environ.get("KVSERVE_TRITON_GEMV")
    if kernel:
        os.environ["KVSERVE_TRITON_GEMV"] = "0" if kernel == "torch" else "1"
    try:
        llm = _llm(path, base, device, smoke)
    finally:
        if kernel:
            if old is None:
                del os.environ["KVSERVE_TRITON_GEMV"]
            else:
                os.environ["KVSERVE_TRITON_GEMV"] = old
    wb = weight_bytes(llm.llm_engine.engine_core.model_runner.model)
    if device == "cuda":
        decode_latency(llm, 128, 16, 1)  # warm-up
        times = decode_latency(llm, 128, 256, 1)
    else:
        times = _cpu_decode(llm, 4)
    ms = statistics.median(times[8:] if len(times) > 16 else times)
    floor = wb / HBM_BYTES_PER_S * 1e3
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(part="W2", format=fmt, ms_per_token=round(ms, 3), roofline_ms=round(floor, 3),
                roofline_fraction=round(floor / ms, 4), weight_bytes=wb)


def _cpu_decode(llm, n: int) -> list[float]:
    from kvserve import SamplingParams

    t, out = time.perf_counter(), []
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    out.append((time.perf_counter() - t) * 1e3 / n)
    return out


def w1(path: str, fmt: str, device: str, smoke: bool) -> dict:
    """64 requests, prompts U[100, 1024], outputs U[100, 512] (ignore_eos): output tok/s.
    ``fmt`` may end in ``+fp8kv``: the same weights with ``kv_cache_dtype="fp8"`` (4 GiB of KV
    either way, so the KV dtype sets how many requests fit before preemption)."""
    import numpy as np

    from kvserve import SamplingParams

    wfmt, _, kv = fmt.partition("+")
    llm = _llm(path, wfmt, device, smoke, max_num_seqs=64, kv_cache_dtype="fp8" if kv == "fp8kv" else "auto")
    rng = np.random.default_rng(0)
    n = 4 if smoke else 64
    plens = rng.integers(100, 1025, n) if not smoke else rng.integers(4, 16, n)
    olens = rng.integers(100, 513, n) if not smoke else rng.integers(2, 6, n)
    prompts = [rng.integers(0, 500, p).tolist() for p in plens]
    sps = [SamplingParams(max_tokens=int(o), ignore_eos=True, temperature=0.6, seed=i) for i, o in enumerate(olens)]
    llm.generate(prompts[:2], sps[:2], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t
    preempted = llm.llm_engine.stats.num_preemptions
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(part="W1-64", format=fmt, output_tok_s=round(int(olens.sum()) / wall, 1), wall_s=round(wall, 2),
                preemptions=preempted)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-gpu21")
    ap.add_argument("--parts", default="kernels,w2,w1")
    ap.add_argument("--formats", default="bf16,fp8,int8,int4")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ap.add_argument("--sweep", action="store_true", help="kernels part: also sweep Triton GEMV configurations")
    ap.add_argument("--cpu-kernels", action="store_true", help="kernels part only, on the CPU at SmolLM2 shapes")
    ns = ap.parse_args()
    device = "cpu" if ns.cpu_smoke or ns.cpu_kernels else "cuda"
    if ns.cpu_kernels:
        ns.parts = "kernels"
    formats = ns.formats.split(",")
    os.makedirs(ns.out, exist_ok=True)
    path = None if ns.cpu_kernels else _config_dir(ns.tmp, "tiny" if ns.cpu_smoke else "llama-3.1-8b", TINY if ns.cpu_smoke else LLAMA31_8B,
                       "LlamaConfig")
    records: list[dict] = []

    def emit(r: dict) -> None:
        records.append(r)
        print(json.dumps(r), flush=True)
        with open(os.path.join(ns.out, "weight_quant.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", records=records), f,
                      indent=1)

    parts = ns.parts.split(",")
    if "kernels" in parts:
        for r in kernels(device, formats, ns.cpu_smoke, smollm2=ns.cpu_kernels, sweep=ns.sweep):
            emit(r)
    for part, fn in (("w2", w2), ("w1", w1)):
        if part not in parts:
            continue
        for fmt in formats:
            try:
                emit(fn(path, fmt, device, ns.cpu_smoke))
            except Exception as e:  # keep going: one format failing must not hide the others
                emit(dict(part=part, format=fmt, error=repr(e)[:300]))
    print("\npart      format  figure")
    for r in records:
        if r["part"] == "sweep":
            continue  # in the JSON only
        if r["part"] == "kernel":
            fig = r.get("error") or (f"{r['path']:<6} n={r['n']} k={r['k']} m={r['m']}: {r['us']} us, "
                                     f"{r['weight_gb_s']} GB/s (roofline {r['roofline_us']} us)")
        elif r["part"] == "W2":
            fig = r.get("error") or f"{r['ms_per_token']} ms/token (roofline {r['roofline_ms']} ms, {r['roofline_fraction']:.0%})"
        else:
            fig = r.get("error") or f"{r['output_tok_s']} out tok/s"
        print(f"{r['part']:<9} {r['format']:<7} {fig}")


if __name__ == "__main__":
    main()
