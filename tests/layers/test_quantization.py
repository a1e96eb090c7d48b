"""Quantized linear layers: each format's matmul against its own dequantized weights."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.quantization import QuantizedLinear, quantize_model
from kvserve.layers.quantization.kernels import (
    FP8_MAX,
    Int4Weight,
    PackedInt4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

SHAPES = [(16, 32), (7, 33), (100, 100), (48, 576)]  # (out, in), odd sizes included


def test_int4_known_answer():
    # Two groups of 32; every weight exactly representable: w = 0.5 * q - 1 (group 0), 0.25 * q + 2 (group 1).
    q = torch.arange(16 * 64, dtype=torch.int64).reshape(16, 64).remainder(16).to(torch.uint8)
    scale = torch.tensor([[0.5, 0.25]]).repeat(16, 1)
    mn = torch.tensor([[-1.0, 2.0]]).repeat(16, 1)
    w = Int4Weight(q, scale, mn, 32)
    expected = torch.cat([0.5 * q[:, :32].float() - 1, 0.25 * q[:, 32:].float() + 2], 1)
    assert torch.equal(w.dequantize(), expected)
    x = torch.zeros(2, 64)
    x[0, 3] = 1.0  # picks column 3: q = (row * 64 + 3) % 16 = 3 -> 0.5
    x[1, 40] = 2.0  # column 40: q = 8 -> 0.25 * 8 + 2 = 4, times 2
    y = QuantizedLinear.from_int4(w, None, torch.device("cpu"), torch.float32)(x)
    assert torch.allclose(y[0], torch.full((16,), 0.5)) and torch.allclose(y[1], torch.full((16,), 8.0))


@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_matches_dequantized(n, k):
    torch.manual_seed(n + k)
    lin = torch.nn.Linear(k, n)
    x = torch.randn(5, k)
    ql = QuantizedLinear.from_dense(lin, "int4", torch.float32)
    g = ql.packed.group_size
    ref_w = quantize_int4(torch.nn.functional.pad(lin.weight.detach(), (0, (-k) % g)), g).dequantize()[:, :k]
    ref = x @ ref_w.T + lin.bias.detach()
    torch.testing.assert_close(ql(x), ref, rtol=1e-4, atol=1e-4)
    # bf16 activations (the fast CPU path): within bf16 rounding of the same product.
    yb = QuantizedLinear.from_dense(lin, "int4", torch.bfloat16)(x.bfloat16()).float()
    assert (yb - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-2


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_matches_dequantized(n, k):
    torch.manual_seed(n * k)
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(3, k)
    q, s = quantize_int8(lin.weight.detach())
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    ref = x @ (q.float() * s[:, None]).T
    torch.testing.assert_close(QuantizedLinear.from_dense(lin, "int8", torch.float32)(x), ref, rtol=1e-4, atol=1e-4)
    # and the quantization itself is within half a step of the weights
    assert ((q.float() * s[:, None]) - lin.weight.detach()).abs().max() <= s.max() / 2 + 1e-7


def _cpu_scaled_mm_rowwise() -> bool:
    """torch >= 2.13's CPU ``_scaled_mm`` takes per-row scales; 2.11's (the GPU machine) only per-tensor."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("n,k", SHAPES)
def test_fp8_matches_dequantized(n, k):
    if not _cpu_scaled_mm_rowwise():
        pytest.skip("this torch's CPU _scaled_mm has no per-row scales (the CUDA path is tested in test_quantization_gpu)")
    torch.manual_seed(n - k)
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(4, k)
    q, s = quantize_fp8(lin.weight.detach())
    xs = x.abs().amax(1, keepdim=True) / FP8_MAX
    xq = (x / xs).to(torch.float8_e4m3fn).float() * xs  # activations are quantized per token too
    ref = xq @ (q.float() * s[:, None]).T
    y = QuantizedLinear.from_dense(lin, "fp8", torch.float32)(x)
    torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-4)


def test_int4_packing_is_deterministic_and_rejects_bad_groups():
    w = quantize_int4(torch.randn(32, 64), 32)
    a, b = PackedInt4(w, torch.device("cpu"), torch.bfloat16), PackedInt4(w, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(a.packed, b.packed)
    with pytest.raises(ValueError, match="group size"):
        PackedInt4(Int4Weight(w.q, w.scale, w.min, 16), torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(torch.randn(4, 40), 32)
    with pytest.raises(ValueError, match="unknown weight quantization"):
        QuantizedLinear.from_dense(torch.nn.Linear(32, 16), "int3", torch.float32)


def test_quantize_model_replaces_decoder_projections_only():
    from types import SimpleNamespace

    from kvserve.models.llama import LlamaForCausalLM

    cfg = SimpleNamespace(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=96, num_hidden_layers=2, vocab_size=100, rms_norm_eps=1e-6,
                          max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg, torch.float32)
    assert quantize_model(model, "int8", torch.float32) == 8  # 4 projections x 2 layers
    assert all(isinstance(layer.mlp.down_proj, QuantizedLinear) for layer in model.model.layers)
    assert not isinstance(model.lm_head, QuantizedLinear)  # the LM head keeps its dense weight
    assert not isinstance(model.model.embed_tokens, QuantizedLinear)


@pytest.mark.parametrize("n,k,g", [(24, 96, 32), (7, 33, 33), (40, 256, 128)])
def test_cpu_int4_dequantizes_bit_for_bit(n, k, g):
    """The CPU path's weight is the reference dequantization exactly: Int4Weight's ``q * s + m`` and
    GroupQuantWeight's ``(q - z) * s`` (odd K: one per-channel group), so its matmul is ``F.linear`` on it."""
    from kvserve.layers.quantization.cpu_int4 import CpuInt4, pack_nibbles, unpack_nibbles
    from kvserve.layers.quantization.group_quant import PackedGroupQuant, quantize_groupwise

    torch.manual_seed(n + k + g)
    w = torch.randn(n, k) * 0.1
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q), k), q) and pack_nibbles(q).shape == (n, (k + 1) // 2)
    x = torch.randn(5, k)
    gq = quantize_groupwise(w, 4, g, sym=False)
    p = PackedGroupQuant(gq, torch.device("cpu"), torch.float32)
    assert isinstance(p.int4, CpuInt4) and torch.equal(p.int4.dequantize(), gq.dequantize())
    assert torch.equal(p.matmul(x), torch.nn.functional.linear(x, gq.dequantize()))
    if k % 32 == 0:
        w4 = quantize_int4(w, g)
        p4 = PackedInt4(w4, torch.device("cpu"), torch.float32)
        assert torch.equal(p4.cpu.dequantize(), w4.dequantize())
        assert torch.equal(p4.matmul(x), torch.nn.functional.linear(x, w4.dequantize()))
        assert p4.packed.dtype == torch.uint8 and p4.packed.numel() == n * k // 2  # half a byte per weight
    with pytest.raises(ValueError, match=r"int4 scale must be \[2, 2\]"):
        CpuInt4(torch.zeros(2, 64, dtype=torch.uint8), torch.ones(2, 3), torch.zeros(2, 2), 32, "affine")
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        CpuInt4(torch.zeros(2, 48, dtype=torch.uint8), torch.ones(2, 1), torch.zeros(2, 1), 32, "zero_point")
