"""Compile the prefill kernel's paged-prefix path for an H100/H200 (sm_90) without a GPU and
count what its tensor-core products and K/V tiles turn into: ``wgmma`` (Hopper's asynchronous
MMA, by operand types) or ``mma.sync``, ``cp.async`` copies, shared-memory traffic, conversions,
registers and spills (``ptxas -v``). One chunk over a cached prefix at the Llama-3.1-8B attention
shape (32 query heads, 8 KV heads, head dim 128, block size 16; ``NEW_KV``: the chunk's own keys
from its rows, the prefix from the pages), per KV dtype and ``prefill.PREFILL_PATHS`` switch.
Static counts in the whole kernel (the own-key loops included), not per loop trip.

Usage: PYTHONPATH=. python3 benchmarks/ptx_prefill.py [--dump DIR] [--stages N]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real; nothing is launched
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from kvserve.attention.triton import prefill  # noqa: E402
from ptx_kv_loads import _compile, _op_counts, _regs  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 16
#: (label, KV dtype, constexpr overrides)
VARIANTS = [
    ("bf16", "bfloat16", {}),
    ("bf16 page_tiles", "bfloat16", dict(PAGE_TILES=True)),
    ("bf16 prefix_stages=5", "bfloat16", dict(PREFIX_STAGES=5)),
    ("bf16 prefetch_ids", "bfloat16", dict(PREFETCH_IDS=True)),
    ("fp8", "fp8_e4m3", {}),
    ("fp8 fp8_qk", "fp8_e4m3", dict(FP8_QK=1)),
    ("fp8 fp8_qk prefetch_ids", "fp8_e4m3", dict(FP8_QK=1, PREFETCH_IDS=True)),
    ("fp8 fp8_qk+fp8_pv", "fp8_e4m3", dict(FP8_QK=1, FP8_PV=1)),
    ("fp8 fp8_qk+fp8_pv page_tiles", "fp8_e4m3", dict(FP8_QK=1, FP8_PV=1, PAGE_TILES=True)),
    ("fp8 prefix_stages=5", "fp8_e4m3", dict(PREFIX_STAGES=5)),
    ("fp8 fp8_qk+fp8_pv prefix_stages=5", "fp8_e4m3", dict(FP8_QK=1, FP8_PV=1, PREFIX_STAGES=5)),
]


def _mma_kinds(ptx: str) -> dict:
    """``wgmma`` / ``mma.sync`` instructions by shape and operand types."""
    out: dict = {}
    for m in re.findall(r"(wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[a-z0-9.]+|mma\.sync\.aligned\.[a-z0-9.]+)",
                        ptx):
        out[m] = out.get(m, 0) + 1
    return out


def _prefix_pipeline(ttgir: str) -> str:
    """The paged-prefix loop's software pipeline from the GPU IR: K/V shared buffers (the
    ``NxBLOCK_NxD`` allocations after the first block-table copy) and its ``async_wait`` counts (0:
    every copy in flight waited for at each step, i.e. K/V prefetched one step ahead)."""
    i = ttgir.find("tensor<128x!tt.ptr<i32>")
    if i < 0:
        i = ttgir.find("x!tt.ptr<i32>")
    tail = ttgir[i:]
    bufs = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x(?:bf16|i8|f8E4M3FN)", tail)
    waits = re.findall(r"async_wait [^{]*\{num = (\d+)", tail)
    return f"buffers={bufs[:2]} waits={sorted(set(waits))}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default="", help="write each variant's TTGIR and PTX into this directory")
    ap.add_argument("--stages", type=int, default=0, help="num_stages override (default: the config table's)")
    ap.add_argument("--only", default="", help="comma-separated variant labels")
    ns = ap.parse_args()
    for label, kv, extra in VARIANTS:
        if ns.only and label not in ns.only.split(","):
            continue
        code = 1 if kv == "fp8_e4m3" else 0
        if code:  # page: codes then float16 scales per slot and head (kv_load.cache_strides)
            cs = dict(stride_cb=BS * HKV * (D + 2), stride_co=HKV * D, stride_ch=D, stride_cd=1)
            pk = "*u8"
        else:
            cs = dict(stride_cb=BS * HKV * D, stride_co=HKV * D, stride_ch=D, stride_cd=1)
            pk = "*bf16"
        bm, bn, warps, stages = prefill._config(D, torch.bfloat16, H // HKV, False, code)
        ck = _compile(
            prefill._prefill_kernel,
            dict(q_ptr="*bf16", k_cache_ptr=pk, v_cache_ptr=pk, out_ptr="*bf16", block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", query_start_loc_ptr="*i32", qk_scale="fp32", window="i32", req_offset="i32",
                 res_k_ptr="*bf16", res_v_ptr="*bf16", new_k_ptr="*bf16", new_v_ptr="*bf16", res_slots_ptr="*bf16",
                 sinks_ptr="*bf16", tree_mask_ptr="*bf16", tree_start_ptr="*i32"),
            dict(stride_qt=H * D, stride_qh=D, stride_qd=1, **cs, stride_bt=513, stride_ot=H * D, stride_oh=D,
                 stride_od=1, stride_rs=0, stride_rr=0, stride_rh=0, stride_nkt=HKV * D, stride_nkh=D,
                 stride_nvt=HKV * D, stride_nvh=D),
            {**dict(GROUP=H // HKV, HEAD_DIM=D, BLOCK_SIZE=BS, BLOCK_M=bm, BLOCK_Q=bm // (H // HKV), BLOCK_N=bn,
                 USE_WINDOW=False, DOT_PREC="tf32", WIDEN=False, KV_FMT=code, FP16_DOT=code > 0, FAST_CVT=False,
                 HAS_RESIDUAL=False, HAS_SINKS=False, NEW_KV=True, TREE=False, FP8_QK=0, FP8_PV=0,
                 PAGE_TILES=False, PREFIX_STAGES=0, PREFETCH_IDS=False), **extra},
            no_spec=("window", "req_offset", "stride_bt"), num_warps=warps, num_stages=ns.stages or stages)
        ptx = ck.asm["ptx"]
        print(f"{label:34s} {bm}x{bn}x{warps}w{ns.stages or stages}s {_regs(ptx)} shared={ck.metadata.shared}B "
              f"prefix loop: {_prefix_pipeline(ck.asm['ttgir'])}", flush=True)
        print("   mma:", _mma_kinds(ptx), flush=True)
        print("   ops:", _op_counts(ptx), flush=True)
        if ns.dump:
            os.makedirs(ns.dump, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9]+", "_", label)
            for kind in ("ttgir", "ptx"):
                with open(os.path.join(ns.dump, f"{stem}.{kind}"), "w") as f:
                    f.write(ck.asm[kind])


if __name__ == "__main__":
    main()
