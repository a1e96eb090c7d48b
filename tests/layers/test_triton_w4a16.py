"""Triton W4A16 / W8A16 GEMM (``triton_w4a16``) against a float reference.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (tests/layers/conftest.py) at tiny shapes; every
group size (32/64/128, per channel) and the zero-point conventions (integer ``(q - z) * s`` as GPTQ/AWQ
store it, float ``q * s + m`` as ``--quantization int4`` does, symmetric), M = 1 (FMA path) and M > 1
(``tl.dot``), with and without a K split.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.quantization import triton_w4a16 as tw
from kvserve.layers.quantization.group_quant import GroupQuantWeight, PackedGroupQuant, quantize_groupwise

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32


def _case(n, k, g, zp, bits=4, seed=0):
    """Random packed weight and its float32 dense reference ``[n, k]``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    kp = -(-k // tw.block_rows(bits)) * tw.block_rows(bits)
    ge = kp if g == -1 else g
    groups = -(-kp // ge)
    s = (torch.rand(groups, n, generator=gen) * 0.1 + 0.01).half()
    z = {tw.ZP_SYM: None, tw.ZP_INT: torch.randint(0, 1 << bits, (groups, n), generator=gen, dtype=torch.uint8),
         tw.ZP_FLOAT: torch.randn(groups, n, generator=gen).half()}[zp]
    rep = lambda t: t.float().repeat_interleave(ge, 0)[:k].t()  # noqa: E731
    if zp == tw.ZP_SYM:
        w = (q.float() - (1 << (bits - 1))) * rep(s)
    elif zp == tw.ZP_INT:
        w = (q.float() - rep(z)) * rep(s)
    else:
        w = q.float() * rep(s) + rep(z)
    return tw.pack(q, bits), s, z, ge, w, q


C = tw.Config
# (n, k, group, zero convention, bits, m, config): tiny shapes, each group size and convention covered; M = 1
# (FMA) and M >= 16 (tl.dot), K split with the in-kernel and the separate reduce
CASES = [
    (24, 96, 32, tw.ZP_INT, 4, 1, C(1, 32)),  # K not a multiple of the 128-feature block
    (40, 256, 64, tw.ZP_FLOAT, 4, 3, C(16, 16, split=2)),  # N not a multiple of BLOCK_N, K split (in-kernel reduce)
    (32, 384, 128, tw.ZP_SYM, 4, 1, C(1, 16, nb=2, split=2)),  # 2 blocks per step, the last split's 2nd masked
    (16, 160, -1, tw.ZP_INT, 4, 5, None),  # per channel
    (24, 128, 32, tw.ZP_INT, 8, 2, None),  # 8 bits (GPTQ)
    (32, 256, 32, tw.ZP_INT, 4, 17, C(16, 16, split=2, reduce=1)),  # two M tiles, separate reduce
    (24, 128, 64, tw.ZP_SYM, 8, 16, C(16, 16)),  # 8 bits, tl.dot
    (16, 256, 128, tw.ZP_FLOAT, 4, 1, C(1, 16, split=2, reduce=1)),
    (24, 128, 128, tw.ZP_INT, 4, 1, C(16, 16)),  # M = 1 on the tl.dot tiles (padded to 16)
]


def test_pack_round_trips():
    q = torch.randint(0, 16, (8, 200), dtype=torch.uint8)
    assert torch.equal(tw.unpack(tw.pack(q, 4), 4, 200, 8), q)
    q8 = torch.randint(0, 256, (20, 70), dtype=torch.uint8)
    assert torch.equal(tw.unpack(tw.pack(q8, 8), 8, 70, 20), q8)
    # row n, block b, word r: field j holds feature 128b + 16j + r; stored by 16-row strips, then block,
    # then row in the strip, then r (a strip's block is 1 KiB contiguous)
    n, k = 40, 256
    qq = ((torch.arange(n)[:, None] + torch.arange(k)[None, :] // 16) % 16).to(torch.uint8)  # (n + 8b + j) % 16
    p = tw.pack(qq, 4)
    assert p.shape == (48, 32)
    flat = p.flatten()
    for row, b, r in ((0, 0, 0), (5, 1, 3), (17, 0, 15), (33, 1, 9)):
        word = int(flat[((row // 16) * 2 + b) * 256 + (row % 16) * 16 + r]) & 0xFFFFFFFF
        assert [(word >> (4 * j)) & 15 for j in range(8)] == [(row + 8 * b + j) % 16 for j in range(8)]
    assert (flat[((40 // 16) * 2) * 256 + (40 % 16) * 16:][: 16 * 8] == 0).all()  # padded rows 40..47: zeros


@pytest.mark.parametrize("n,k,g,zp,bits,m,cfg", CASES)
def test_gemm_matches_float_reference(n, k, g, zp, bits, m, cfg):
    w, s, z, ge, ref_w, _ = _case(n, k, g, zp, bits, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DT)
    bias = torch.randn(n).to(DT)
    dev = lambda t: t.to(DEV) if t is not None else None  # noqa: E731
    y = tw.gemm(x.to(DEV), dev(w), dev(s), dev(z), n, ge, bits, zp, bias=bias.to(DEV), config=cfg)
    ref = x.float() @ ref_w.T + bias.float()
    assert y.shape == (m, n) and y.dtype == DT
    # bf16 (CUDA): tensor-core tiles take the weights rounded to bf16 (as Marlin does) and the output is
    # rounded to bf16, so the bound scales with the outputs' size; a layout error is O(1) relative
    tol = 2e-2 * max(1.0, float(ref.abs().max())) if DT == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2e-2 if DT == torch.bfloat16 else 1e-4, atol=tol)


def test_qweight_packed_from_a_longer_k():
    """``int4`` pads K to a group multiple before packing (group 256 > K = 100): the GEMM reads the first K."""
    w, s, z, ge, ref_w, _ = _case(16, 256, 256, tw.ZP_FLOAT)
    x = torch.randn(1, 100)
    y = tw.gemm(x.to(DEV).to(DT), w.to(DEV), s.to(DEV), z.to(DEV), 16, ge, 4, tw.ZP_FLOAT, config=tw.Config(1, 16))
    torch.testing.assert_close(y.float().cpu(), x.to(DT).float() @ ref_w[:, :100].T, rtol=1e-2, atol=1e-2)


def test_dequantize_is_exact():
    w, s, z, ge, ref_w, _ = _case(24, 96, 32, tw.ZP_INT)
    assert torch.equal(tw.dequantize(w.to(DEV), s.to(DEV), z.to(DEV), 24, 96, ge, 4, tw.ZP_INT, torch.float32).cpu(),
                       ref_w)


def test_m_above_max_and_bad_group_are_errors():
    w, s, z, ge, _, _ = _case(16, 128, 32, tw.ZP_INT)
    with pytest.raises(ValueError, match=f"1 <= M <= {tw.MAX_M}"):
        tw.gemm(torch.zeros(tw.MAX_M + 1, 128), w, s, z, 16, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        tw.gemm(torch.zeros(1, 128), w, s, z, 16, 24)
    with pytest.raises(ValueError, match=r"qweight must be int32 \[16, 16\]"):
        tw.gemm(torch.zeros(1, 128), w[:, :8], s, z, 16, 32)


def test_packed_group_quant_cpu_int4_matches():
    """On the CPU 4-bit GPTQ/AWQ weights run ``cpu_int4`` (asymmetric, desc_act permutation, per channel)."""
    torch.manual_seed(0)
    wd = torch.randn(48, 128)
    for g, sym in ((32, False), (-1, False), (64, True)):
        w = quantize_groupwise(wd, 4, g, sym)
        perm = torch.randperm(128)
        wp = GroupQuantWeight(w.q, w.scale, w.zero, 4, w.group_size, perm)
        p = PackedGroupQuant(wp, torch.device("cpu"), torch.float32)
        assert p.int4 is not None
        x = torch.randn(3, 128)
        torch.testing.assert_close(p.matmul(x), x @ wp.dequantize_unpermuted().T, rtol=1e-5, atol=1e-5)
    for g, sym, kind in ((-1, True, "int8"), (32, False, "dense")):  # 8 bits: int8pack when symmetric per channel
        w = quantize_groupwise(wd, 8, g, sym)
        p = PackedGroupQuant(w, torch.device("cpu"), torch.float32)
        assert getattr(p, kind) is not None
        x = torch.randn(2, 128)
        torch.testing.assert_close(p.matmul(x), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from kvserve.layers.quantization import triton_w4a16 as tw
bm, zp = ((1, tw.ZP_INT), (16, tw.ZP_FLOAT))[int(sys.argv[1])]
sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8" if zp == tw.ZP_INT else "*bf16",
       "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32",
       "K": "i32", "KW": "i32", "stride_xm": "i32", "stride_ym": "i32", "n_blocks": "i32",
       "blocks_per_split": "i32", "n_split": "i32", "exp": "i32"}
consts = dict(BITS=4, GROUP=128, PPG=8, GPB=1, ZP=zp, BLOCK_M=bm, BLOCK_N=64, NB=2, SPLIT=True, REDUCE=0,
              HAS_BIAS=False, WIDEN=False, EVEN_K=True, STAGES=2, PREC="tf32")
sig.update({k: "constexpr" for k in consts})
k = triton.compile(ASTSource(fn=tw._w4a16_kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
assert k.asm["cubin"]
print("COMPILED")
"""


def test_compiles_for_hopper_without_a_gpu():
    """The interpreter accepts code the compiler rejects (constexpr rules, types): compile the FMA (M = 1) and
    tl.dot variants (pipelined K loop, split-K with its in-kernel reduce) for sm_90 offline, in two child
    processes at once without ``TRITON_INTERPRET``."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the CUDA tests above compile and run it")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE, str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        if "CompilationError" in err or "COMPILED" in out:
            assert "COMPILED" in out, err[-3000:]
        else:  # no offline compile API / ptxas in this Triton build: not the kernel's fault
            pytest.skip(f"offline compile unavailable: {err[-300:]}")
