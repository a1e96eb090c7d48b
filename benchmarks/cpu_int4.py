"""CPU: one INT4 projection, PyTorch's int4pack kernel vs ``cpu_int4`` (unpack + dense matmul) vs dense.

Shapes are SmolLM2-135M's decoder projections as kvserve fuses them (qkv 960 x 576, o 576 x 576,
gate_up 3072 x 576, down 576 x 1536), group 64 (GPTQ default-model test) or 128, float32
activations (the CPU tests' dtype), M = 1 (decode) and M = 64 (a prefill chunk / batch). The three
paths run interleaved ``--reps`` times each; medians of wall ms and of thread CPU ms (less disturbed by
other jobs on a shared machine) are printed and written as JSON.

    python benchmarks/cpu_int4.py --threads 1 --out benchmarks/results/weight_quant/cpu_int4.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from kvserve.layers.quantization.cpu_int4 import CpuInt4
from kvserve.layers.quantization.kernels import quantize_int4

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}


def int4pack(w4):
    """The previous CPU path: ``_weight_int4pack_mm_for_cpu`` with ``zero = min + 8 * scale`` (float32)."""
    sz = torch.stack([w4.scale, w4.min + 8 * w4.scale], -1).transpose(0, 1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4.q.to(torch.int32), 1)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, w4.group_size, sz)


def timed(fn, x) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    fn(x)
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: thread CPU time is meaningful)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--m", default="1,64", help="activation rows, comma-separated")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w4 = quantize_int4(torch.randn(n, k) * 0.05, args.group_size)
        ref = w4.dequantize()
        paths = {"int4pack": int4pack(w4),
                 "cpu_int4": CpuInt4(w4.q, w4.scale, w4.min, w4.group_size, "affine").matmul,
                 "dense_f32": lambda x, w=ref: F.linear(x, w)}
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k)
            assert torch.equal(paths["cpu_int4"](x), paths["dense_f32"](x))  # the same weight, bit for bit
            wall = {p: [] for p in paths}
            cpu = {p: [] for p in paths}
            for p, fn in paths.items():
                fn(x)  # warm-up
            for _ in range(args.reps):
                for p, fn in paths.items():
                    a, b = timed(fn, x)
                    wall[p].append(a)
                    cpu[p].append(b)
            row = {"proj": name, "n": n, "k": k, "m": m}
            for p in paths:
                row[f"{p}_ms"] = round(statistics.median(wall[p]), 4)
                row[f"{p}_cpu_ms"] = round(statistics.median(cpu[p]), 4)
            row["speedup_vs_int4pack"] = round(row["int4pack_cpu_ms"] / row["cpu_int4_cpu_ms"], 2)
            rows.append(row)
            print(json.dumps(row))
    res = {"bench": "cpu_int4", "threads": args.threads, "reps": args.reps, "group_size": args.group_size,
           "dtype": "float32", "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "machine": platform.machine(), "rows": rows,
           "command": "python benchmarks/cpu_int4.py --threads 1 --out benchmarks/results/weight_quant/cpu_int4.json"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
