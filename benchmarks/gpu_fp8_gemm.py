"""GPU: FP8 GEMMs at the Llama-3.1-8B projections, and the W4 workload with FP8 W8A8.

Parts:

* ``gemm`` — (run second; stops at ``--deadline``, its JSON written after each shape) per call (CUDA-graph replay, ``gpu_weight_quant._time``) at M = 1, 16, 64, 256, 512, 1024
  for (N, K) in qkv (6144, 4096), o (4096, 4096), gate_up (28672, 4096), down (4096, 14336):
  ``bf16`` (``F.linear``, cuBLAS; also what a block checkpoint dequantized at load runs), ``wonly``
  (the FP8 weight-only Triton GEMV, M <= 64), ``w8a8`` (per-token activation quantization kernel +
  ``torch._scaled_mm`` row-wise), ``w8a8_fused`` (``_scaled_mm`` alone: the input came from the fused
  RMSNorm + quantization), ``quant`` (the quantization kernel alone), ``block`` (per-128-group
  quantization + the Triton 128 x 128 block-scaled GEMM). us and TFLOP/s (2 M N K / t). Prints the
  cut-over: the smallest M from which W8A8 (with its quantization) beats the weight-only GEMV summed
  over the four projections (``fp8_w8a8.W8A8_MIN_M`` is set from it).
* ``w4`` — (run first) ``workloads.py --workload w4`` with ``quantization=fp8`` and ``--kv-cache-dtype fp8_e4m3``:
  1000/1000 then 128/128, each engine in its own process; output tok/s beside TensorRT-LLM's 17,744 /
  27,911.

    PYTHONPATH=. python3 benchmarks/gpu_fp8_gemm.py --out $OUT [--parts w4,gemm] [--deadline S] [--cpu-smoke]

``--cpu-smoke``: tiny shapes on the CPU (Triton interpreter, FP8 emulation) to check the script.
JSON records to ``--out/fp8_gemm.json`` (and ``w4_fp8.json``); a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
MS = (1, 16, 64, 256, 512, 1024)
SMOKE_SHAPES = {"qkv": (96, 256), "down": (64, 384)}
SMOKE_MS = (1, 16, 64)


def _time(fns, device: str, iters: int) -> float:
    from gpu_weight_quant import _time as t

    return t(fns, device, iters)


T0 = time.time()


def gemm(a: argparse.Namespace, save=None) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kvserve.layers.quantization import QuantizedLinear
    from kvserve.layers.quantization import fp8_w8a8 as f8
    from kvserve.layers.quantization import triton_fp8 as tf
    from kvserve.layers.quantization import triton_gemv as tg

    dev = "cpu" if a.cpu_smoke else "cuda"
    shapes, ms = (SMOKE_SHAPES, SMOKE_MS) if a.cpu_smoke else (SHAPES, MS)
    iters = 2 if a.cpu_smoke else 10
    rows = []
    torch.manual_seed(0)
    for name, (n, k) in shapes.items():
        if a.deadline and time.time() - T0 > a.deadline:
            print(f"deadline ({a.deadline} s) reached: shapes from {name} on not measured", flush=True)
            break
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02)
        w = lin.weight.detach()
        ql = QuantizedLinear.from_dense(lin, "fp8", torch.bfloat16)
        p = ql.packed
        wq_rows = p.qt.t()[:n, :k].contiguous()  # [N, K] fp8 row-major (the GEMV's and the block GEMM's layout)
        wb, wbs = f8.quantize_act_ref(w.float(), 128)  # per row per 128 columns (block-checkpoint layout)
        wb, wbs = wb.to(dev), wbs.to(dev)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = f8.quantize_act(x)
            xbq, xbs = f8.quantize_act(x, 128)
            fns = {
                "bf16": lambda: F.linear(x, w),
                "quant": lambda: f8.quantize_act(x),
                "w8a8": lambda: p._scaled_mm(*f8.quantize_act(x), torch.bfloat16),
                "w8a8_fused": lambda: p._scaled_mm(xq, xs, torch.bfloat16),
                "block": lambda: tf.block_gemm(*f8.quantize_act(x, 128), wb, wbs, torch.bfloat16),
            }
            if m <= tg.MAX_M:
                fns["wonly"] = lambda: tg.wgemv(x, tg.FMT_FP8, wq_rows.view(torch.uint8), p.scale.reshape(-1)[:n],
                                                None, n)
            if a.cpu_smoke:  # the numerics once: W8A8 and block against the float product
                ref = x.float() @ w.float().T
                for key in ("w8a8", "block"):
                    y = fns[key]().float()
                    assert ((y - ref).norm() / ref.norm()).item() < f8.W8A8_REL_BOUND, (name, m, key)
                del fns["quant"]  # the smoke run times the rest only once
            rec = dict(shape=name, n=n, k=k, m=m)
            for key, fn in fns.items():
                try:
                    us = _time([fn], dev, iters) * 1e3
                except Exception as e:  # one failing kernel must not lose the rest of the sweep
                    rec[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"{name} M={m} {key}: {rec[f'{key}_error']}", file=sys.stderr, flush=True)
                    continue
                rec[f"{key}_us"] = round(us, 2)
                if key != "quant":
                    rec[f"{key}_tflops"] = round(2 * m * n * k / (us * 1e-6) / 1e12, 1)
            print(json.dumps(rec), flush=True)
            rows.append(rec)
        if save is not None:
            save(rows)  # after each shape: a part killed at its limit keeps what it measured
    return rows


def cut_over(rows: list[dict]) -> int | None:
    """The smallest M from which W8A8 (with quantization) is faster than weight-only, summed over the shapes."""
    best = None
    for m in sorted({r["m"] for r in rows}, reverse=True):
        at = [r for r in rows if r["m"] == m]
        if not all("wonly_us" in r and "w8a8_us" in r for r in at):
            continue
        if sum(r["w8a8_us"] for r in at) < sum(r["wonly_us"] for r in at):
            best = m
        else:
            break
    return best


def table(rows: list[dict]) -> str:
    keys = ("bf16", "wonly", "w8a8", "w8a8_fused", "block")
    out = ["| shape | M | " + " | ".join(f"{k} us (TFLOP/s)" for k in keys) + " | quant us |",
           "|" + "---|" * (len(keys) + 3)]
    for r in rows:
        cells = [f"{r[k + '_us']} ({r[k + '_tflops']})" if k + "_us" in r else "-" for k in keys]
        out.append(f"| {r['shape']} | {r['m']} | " + " | ".join(cells) + f" | {r.get('quant_us', '-')} |")
    return "\n".join(out)


def w4(a: argparse.Namespace) -> list[dict]:
    """W4 with FP8 weights (W8A8) + FP8 KV, 1000/1000 then 128/128, one child process each."""
    res = []
    env = dict(os.environ)
    if a.cpu_smoke:
        env["KVSERVE_FP8_EMULATE"] = "1"
    for io in ("1000/1000", "128/128"):
        path = os.path.join(a.out, f"w4_fp8_{io.replace('/', '_')}.json")
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "workloads.py"), "--workload", "w4",
               "--isl-osl", io, "--engine-arg", "quantization=fp8", "--kv-cache-dtype", "fp8_e4m3", "--out", path]
        cmd += ["--tiny"] * a.cpu_smoke
        t = time.time()
        rc = subprocess.run(cmd, env=env).returncode
        rec = json.load(open(path)) if rc == 0 and os.path.exists(path) else dict(isl_osl=io, rc=rc)
        rec["process_s"] = round(time.time() - t, 1)
        res.append(rec)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="w4,gemm")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds from start after which the GEMM sweep stops (0: none)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (interpreter, emulation)")
    a = ap.parse_args()
    if a.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module imports triton
    os.makedirs(a.out, exist_ok=True)
    from workloads import environment

    parts = a.parts.split(",")
    rec = dict(environment(), date=time.strftime("%Y-%m-%d", time.gmtime()))
    if "w4" in parts:  # first: the targets; the GEMM sweep stops at --deadline
        res = w4(a)
        with open(os.path.join(a.out, "w4_fp8.json"), "w") as f:
            json.dump(res, f, indent=1)
        print("| W4 FP8 W8A8 + FP8 KV | output tok/s | TensorRT-LLM FP8 | ratio |")
        for r in res:
            for io, v in ((k, v) for k, v in r.items() if isinstance(v, dict) and "output_tok_per_s" in v):
                print(f"| {io} | {v['output_tok_per_s']:,.0f} | {v['trtllm_fp8_tok_per_s']:,} | {v['vs_trtllm']} |")
            if "rc" in r:
                print(f"| {r['isl_osl']} | failed rc={r['rc']} | | |")
    if "gemm" in parts:
        def save(rows):
            rec["gemm"], rec["cut_over_m"] = rows, cut_over(rows)
            with open(os.path.join(a.out, "fp8_gemm.json"), "w") as f:
                json.dump(rec, f, indent=1)

        rows = gemm(a, save)
        save(rows)
        from kvserve.layers.quantization.fp8_w8a8 import W8A8_MIN_M

        print(table(rows))
        c = rec["cut_over_m"]
        print(f"cut-over: W8A8 beats the weight-only GEMV from M = {c} on" if c is not None else
              "cut-over: W8A8 does not beat the weight-only GEMV at any M it serves (<= 64)",
              f"(W8A8_MIN_M is {W8A8_MIN_M}: weight-only for M <= it)", flush=True)


if __name__ == "__main__":
    main()
