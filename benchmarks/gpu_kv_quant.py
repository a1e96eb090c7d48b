"""GPU benchmarks for quantized KV caches, each dtype beside bfloat16 in one call:

- ``kernel``: the Triton split-KV decode kernel alone at batch 64 x 8k context (Qwen3-0.6B
  layer shape: 16 query heads, 8 KV heads, head dim 128), CUDA-event time, and GB/s of the
  cache bytes it reads (codes + scales) next to the 3.0 TB/s roofline; each record checks
  the output against dense SDPA over the dequantized pages (``ok``, ``max_err``); then
  ``kernel_cfg`` records time the tile configs of ``KERNEL_CONFIGS`` (block_n x warps);
- ``step``: the engine's decode step at batch 64 x 8k context (Qwen3-0.6B shape, dummy bf16
  weights, CUDA graphs), median ms per step;
- ``b1``: batch-1 decode ms per step at 1k context, Llama-3.1-8B shape (dummy weights);
- ``w1``: W1 (256 requests, Qwen3-0.6B shape; ``gpu_equality.w1``'s workload) in output tok/s.

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 benchmarks/gpu_kv_quant.py --out $OUT --parts kernel,step,b1,w1 \
        --dtypes bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2
    python3 benchmarks/gpu_kv_quant.py --cpu-smoke   # tiny shapes on the CPU (interpreter kernels)
Appends one JSON record per figure to --out/kv_quant.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))

HBM_BYTES_PER_S = 3.0e12
DTYPES = "bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2"


def _record(out_dir: str, rec: dict) -> None:
    print(json.dumps(rec), flush=True)
    with open(os.path.join(out_dir, "kv_quant.json"), "a") as f:
        f.write(json.dumps(rec) + "\n")


#: decode configs timed beside the default one, ``(block_n, num_warps, num_stages, num_splits,
#: fast_cvt, lane_split)`` (None: the default; ``decode._config``, ``choose_num_splits``,
#: ``kv_load.CODE_PATHS``): quantized tiles use more registers per thread than bf16 (sm_90
#: ptxas: ``benchmarks/ptx_kv_loads.py --regs``), so fewer programs fit an SM; ``num_splits``
#: 4 splits each request's keys 4 ways (the default is one split per (request, KV head) at
#: batch 64 x 8k); the code paths: conversion instructions vs integer-built float16, 4-/2-bit
#: codes interleaved vs one dot per bit lane
KERNEL_CONFIGS = [(None, None, None, None, False, False), (None, None, None, None, True, False),
                  (None, None, None, None, False, True),
                  (64, 4, 2, None, None, None), (64, 8, 2, None, None, None), (32, 4, 2, None, None, None),
                  (32, 4, 3, None, None, None), (64, 4, 3, None, None, None), (128, 4, 2, None, None, None),
                  (128, 8, 2, None, None, None), (128, 8, 3, None, None, None), (64, 8, 3, None, None, None),
                  (None, None, None, 2, None, None), (None, None, None, 4, None, None)]


def kernel_bench(dtype: str, device: str, batch: int, ctx: int, hkv: int, h: int, d: int, bs: int = 16,
                 configs=(), rotate: bool = False) -> list[dict]:
    """The default decode config, then each of ``configs`` (records ``part="kernel_cfg"``)."""
    from kvserve.attention.kv_format import kv_format_for
    from kvserve.attention.kv_quant import quantize_pages
    from kvserve.attention.triton import decode_attention
    from kvserve.core.kv_cache_spec import get_kv_format

    fmt = get_kv_format(dtype)
    kvf = kv_format_for(dtype, d)  # the format object the kernel reads its switches from
    nb_per = -(-ctx // bs)
    num_blocks = batch * nb_per + 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    if fmt.quantized:
        cache = torch.empty(2, num_blocks, bs, hkv, fmt.row_elems(d), dtype=getattr(torch, fmt.torch_dtype),
                            device=device)
        step = 4096  # quantize in slices (a full fp32 copy would not fit beside it at real shapes)
        for i in range(0, num_blocks, step):
            x = torch.randn(2, min(step, num_blocks - i), bs, hkv, d, device=device)
            cache[:, i:i + step] = quantize_pages(x, fmt)  # pages: codes, then scales
    else:
        cache = torch.randn(2, num_blocks, bs, hkv, d, device=device).to(getattr(torch, fmt.torch_dtype))
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    bt = perm[: batch * nb_per].view(batch, nb_per).to(torch.int32).to(device)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, h, d, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    out = torch.empty_like(q)
    recs = []
    from kvserve.attention.triton.decode import _config
    from kvserve.attention.triton.kv_load import KV_FMT_CODES, use_fast_cvt, use_lane_split, use_unpack

    kv_fmt = KV_FMT_CODES.get(dtype, 0)
    lanes = use_lane_split(kv_fmt, d)
    unpack = use_unpack(kv_fmt, device == "cuda", True) if lanes else 0
    default = (*_config(d, q.dtype, device != "cuda", kv_fmt, lanes, unpack), None, None, None)
    for cfg in [None, *(c for c in configs if c != default)]:  # the default config is timed once
        bn, nw, ns, sp, fc, ls = cfg or (None,) * 6
        if (fc is not None or ls is not None) and not kv_fmt:
            continue  # code paths: quantized formats only
        if ls and kv_fmt < 4:
            continue  # bit lanes: 4-/2-bit codes only
        fn = lambda: decode_attention(q, cache, bt, seq, qsl, batch, ctx, d ** -0.5, out=out,  # noqa: E731
                                      block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp,
                                      fast_cvt=fc, lane_split=ls, rotate=rotate, kv_format=kvf)
        if cfg is None:
            recs.append(_time_kernel(fn, dtype, device, batch, ctx, hkv, h, d, fmt, cache, bt, q, out, rotate))
            continue
        try:
            rec = _time_kernel(fn, dtype, device, batch, ctx, hkv, h, d, fmt, cache, bt, q, out, rotate)
        except Exception as exc:  # noqa: BLE001 - a config that fails must not hide the others
            traceback.print_exc()
            rec = dict(error=f"{type(exc).__name__}: {exc}", kv_cache_dtype=dtype)
        rec.update(part="kernel_cfg", block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp,
                   fast_cvt=use_fast_cvt(kv_fmt, fc), lane_split=use_lane_split(kv_fmt, d, ls))
        recs.append(rec)
    if device == "cuda" and configs:  # the default again, last: no first-in-line advantage either way
        fn = lambda: decode_attention(q, cache, bt, seq, qsl, batch, ctx, d ** -0.5, out=out,  # noqa: E731
                                      rotate=rotate, kv_format=kvf)
        rec = _time_kernel(fn, dtype, device, batch, ctx, hkv, h, d, fmt, cache, bt, q, out, rotate)
        rec.update(part="kernel_cfg", block_n=default[0], num_warps=default[1], num_stages=default[2],
                   num_splits=None, default=True, fast_cvt=use_fast_cvt(kv_fmt),
                   lane_split=use_lane_split(kv_fmt, d))
        recs.append(rec)
    return recs


def _time_kernel(fn, dtype, device, batch, ctx, hkv, h, d, fmt, cache, bt, q, out, rotate=False) -> dict:
    from kvserve.attention.kv_quant import dequantize_pages

    out.fill_(float("nan"))
    fn()
    # Correctness of the layout the kernel reads: its first two requests against dense SDPA over
    # the dequantized pages (kv_quant.dequantize_pages; no Triton in the reference).
    nr = min(2, batch)
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # no float8 indexing
    pages = raw[:, bt[:nr].long()].view(cache.dtype)  # [2, nr, blocks, bs, hkv, row]
    kv = dequantize_pages(pages, d, torch.float32, fmt).reshape(2, nr, -1, hkv, d)[:, :, :ctx]
    kk, vv = (t.transpose(1, 2).repeat_interleave(h // hkv, 1) for t in kv)  # [nr, h, ctx, d]
    qr = q[:nr].float()
    if rotate:  # the kernel rotates q in and its output back (the pages hold rotated rows)
        from kvserve.attention.kv_rotation import rotation_matrix

        r = rotation_matrix(d, q.device)
        qr = qr @ r
    ref = torch.nn.functional.scaled_dot_product_attention(qr.unsqueeze(2), kk, vv, scale=d ** -0.5)
    if rotate:
        ref = ref @ r.T
    max_err = (out[:nr].float() - ref.squeeze(2)).abs().max().item()
    ok = bool(torch.isfinite(out).all()) and max_err < (2e-2 if q.dtype == torch.bfloat16 else 1e-3)
    read_bytes = 2 * batch * ctx * hkv * fmt.row_elems(d) * cache.element_size()
    if device != "cuda":
        return dict(part="kernel", kv_cache_dtype=dtype, batch=batch, ctx=ctx, ok=ok, max_err=max_err)
    torch.cuda.synchronize()
    for _ in range(5):  # warm-up: clocks and caches after the SDPA check
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    n = 50
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    ms = s.elapsed_time(e) / n
    return dict(part="kernel", kv_cache_dtype=dtype, batch=batch, ctx=ctx, ok=ok, max_err=round(max_err, 6),
                ms=round(ms, 4), bytes_read=read_bytes, gb_per_s=round(read_bytes / ms / 1e6, 1),
                roofline_ms=round(read_bytes / HBM_BYTES_PER_S * 1e3, 4),
                roofline_fraction=round(read_bytes / HBM_BYTES_PER_S * 1e3 / ms, 3))


def step_bench(dtype: str, tmp: str, batch: int, ctx: int) -> dict:
    from gpu_decode import decode_latency
    from gpu_equality import QWEN3_06B

    from kvserve import LLM

    path = os.path.join(tmp, "qwen3-0.6b-config")
    from transformers import Qwen3Config

    Qwen3Config(**QWEN3_06B).save_pretrained(path)
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, kv_cache_dtype=dtype,
              max_model_len=ctx + 256, max_num_seqs=batch, gpu_memory_utilization=0.9, disable_log_stats=True)
    decode_latency(llm, 64, 8, 4)  # warm-up
    times = decode_latency(llm, ctx, 24, batch)
    cfg = llm.llm_engine.config.cache_config
    del llm
    torch.cuda.empty_cache()
    return dict(part="step", kv_cache_dtype=dtype, batch=batch, ctx=ctx,
                ms_per_step=round(statistics.median(times[4:]), 3), num_blocks=cfg.num_blocks)


def b1_bench(dtype: str, tmp: str) -> dict:
    from gpu_decode import LLAMA31_8B, _config_dir, decode_latency

    from kvserve import LLM

    path = _config_dir(tmp, "llama31-8b-config", LLAMA31_8B, "LlamaConfig")
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, kv_cache_dtype=dtype,
              max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.9, disable_log_stats=True)
    decode_latency(llm, 64, 8, 1)
    times = decode_latency(llm, 1024, 64, 1)
    del llm
    torch.cuda.empty_cache()
    return dict(part="b1", kv_cache_dtype=dtype, model="llama-3.1-8b-shape", ctx=1024,
                ms_per_step=round(statistics.median(times[4:]), 3))


def w1_bench(dtype: str, tmp: str) -> dict:
    import numpy as np
    from gpu_equality import QWEN3_06B
    from transformers import Qwen3Config

    from kvserve import LLM, SamplingParams

    path = os.path.join(tmp, "qwen3-0.6b-config")
    Qwen3Config(**QWEN3_06B).save_pretrained(path)
    rng = np.random.default_rng(0)
    in_lens, out_lens = rng.integers(100, 1025, 256), rng.integers(100, 1025, 256)
    prompts = [rng.integers(0, 10000, n).tolist() for n in in_lens]
    params = [SamplingParams(temperature=0.6, max_tokens=int(n), ignore_eos=True) for n in out_lens]
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, kv_cache_dtype=dtype,
              max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
              disable_log_stats=True)
    llm.generate([list(range(100))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    pre = llm.llm_engine.stats.num_preemptions
    del llm
    torch.cuda.empty_cache()
    return dict(part="w1", kv_cache_dtype=dtype, output_tok_per_s=round(n_out / wall, 1), wall_s=round(wall, 2),
                preemptions=pre)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-gpu12")
    ap.add_argument("--parts", default="kernel,step,b1,w1")
    ap.add_argument("--dtypes", default=DTYPES)
    ap.add_argument("--cpu-smoke", action="store_true", help="kernel part at tiny shapes on the CPU (interpreter)")
    ap.add_argument("--no-sweep", action="store_true", help="kernel part: the default config only")
    ap.add_argument("--kernel-shape", default="64x8192", help="kernel part: batch x context (default %(default)s)")
    ap.add_argument("--configs", default="", help="kernel part: sweep these instead of KERNEL_CONFIGS, e.g. "
                    "256x8x2,128x4x4x2 (block_n x num_warps x num_stages [x num_splits])")
    ap.add_argument("--rotate", action="store_true", help="kernel part: rotate in the kernel (int4/int2 in the engine)")
    ap.add_argument("--unfused-rotation", action="store_true",
                    help="engine parts: rotate int4/int2 q/k/v/out around the Triton kernels (as before they fused it)")
    ap.add_argument("--no-value-fold", action="store_true",
                    help="engine parts: keep the int4/int2 value rotation out of the weights (bind_value_rotation "
                         "off: the kernels rotate v and the output, as before it was folded)")
    ap.add_argument("--no-residual", action="store_true",
                    help="engine parts: int4/int2 without the exact filling block (KVFormat.residual off: every "
                         "key read through the quantized cache, as before kv_residual)")
    ap.add_argument("--code-paths", default="", help="e.g. fast_cvt=0,lane_split=0,unpack=asm: kv_load.CODE_PATHS "
                    "for every part (the engine runs in this process); recorded in each record")
    ns = ap.parse_args()
    if ns.cpu_smoke:  # before the first kvserve import: the kernels are decorated then
        os.environ["TRITON_INTERPRET"] = "1"
    from kvserve.attention.triton.kv_load import CODE_PATHS

    for kv in filter(None, ns.code_paths.split(",")):
        key, val = kv.split("=")
        if key not in CODE_PATHS:
            raise SystemExit(f"--code-paths: unknown {key!r} (choices: {sorted(CODE_PATHS)})")
        CODE_PATHS[key] = val if key == "unpack" or val == "packed" else val == "1"
    if ns.unfused_rotation:
        from kvserve.attention.triton.backend import TritonBackend

        TritonBackend.fuses_kv_rotation = False
    if ns.no_value_fold:
        import kvserve.layers.attention as attn_layer

        attn_layer.bind_value_rotation = lambda model: None
    if ns.no_residual:
        import dataclasses

        from kvserve.core.kv_cache_spec import KV_FORMATS

        for name in ("int4", "int2"):
            KV_FORMATS[name] = dataclasses.replace(KV_FORMATS[name], residual=False)
    os.makedirs(ns.out, exist_ok=True)
    os.makedirs(ns.tmp, exist_ok=True)
    dtypes = ns.dtypes.split(",")
    custom = [tuple(([int(x) for x in c.split("x")] + [None] * 4)[:4]) + (None, None)
              for c in filter(None, ns.configs.split(","))]  # block_n x warps x stages [x splits]
    recs = []
    if ns.cpu_smoke:
        smoke_cfgs = [(32, 4, 1, None, None, None), (None, None, None, 1, None, None),
                      (None, None, None, None, False, False)]
        for d in dtypes:
            for rec in kernel_bench(d, "cpu", 2, 40, 2, 4, 16, configs=smoke_cfgs, rotate=ns.rotate):
                recs.append(rec)
                _record(ns.out, rec)
        return
    for part in ns.parts.split(","):
        for d in dtypes:
            try:
                if part == "kernel":
                    kb, kc = (int(x) for x in ns.kernel_shape.split("x"))
                    *head, rec = kernel_bench(d, "cuda", kb, kc, 8, 16, 128,
                                              configs=() if ns.no_sweep else custom or KERNEL_CONFIGS, rotate=ns.rotate)
                    for r in head:  # the default config first, then the sweep (rec: its last)
                        recs.append(r)
                        _record(ns.out, r)
                elif part == "step":
                    rec = step_bench(d, ns.tmp, 64, 8192)
                elif part == "b1":
                    rec = b1_bench(d, ns.tmp)
                elif part == "w1":
                    rec = w1_bench(d, ns.tmp)
                else:
                    raise ValueError(f"unknown part {part}")
            except Exception as exc:  # noqa: BLE001 - one failure must not stop the rest
                traceback.print_exc()
                rec = dict(part=part, kv_cache_dtype=d, error=f"{type(exc).__name__}: {exc}")
                torch.cuda.empty_cache()
            rec.setdefault("code_paths", dict(CODE_PATHS))
            rec.setdefault("rotation", "unfused" if ns.unfused_rotation else "fused")
            rec.setdefault("value_rotation", "kernels" if ns.no_value_fold else "weights")
            rec.setdefault("exact_filling_block", not ns.no_residual and d in ("int4", "int2"))
            if part == "kernel":
                rec["rotate"] = ns.rotate
            recs.append(rec)
            _record(ns.out, rec)
    base = {r["part"]: r for r in recs if r.get("kv_cache_dtype") == "bfloat16" and "error" not in r}
    print(f"\n{'part':<13}{'dtype':<10}{'figure':>16}{'vs bf16':>9}{'GB/s':>9}")
    for r in recs:
        key = {"kernel": "ms", "kernel_cfg": "ms", "step": "ms_per_step", "b1": "ms_per_step",
               "w1": "output_tok_per_s"}.get(r["part"])
        v = r.get(key)
        b = base.get("kernel" if r["part"] == "kernel_cfg" else r["part"], {}).get(key)
        ratio = f"{v / b:.2f}x" if v and b else "-"
        part = r["part"] if r["part"] != "kernel_cfg" else \
            f"{r['block_n'] or '-'}x{r['num_warps'] or '-'}w{r['num_stages'] or '-'}s{r['num_splits'] or ''}" \
            f"{' int' if r.get('fast_cvt') else ''}{' lanes' if r.get('lane_split') else ''}"
        print(f"{part:<13}{r['kv_cache_dtype']:<10}{(str(v) if v is not None else r.get('error', '')[:16]):>16}"
              f"{ratio:>9}{r.get('gb_per_s', ''):>9}")


if __name__ == "__main__":
    main()
