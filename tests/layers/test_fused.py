"""Fused RMSNorm(+residual), rotary and SiLU-and-mul kernels against the torch layers they
replace on CUDA (under ``TRITON_INTERPRET=1`` on the CPU, tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers import fused
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _close(a, b, dtype, exact_on_gpu=False):
    """fp32: to rounding error. bf16: within one bf16 ulp; on CUDA mostly (or, where
    ``exact_on_gpu``, all) bit-identical. (The kernels round on the bits, so the CPU
    interpreter, whose own casts truncate, agrees too, but its torch reference runs
    other CPU kernels: only the ulp bound is asserted there.)"""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=2e-2)
    if DEV == "cuda":
        assert torch.equal(a, b) if exact_on_gpu else (a != b).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32), (1, 96)])
def test_rms_norm_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=g) + 0.5)
    # A strided input, like q viewed out of a packed qkv row.
    big = torch.randn(shape[0], 3 * shape[-1] * (shape[1] if len(shape) == 3 else 1), generator=g).to(dtype)
    x = big[:, : big.shape[1] // 3].view(shape)
    res = torch.randn(shape, generator=g).to(dtype)
    norm = norm.to(DEV)
    x, res = x.to(DEV), res.to(DEV)
    w = norm.weight.data
    ref = norm._norm(x)  # the torch path, on the same device
    _close(fused.rms_norm(x, w, 1e-6).cpu(), ref.cpu(), dtype)
    ref_res = x + res
    out, new_res = fused.rms_norm(x, w, 1e-6, res)
    _close(new_res.cpu(), ref_res.cpu(), dtype, exact_on_gpu=True)  # the add rounds like torch's
    _close(out.cpu(), norm._norm(ref_res).cpu(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (3, 1)])
def test_rotary_matches_torch(dtype, heads):
    hq, hk = heads
    d = 32
    rope = RotaryEmbedding(d, 64, {"rope_theta": 10000.0, "rope_type": "default"}).to(DEV)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEV)
    q, k = qkv[:, : hq * d], qkv[:, hq * d:(hq + hk) * d]  # strided rows, as split from qkv
    pos = torch.tensor([0, 1, 5, 17, 40, 63], device=DEV)
    cos, sin = rope.cos_cache[pos].to(dtype).unsqueeze(1), rope.sin_cache[pos].to(dtype).unsqueeze(1)
    ref_q, ref_k = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)  # the torch path
    qkv_f = qkv.clone()
    fq, fk = fused.rotary_inplace(pos, qkv_f[:, : hq * d], qkv_f[:, hq * d:(hq + hk) * d],
                                  rope.cos_cache, rope.sin_cache, d)
    _close(fq.cpu(), ref_q.cpu(), dtype, exact_on_gpu=True)
    _close(fk.cpu(), ref_k.cpu(), dtype, exact_on_gpu=True)
    assert torch.equal(qkv_f[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 2 * 48, generator=g).to(dtype) * 3
    _close(fused.silu_and_mul(x.to(DEV)).cpu(), SiluAndMul()(x), dtype)  # CPU torch path as reference
