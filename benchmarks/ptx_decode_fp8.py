"""The paged decode kernel's FP8 KV variants compiled for sm_90 without a GPU: per-thread static
counts of the per-byte work (conversions, shared-memory traffic, MMAs), registers, shared memory and
the software pipeline's buffers, beside bf16's default.

The Llama-3.1-8B layer (32 query heads, 8 KV heads: GROUP 4, head dim 128, 16-token pages), the
direct (one-split) variant. Rows: bf16 and the e4m3 conversion path at their ``DECODE_CONFIGS``
tiles, then the FP8-dot path's tiles (``fp8_qk``: Q K^T only on e4m3, ``DecodeConfig.fp8_pv``
False; ``fp8_dot``: P V on e4m3 too). ``bufs`` lists the pipeline's shared-memory buffers from
the TTGIR (``NxSHAPE``: N buffers of a tile; 1 means the load is not in flight across steps),
``v_bytes``: the conversion path with V read as bytes into the operand layout (``DecodeConfig.v_bytes``),
``waits`` the ``async_wait`` counts. Results: docs/benchmarks/decode-kernel.md.

Usage: PYTHONPATH=. python3 benchmarks/ptx_decode_fp8.py [--regs]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

from ptx_kv_loads import _compile, _op_counts, _regs  # sets up the compile-only environment

from kvserve.attention.triton import decode

H, HKV, D, BS = 32, 8, 128, 16
# (label, block_n, warps, stages, fp8_dot, keys_rows, fp8_pv[, v_bytes]); fp8_dot None: bf16 KV
ROWS = [
    ("bf16 default", 64, 2, 4, None, False, True),
    ("fp8 conversion default", 64, 2, 5, False, False, True),
    ("fp8 conversion v_bytes", 64, 2, 5, False, False, True, True),
    ("fp8 conversion v_bytes", 64, 4, 3, False, False, True, True),
    ("fp8 fp8_qk keys", 64, 4, 3, True, True, False),
    ("fp8 fp8_qk keys", 64, 4, 5, True, True, False),
    ("fp8 fp8_qk keys", 128, 4, 3, True, True, False),
    ("fp8 fp8_qk keys", 128, 8, 3, True, True, False),
    ("fp8 fp8_qk query rows", 64, 4, 3, True, False, False),
    ("fp8 fp8_dot keys", 128, 4, 3, True, True, True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regs", action="store_true", help="registers / spills per thread (ptxas -v)")
    ns = ap.parse_args()
    q = dict(stride_qt=H * D, stride_qh=D, stride_qd=1)
    o = dict(stride_ot=H * D, stride_oh=D, stride_od=1)
    res_ptrs = dict(res_k_ptr="*bf16", res_v_ptr="*bf16", new_k_ptr="*bf16", new_v_ptr="*bf16", res_slots_ptr="*i32")
    res_ints = dict(stride_rs=2 * BS * HKV * D, stride_rr=HKV * D, stride_rh=D, stride_nkt=HKV * D, stride_nkh=D,
                    stride_nvt=HKV * D, stride_nvh=D)
    for label, bn, warps, stages, fp8_dot, keys_rows, fp8_pv, *v_bytes in ROWS:
        bf16 = fp8_dot is None
        if bf16:
            cs, pk = dict(stride_cb=BS * HKV * D, stride_co=HKV * D, stride_ch=D, stride_cd=1), "*bf16"
        else:  # e4m3 pages: codes, then 2-byte scales (kv_load.cache_strides)
            cs, pk = dict(stride_cb=BS * HKV * (D + 2), stride_co=HKV * D, stride_ch=D, stride_cd=1), "*u8"
        ck = _compile(
            decode._decode_split_kernel,
            dict(q_ptr="*bf16", k_cache_ptr=pk, v_cache_ptr=pk, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                 query_start_loc_ptr="*i32", out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32",
                 qk_scale="fp32", window="i32", num_splits="i32", **res_ptrs, sinks_ptr="*bf16", counter_ptr="*i32"),
            dict(**q, **cs, **o, stride_bt=513, **res_ints),
            dict(GROUP=H // HKV, G_PAD=64 if fp8_dot and not keys_rows else 16, HEAD_DIM=D, BLOCK_SIZE=BS,
                 BLOCK_N=bn, DIRECT=True, USE_WINDOW=False, DOT_PREC="tf32", WIDEN=False, KV_FMT=0 if bf16 else 1,
                 FP16_DOT=not bf16, FAST_CVT=False, LANE_SPLIT=False, ROTATE=False, HAS_RESIDUAL=False, EXACT_N=BS,
                 UNPACK=0, FP8_DOT=int(bool(fp8_dot)), FP8_T=keys_rows, FP8_PV=fp8_pv, V_BYTES=bool(v_bytes)),
            no_spec=("window", "num_splits", "stride_bt"), num_warps=warps, num_stages=stages)
        ptx, ttgir = ck.asm["ptx"], ck.asm["ttgir"]
        ops = _op_counts(ptx)
        mma = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.", ptx))
        mma_s = {f"wgmma {k[1]} {k[0]}": n for k, n in mma.items()}
        if ops.get("mma.sync"):
            mma_s["mma.sync"] = ops["mma.sync"]
        bufs = re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+x[0-9x]+[a-zA-Z0-9]+)", ttgir)
        waits = sorted(set(re.findall(r"async_wait[^\n]*?num = (\d+)", ttgir)), key=int)
        print(f"{label} {bn}x{warps}x{stages}: {_regs(ptx) if ns.regs else ''} smem={ck.metadata.shared}B "
              f"cvt.e4m3x2={ptx.count('cvt.rn.f16x2.e4m3x2')} ld.shared={ops.get('ld.shared', 0)} "
              f"st.shared={ops.get('st.shared', 0)} ldmatrix={ops.get('ldmatrix', 0)} prmt={ops.get('prmt', 0)} "
              f"mma={mma_s} bufs={bufs} waits={waits}", flush=True)


if __name__ == "__main__":
    main()
