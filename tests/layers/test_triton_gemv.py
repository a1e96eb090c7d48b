"""Triton weight-only GEMV (``triton_gemv``): FP8 / INT8 / INT4 against the dequantized float reference.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (tests/layers/conftest.py) at tiny shapes;
with CUDA the same tests run the compiled kernels, plus Llama-3.1-8B projection shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.quantization import kernels as qk
from kvserve.layers.quantization import triton_gemv as tg
from kvserve.layers.quantization.fp8_w8a8 import W8A8_MIN_M, quantize_act_ref
from kvserve.layers.quantization.kernels import Int4Weight, quantize_fp8, quantize_int4, quantize_int8
from tests.utils import cpu_subset

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(7, 33), (40, 160), (17, 96)]  # (N, K): odd N, K not a multiple of the blocks
MS = [1, 3, 16]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def _small_config(fmt: int, m: int, g: int = 32) -> tuple:
    """Tiny blocks so the tiny shapes cover several N blocks, K iterations and a K split."""
    bm = 1 if m == 1 else 16
    if fmt == tg.FMT_INT4:
        return bm, 16, g, 1, 2, 4
    return bm, 16, 32, 1, 2, 4


def _fp8_bytes(q: torch.Tensor) -> torch.Tensor:
    k = q.shape[1]
    return F.pad(q.view(torch.uint8), (0, (-k) % 16)).to(DEV)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("split", [False, True])
def test_fp8_int8_match_dequantized(n, k, m, split):
    torch.manual_seed(n * k + m)
    w = torch.randn(n, k)
    x = torch.randn(m, k).to(DEV, torch.bfloat16)
    bias = torch.randn(n).to(DEV, torch.bfloat16)
    q, s = quantize_fp8(w)
    cfg = _small_config(tg.FMT_FP8, m) if split else None
    y = tg.wgemv(x, tg.FMT_FP8, _fp8_bytes(q), s.to(DEV), None, n, bias=bias, config=cfg)
    ref = x.float() @ (q.float() * s[:, None]).to(DEV).T + bias.float()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) < 1e-2
    q8, s8 = quantize_int8(w)
    y = tg.wgemv(x, tg.FMT_INT8, F.pad(q8, (0, (-k) % 32)).to(DEV), s8.to(DEV, torch.bfloat16), None, n,
                 config=cfg)
    ref = x.float() @ (q8.float() * s8.bfloat16().float()[:, None]).to(DEV).T
    assert _rel(y, ref) < 1e-2


def test_fp8_known_answer():
    # Weights 1.0 / -2.0 exactly representable in e4m3; scale 0.5 per row; x selects columns.
    n, k = 5, 40
    w = torch.where(torch.arange(k)[None, :] % 2 == 0, 1.0, -2.0).repeat(n, 1).to(torch.float8_e4m3fn)
    s = torch.full((n,), 0.5)
    x = torch.zeros(3, k, dtype=torch.bfloat16)
    x[0, 0] = 1
    x[1, 1] = 3
    x[2, :] = 1
    for m in (1, 3):
        y = tg.wgemv(x[:m].to(DEV), tg.FMT_FP8, _fp8_bytes(w), s.to(DEV), None, n)
        expect = torch.tensor([0.5, -3.0, 0.5 * (20 - 40)])[:m, None].expand(m, n)
        assert torch.equal(y.float().cpu(), expect)


def _int4(n: int, k: int, g: int, seed: int) -> tuple[Int4Weight, int]:
    torch.manual_seed(seed)
    kq = k + (-k) % g
    return quantize_int4(F.pad(torch.randn(n, k), (0, kq - k)), g), kq


# The interpreter runs every shape at m = 1 and group 32, and each of m > 1 and group 64 once.
@pytest.mark.parametrize("n,k,m,g", cpu_subset(
    [(n, k, m, g) for g in (32, 64) for m in MS for n, k in SHAPES + [(9, 256)]],
    [(n, k, 1, 32) for n, k in SHAPES + [(9, 256)]] + [(7, 33, 3, 64), (9, 256, 16, 64), (17, 96, 16, 32)]))
def test_int4_matches_dequantized(n, k, m, g):
    w4, _ = _int4(n, k, g, n + k + m + g)
    x = torch.randn(m, k).to(DEV, torch.bfloat16)
    bias = torch.randn(n).to(DEV, torch.bfloat16)
    packed = tg.pack_int4(w4.q, g).to(DEV)
    st, mt = (t.t().contiguous().to(DEV) for t in (w4.scale, w4.min))
    ref = x.float() @ w4.dequantize()[:, :k].to(DEV).T + bias.float()
    for cfg in (None, _small_config(tg.FMT_INT4, m, g)):
        y = tg.wgemv(x, tg.FMT_INT4, packed, st, mt, n, g, bias=bias, config=cfg)
        assert _rel(y, ref) < 1e-2
    wd = tg.int4_dequantize(packed, st, mt, n, g, torch.float32)
    assert torch.allclose(wd.cpu(), w4.dequantize(), atol=1e-5)  # GPU: fused multiply-add


def test_pack_int4_layout():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    p = tg.pack_int4(q, 32)  # group 0: bytes j = q[j] | q[j + 16] << 4, group 1 likewise
    assert p.shape == (1, 32)
    assert p[0, 0].item() == (0 | 0 << 4) and p[0, 1].item() == (1 | 1 << 4)
    assert p[0, 16].item() == (q[0, 32] | q[0, 48] << 4).item()


def _q4_1_blocks(n: int, k: int) -> Int4Weight:
    """An Int4Weight as gguf_quant builds it from Q4_1 blocks: float16 d and m per 32 values, nibbles q."""
    gen = torch.Generator().manual_seed(7)
    d = (torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    mn = (torch.rand(n, k // 32, generator=gen) - 0.5).half().float()
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return Int4Weight(q, d, mn, 32)


@pytest.mark.parametrize("m", MS)
def test_int4_packed_layer_from_gguf_q4_1(m, monkeypatch):
    # PackedInt4's Triton path (forced on for the CPU interpreter): float16 scales kept exactly.
    monkeypatch.setattr(qk, "_use_triton", lambda device, fmt: True)
    n, k = 24, 96
    w = _q4_1_blocks(n, k)
    p = qk.PackedInt4(w, torch.device(DEV), torch.bfloat16)
    assert p.triton and p.scale_t.dtype == torch.float16 and p.scale_t.shape == (k // 32, n)
    assert torch.equal(p.scale_t.float().t().cpu(), w.scale) and torch.equal(p.min_t.float().t().cpu(), w.min)
    x = torch.randn(m, k).to(DEV, torch.bfloat16)
    ref = x.float() @ w.dequantize().to(DEV).T
    assert _rel(p.matmul(x), ref) < 1e-2
    big = torch.randn(tg.MAX_M + 1, k).to(DEV, torch.bfloat16)  # large-M path: dequantize + matmul
    assert _rel(p.matmul(big), big.float() @ w.dequantize().to(DEV).T) < 1e-2


def test_wgemv_rejects_large_m():
    with pytest.raises(ValueError):
        tg.wgemv(torch.zeros(tg.MAX_M + 1, 32), tg.FMT_INT8, torch.zeros(4, 32, dtype=torch.int8), torch.ones(4),
                 None, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_llama_shapes_cuda(n, k, m):
    from kvserve.layers.quantization import QuantizedLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = lin.weight.detach().float()
    q, s = quantize_fp8(w)
    layer = QuantizedLinear.from_dense(lin, "fp8", torch.bfloat16)
    assert layer.packed.triton
    xr = x.float()
    if m > W8A8_MIN_M:  # above the cut-over the activations are FP8 too (W8A8)
        xq, xs = quantize_act_ref(x)
        xr = xq.float() * xs
    assert _rel(layer(x), xr @ (q.float() * s[:, None]).T) < 1e-2
    w4 = quantize_int4(w, 128)
    packed = tg.pack_int4(w4.q.cuda(), 128)
    st, mt = (t.t().contiguous().cuda().bfloat16() for t in (w4.scale, w4.min))
    assert _rel(tg.wgemv(x, tg.FMT_INT4, packed, st, mt, n, 128), x.float() @ w4.dequantize().T) < 1e-2
    q8, s8 = quantize_int8(w)
    layer = QuantizedLinear.from_dense(lin, "int8", torch.bfloat16)
    assert _rel(layer(x), x.float() @ (q8.float() * s8.bfloat16().float()[:, None]).T) < 1e-2
