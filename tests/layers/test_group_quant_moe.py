"""GPTQ / AWQ (group-quantized) MoE experts: the fused W4A16 MoE kernel (``group_quant_experts``) against a
float reference (each expert dequantized, then the torch expert loop), under the Triton interpreter on the
CPU (tests/layers/conftest.py), at tiny shapes; the packing's round trip; ``FusedMoE`` on packed experts.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.moe import FusedMoE, fused_experts_torch, select_experts
from kvserve.layers.moe.group_quant_experts import GroupQuantExperts, fused_experts_w4a16
from kvserve.layers.quantization.group_quant import quantize_groupwise

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _quant_experts(e: int, n: int, k: int, bits: int, group: int, sym: bool, seed: int, perm: bool = False):
    """``e`` random experts quantized; ``perm``: each with its own activation order (GPTQ desc_act: K sorted by
    group at load). Returns the weights and the dense stack in the model's input order."""
    g = torch.Generator().manual_seed(seed)
    ws = []
    for _ in range(e):
        w = quantize_groupwise(torch.randn(n, k, generator=g) * 0.2, bits, group, sym)
        if perm:  # store columns in a random order: column j of the stored weight is input p[j]
            w.perm = torch.randperm(k, generator=g)
        ws.append(w)
    return ws, torch.stack([w.dequantize_unpermuted() for w in ws])


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 32, False), (4, -1, False), (8, 64, False)])
def test_packed_experts_dequantize_exactly(bits, group, sym):
    ws, dense = _quant_experts(3, 48, 64, bits, group, sym, seed=bits + group)
    q = GroupQuantExperts(ws, torch.device("cpu"), torch.float32)
    assert q.shape == (3, 48, 64)
    for e in range(3):
        assert torch.equal(q.dequantize(e), dense[e])
    assert (q.zeros is None) == sym and q.perm is None
    ws, dense = _quant_experts(3, 48, 64, bits, group, sym, seed=1, perm=True)
    q = GroupQuantExperts(ws, torch.device("cpu"), torch.float32)
    assert q.perm.shape == (3, 64) and all(torch.equal(q.dequantize(e), dense[e]) for e in range(3))


@pytest.mark.parametrize("t,e,k,h,i,bits,group,sym,act,perm", [
    (1, 4, 2, 64, 32, 4, 32, True, "silu", False),  # decode: one token
    (9, 6, 2, 64, 48, 4, 32, False, "silu", True),  # I = 48: w2 per channel, K tail masked; desc_act orders
    (5, 4, 2, 128, 64, 4, -1, False, "swigluoai", False),  # per channel, gpt-oss activation
    (3, 4, 3, 64, 64, 8, 64, False, "silu", False),  # 8 bits
])
def test_kernel_matches_dequantized_reference(t, e, k, h, i, bits, group, sym, act, perm):
    w13s, d13 = _quant_experts(e, 2 * i, h, bits, group, sym, seed=t + e, perm=perm)
    w2s, d2 = _quant_experts(e, h, i, bits, group if group != -1 and i % group == 0 else -1, sym, seed=t + e + 1,
                             perm=perm)
    q13 = GroupQuantExperts(w13s, torch.device(DEV), torch.float32)
    q2 = GroupQuantExperts(w2s, torch.device(DEV), torch.float32)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(DEV)
    w, ids = select_experts(torch.randn(t, e, generator=g).to(DEV), k, renormalize=True)
    ref = fused_experts_torch(x, d13.to(DEV), d2.to(DEV), w, ids, activation=act)
    got = fused_experts_w4a16(x, q13, q2, w, ids, activation=act)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # the torch loop over the packed experts (the CPU path) is the same computation
    torch.testing.assert_close(fused_experts_torch(x, q13, q2, w, ids, activation=act), ref, rtol=1e-5, atol=1e-5)


def test_expert_parallel_slice_and_layer():
    """Experts 2..3 of 4 held locally (expert_start 2); FusedMoE runs the packed experts."""
    e, h, i, t = 4, 64, 32, 6
    w13s, d13 = _quant_experts(e, 2 * i, h, 4, 32, False, seed=3)
    w2s, d2 = _quant_experts(e, h, i, 4, 32, False, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, h, generator=g).to(DEV)
    w, ids = select_experts(torch.randn(t, e, generator=g).to(DEV), 2, renormalize=True)
    q13 = GroupQuantExperts(w13s[2:], torch.device(DEV), torch.float32)
    q2 = GroupQuantExperts(w2s[2:], torch.device(DEV), torch.float32)
    ref = fused_experts_torch(x, d13[2:].to(DEV), d2[2:].to(DEV), w, ids, expert_start=2)
    torch.testing.assert_close(fused_experts_w4a16(x, q13, q2, w, ids, expert_start=2), ref, rtol=1e-4, atol=1e-4)

    with torch.device(DEV):
        moe = FusedMoE(e, 2, h, i, dtype=torch.float32)
    moe.set_group_quant_experts("gptq", GroupQuantExperts(w13s, torch.device(DEV), torch.float32),
                                GroupQuantExperts(w2s, torch.device(DEV), torch.float32))
    logits = torch.randn(t, e, generator=g).to(DEV)
    w, ids = moe.select(logits)
    ref = fused_experts_torch(x, d13.to(DEV), d2.to(DEV), w, ids)
    torch.testing.assert_close(moe(x, logits), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"w2: group-quantized experts of shape \(4, 64, 64\), expected \(4, 64, 32\)"):
        moe.set_group_quant_experts("awq", GroupQuantExperts(w13s, torch.device(DEV), torch.float32),
                                    GroupQuantExperts(_quant_experts(e, h, 2 * i, 4, 32, False, 6)[0],
                                                      torch.device(DEV), torch.float32))


def test_kernel_bf16_within_rounding():
    """bf16 activations (the interpreter computes the tiles in float32): within bf16 rounding of the float
    reference over the same dequantized experts."""
    e, h, i, t = 4, 64, 32, 5
    w13s, d13 = _quant_experts(e, 2 * i, h, 4, 32, False, seed=11)
    w2s, d2 = _quant_experts(e, h, i, 4, 32, True, seed=12)
    q13 = GroupQuantExperts(w13s, torch.device(DEV), torch.bfloat16)
    q2 = GroupQuantExperts(w2s, torch.device(DEV), torch.bfloat16)
    assert q13.scales.dtype == torch.bfloat16  # min/max scales are not exact in float16: the activation dtype
    g = torch.Generator().manual_seed(13)
    x = torch.randn(t, h, generator=g).to(DEV, torch.bfloat16)
    w, ids = select_experts(torch.randn(t, e, generator=g).to(DEV), 2, renormalize=True)
    d13 = torch.stack([q13.dequantize(j) for j in range(e)])  # what the kernel multiplies by (bf16 scales)
    d2 = torch.stack([q2.dequantize(j) for j in range(e)])
    ref = fused_experts_torch(x.float(), d13, d2, w, ids)
    got = fused_experts_w4a16(x, q13, q2, w, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
