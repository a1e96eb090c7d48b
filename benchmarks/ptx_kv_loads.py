"""Compile the Triton attention kernels for an H100 (sm_90) without a GPU and count the
global-memory access widths in the PTX: a check that the quantized KV page layout
(``kvserve/attention/kv_quant.py``) lets the compiler load code rows as 16-byte vectors.

Specializes the arguments as the runtime would at the Qwen3-0.6B decode shape (16 query
heads, 8 KV heads, head dim 128, block 16): pointers and ints divisible by 16 get
``tt.divisibility=16``, ints equal to 1 become constants, ``do_not_specialize`` ints stay
plain. The decode and prefill kernels use the tile configs the runtime picks
(``decode._config`` / ``prefill._config``). Prints, per kernel and format, the counts of
``cp.async`` / ``ld.global`` / ``st.global`` instructions by width (static counts in the PTX,
not dynamic ones), then ``scales:`` the loads of the scale words (the only 2-D tensors of
int32 pointers: ``kv_load.kv_scale_index``) as Triton's GPU IR has them after pipelining:
``async_copy`` (a ``cp.async`` of the software pipeline) or ``load`` (a plain load in the loop),
the tile shape and the bytes per thread per access (from the layout's ``sizePerThread``),
with counts (prologue copies of the pipeline included).
``--regs`` adds registers / spill bytes per thread from ``ptxas -v`` (Triton's bundled ptxas);
``--fp8-dot`` the e4m3 decode kernel's FP8-dot path too (``decode.DECODE_PATHS``; ``fp8_qk``: Q K^T
only, ``fp8_pv`` False);
``--ops`` static counts of shared-memory, conversion and unpacking instructions; ``--unpack``
the int4/int2 decode variants compiled (``kv_load.CODE_PATHS["unpack"]``); ``--dump DIR`` each
kernel's TTGIR and PTX.

Usage: PYTHONPATH=. python3 benchmarks/ptx_kv_loads.py [--dtypes bfloat16,fp8_e4m3,int8,int4,int2] [--regs]
    [--ops] [--unpack int32,asm,asm_i8qk] [--fp8-dot [--fp8-dot-bucket many]] [--dump DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # compile for real; nothing is launched

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from kvserve.attention.triton import decode, kv_store, prefill  # noqa: E402
from kvserve.attention.triton.kv_load import (KV_FMT_CODES, use_fast_cvt, use_lane_split,  # noqa: E402
                                               use_unpack)
from kvserve.core.kv_cache_spec import get_kv_format  # noqa: E402

H, HKV, D, BS = 16, 8, 128, 16


def _compile(kern, ptrs: dict, ints: dict, consts: dict, no_spec=(), num_warps=4, num_stages=2):
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(kern.arg_names):
        if n in ptrs:
            sig[n] = ptrs[n]
            if ptrs[n].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ints:
            v = ints[n]
            if v == 1 and n not in no_spec:
                sig[n], constexprs[(i,)] = "constexpr", 1
            else:
                sig[n] = "i32"
                if v % 16 == 0 and n not in no_spec:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n], constexprs[(i,)] = "constexpr", consts[n] if n in consts else kern.params[i].default
    target = GPUTarget("cuda", 90, 32)
    opts = make_backend(target).parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=constexprs, attrs=attrs), target=target,
                          options=opts.__dict__)


def _widths(ptx: str) -> dict:
    ops = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^\]]*\], \[[^\]]*\], (0x[0-9a-f]+|\d+)", ptx)
    c = Counter(f"cp.async/{int(w, 0)}B" for w in ops)
    c.update(re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*", ptx))
    return dict(sorted(c.items()))


def _scale_loads(ttgir: str) -> list[str]:
    """The scale-word loads of a kernel's GPU IR: ``kind shape bytes-per-thread`` each."""
    layouts = {m[0]: m[1] for m in re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\]",
                                              ttgir, re.M)}
    out = []
    for kind, shape, lay in re.findall(r"(tt\.load|ttg\.async_copy_global_to_local) %[^:]*: "
                                       r"tensor<(\d+x\d+)x!tt\.ptr<i32>, (#blocked\d*)>", ttgir):
        per = [int(x) for x in layouts.get(lay, "1").split(",")]
        out.append(f"{'async_copy' if 'async' in kind else 'load'} {shape}xi32 {4 * per[-1]}B/thread")
    return out


def _regs(ptx: str) -> str:
    """``ptxas -v`` registers and spill bytes per thread for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    return f"regs={regs[-1] if regs else '?'} spill={spill[-1] if spill else '?'}B"


_OPS = ("ld.shared", "st.shared", "ldmatrix", "stmatrix", "mma.sync", "cvt", "prmt", "lop3", "shr", "and.b",
        "or.b", "sub.f16x2", "sub.f16", "fma.rn.f16x2", "bar.sync", "ex2", "cp.async.ca", "cp.async.cg",
        "shfl.sync")


def _op_counts(ptx: str) -> dict:
    """Static counts of a few instruction kinds in the PTX (the whole kernel, not per loop trip):
    shared-memory traffic (layout conversions, the pipeline), conversions and the integer ops
    that unpack codes."""
    names = re.findall(r"^\s*(?:@%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    return {op: n for op in _OPS if (n := sum(1 for x in names if x.startswith(op)))}


def _show(label: str, ck, ns) -> None:
    extra = f" scales: {dict(Counter(_scale_loads(ck.asm['ttgir'])))}" if "store" not in label else ""
    print(label, _widths(ck.asm["ptx"]), extra + (f" {_regs(ck.asm['ptx'])}" if ns.regs else ""), flush=True)
    if ns.ops:
        print("   ops:", _op_counts(ck.asm["ptx"]), flush=True)
    if ns.dump:
        os.makedirs(ns.dump, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9=]+", "_", label.strip())
        for kind in ("ttgir", "ptx"):
            with open(os.path.join(ns.dump, f"{stem}.{kind}"), "w") as f:
                f.write(ck.asm[kind])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,fp8_e4m3,int8,int4,int2")
    ap.add_argument("--regs", action="store_true", help="registers / spills per thread (ptxas -v)")
    ap.add_argument("--ops", action="store_true", help="static counts of shared-memory, conversion and unpacking "
                    "instructions in the PTX")
    ap.add_argument("--unpack", default="int32,asm", help="int4/int2 decode: the kv_load.CODE_PATHS "
                    "'unpack' variants to compile (default %(default)s)")
    ap.add_argument("--fp8-dot", action="store_true", help="fp8_e4m3 decode: also the FP8-dot path "
                    "(decode.DECODE_PATHS['fp8_dot']) with its FP8_DOT_CONFIGS tile")
    ap.add_argument("--fp8-dot-bucket", default="many", choices=("few", "mid", "many"),
                    help="the FP8_DOT_CONFIGS entry compiled with --fp8-dot (default %(default)s)")
    ap.add_argument("--dump", default="", help="write each kernel's TTGIR and PTX into this directory")
    ns = ap.parse_args()
    for name in ns.dtypes.split(","):
        fmt = get_kv_format(name)
        code = KV_FMT_CODES.get(name, 0)
        row = fmt.row_elems(D)
        if code:  # page stride in bytes, then the codes region's strides (kv_load.cache_strides)
            c = D * fmt.bits // 8
            cs = dict(stride_cb=BS * HKV * row, stride_co=HKV * c, stride_ch=c, stride_cd=1)
            pk = "*u8"
        else:
            cs = dict(stride_cb=BS * HKV * D, stride_co=HKV * D, stride_ch=D, stride_cd=1)
            pk = "*bf16"
        q = dict(stride_qt=H * D, stride_qh=D, stride_qd=1)
        o = dict(stride_ot=H * D, stride_oh=D, stride_od=1)
        lane_split = use_lane_split(code, D)
        residual = code >= 4  # int4/int2 run with the exact filling block in the engine
        res_ptrs = dict(res_k_ptr="*bf16", res_v_ptr="*bf16", new_k_ptr="*bf16", new_v_ptr="*bf16",
                        res_slots_ptr="*i32")
        res_ints = dict(stride_rs=2 * BS * HKV * D, stride_rr=HKV * D, stride_rh=D, stride_nkt=HKV * D,
                        stride_nkh=D, stride_nvt=HKV * D, stride_nvh=D)
        unpacks = ns.unpack.split(",") if code >= 4 and lane_split else ["int32"]
        if code == 1 and ns.fp8_dot:  # e4m3: the conversion path, then the FP8-dot path
            unpacks = ["int32", "fp8_dot", "fp8_qk"]
        for direct in (False, True):
            for unpack in unpacks:
                fp8_dot = unpack in ("fp8_dot", "fp8_qk")
                unpack_code = 0 if fp8_dot else use_unpack(code, True, True, unpack)
                bn, warps, stages = decode._config(D, torch.bfloat16, False, code, lane_split, unpack_code)
                keys_rows = False
                if fp8_dot:
                    cfg = decode.FP8_DOT_CONFIGS[ns.fp8_dot_bucket]
                    bn, warps, stages, keys_rows = cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.fp8_keys_rows
                ck = _compile(
                    decode._decode_split_kernel,
                    dict(q_ptr="*bf16", k_cache_ptr=pk, v_cache_ptr=pk, block_tables_ptr="*i32",
                         seq_lens_ptr="*i32", query_start_loc_ptr="*i32", out_ptr="*bf16", part_out_ptr="*fp32",
                         part_lse_ptr="*fp32", qk_scale="fp32", window="i32", num_splits="i32", **res_ptrs,
                         sinks_ptr="*bf16", counter_ptr="*i32"),
                    dict(**q, **cs, **o, stride_bt=513, **res_ints),
                    dict(GROUP=H // HKV, G_PAD=64 if fp8_dot and not keys_rows else 16, HEAD_DIM=D, BLOCK_SIZE=BS,
                         BLOCK_N=bn, DIRECT=direct, USE_WINDOW=False, DOT_PREC="tf32", WIDEN=False, KV_FMT=code,
                         FP16_DOT=code > 0, FAST_CVT=use_fast_cvt(code), LANE_SPLIT=lane_split, ROTATE=False,
                         HAS_RESIDUAL=residual, EXACT_N=BS, UNPACK=unpack_code, FP8_DOT=int(fp8_dot),
                         FP8_T=keys_rows, FP8_PV=unpack != "fp8_qk"),
                    no_spec=("window", "num_splits", "stride_bt"), num_warps=warps, num_stages=stages)
                label = f"{name:9s} decode{'(direct)' if direct else '(split) '} {bn}x{warps}wx{stages}s"
                _show(label + (f" {'path' if code == 1 else 'unpack'}={unpack}" if len(unpacks) > 1 else ""), ck, ns)
        bm, bn, warps, stages = prefill._config(D, torch.bfloat16, H // HKV, False)
        ck = _compile(
            prefill._prefill_kernel,
            dict(q_ptr="*bf16", k_cache_ptr=pk, v_cache_ptr=pk, out_ptr="*bf16", block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", query_start_loc_ptr="*i32", qk_scale="fp32", window="i32", req_offset="i32",
                 **res_ptrs, sinks_ptr="*bf16", tree_mask_ptr="*i64", tree_start_ptr="*i32"),
            dict(**q, **cs, **o, stride_bt=513, **res_ints),
            dict(GROUP=H // HKV, HEAD_DIM=D, BLOCK_SIZE=BS, BLOCK_M=bm, BLOCK_Q=bm // (H // HKV), BLOCK_N=bn,
                 USE_WINDOW=False, DOT_PREC="tf32", WIDEN=False, KV_FMT=code, FP16_DOT=code > 0,
                 FAST_CVT=use_fast_cvt(code), HAS_RESIDUAL=residual),
            no_spec=("window", "req_offset", "stride_bt"), num_warps=warps, num_stages=stages)
        _show(f"{name:9s} prefill  {bm}x{bn}x{warps}w", ck, ns)
        ck = _compile(
            kv_store._store_kv_kernel,
            dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr=pk, v_cache_ptr=pk, slot_ptr="*i64",
                 q_ptr="*bf16", q_out_ptr="*bf16", k_out_ptr="*bf16", v_out_ptr="*bf16", res_k_ptr="*bf16",
                 res_v_ptr="*bf16", res_map_ptr="*i64"),
            dict(stride_kt=HKV * D, stride_kh=D, stride_kd=1, stride_vt=HKV * D, stride_vh=D, stride_vd=1, **cs,
                 stride_qt=H * D, stride_qh=D, stride_qd=1),
            dict(NUM_KV_HEADS=HKV, BLOCK_H=HKV, HEAD_DIM=D, BLOCK_SIZE=BS, KV_FMT=code,
                 QMAX=kv_store._QMAX_BY_CODE.get(code, 1.0), MIN_SCALE=2.0 ** -14, ROTATE=False, DOT_PREC="tf32",
                 WIDEN=False, ROTATE_V=False, NUM_HEADS=0, Q_ROWS=16, K_OUT=False, V_OUT=False, RES_OUT=residual),
            num_stages=3)
        _show(f"{name:9s} store          ", ck, ns)


if __name__ == "__main__":
    main()
