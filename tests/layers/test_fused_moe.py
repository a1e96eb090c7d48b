"""Fused MoE: the Triton kernels (``triton_moe``) against the torch expert loop, the block alignment's
invariants, routing against transformers' routers, tensor / expert parallel slices, FP8 / INT8 experts.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (tests/layers/conftest.py) at tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.distributed import parallel_state
from kvserve.layers.moe import FusedMoE, fused_experts_torch, select_experts
from kvserve.layers.moe import layer as moe_layer
from kvserve.layers.moe import triton_moe
from kvserve.layers.moe.triton_moe import fused_experts_triton, max_padded_rows, moe_align_block_size

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(e: int, h: int, i: int, bias: bool, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(DEV, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(DEV, dtype)
    b13 = (torch.randn(e, 2 * i, generator=g) * 0.5).to(DEV, dtype) if bias else None
    b2 = (torch.randn(e, h, generator=g) * 0.5).to(DEV, dtype) if bias else None
    return w13, w2, b13, b2


def _routed(t: int, e: int, k: int, h: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    w, ids = select_experts(torch.randn(t, e, generator=g).to(DEV), k, renormalize=True)
    return x, w, ids


# --------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("t,e,k,bm,start,e_local", [(1, 4, 2, 16, 0, 4), (17, 8, 3, 16, 0, 8),
                                                     (9, 8, 2, 4, 4, 4), (33, 6, 1, 8, 2, 3)])
def test_align_block_size_invariants(one_program, t, e, k, bm, start, e_local):
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(t * 7 + i))[:k]
                       for i in range(t)]).to(DEV, torch.int32)
    sorted_ids, expert_ids, post = moe_align_block_size(ids, bm, e_local, start, one_program=one_program)
    sorted_ids, expert_ids, post = sorted_ids.cpu(), expert_ids.cpu(), int(post.item())
    flat = ids.cpu().reshape(-1).long() - start
    numel = flat.numel()
    assert sorted_ids.numel() == max_padded_rows(numel, e_local, bm) == expert_ids.numel() * bm
    counts = torch.bincount(flat[(flat >= 0) & (flat < e_local)], minlength=e_local)
    assert post == int(((counts + bm - 1) // bm * bm).sum())
    real = sorted_ids[sorted_ids < numel]
    local = torch.nonzero((flat >= 0) & (flat < e_local)).flatten()
    assert torch.equal(torch.sort(real.long()).values, local)  # every local pair exactly once, no other
    assert bool((sorted_ids[post:] == numel).all())
    assert bool((expert_ids[post // bm:] == -1).all())
    row = 0
    for x in range(e_local):  # each expert: its pairs (in pair order from the one-program kernel), then padding
        n = int(counts[x])
        run = sorted_ids[row:row + n].long()
        assert bool((flat[run] == x).all())
        if one_program:
            assert bool((run[1:] > run[:-1]).all())
        padded = (n + bm - 1) // bm * bm
        assert bool((sorted_ids[row + n:row + padded] == numel).all())
        assert bool((expert_ids[row // bm:(row + padded) // bm] == x).all())
        row += padded
    assert row == post


# --------------------------------------------------------------------------- kernel vs the torch loop


@pytest.mark.parametrize("t,e,k,i,act,bias", [(1, 4, 1, 32, "silu", False), (3, 8, 3, 32, "swigluoai", True),
                                              (17, 6, 2, 48, "silu", True), (17, 8, 3, 32, "swigluoai", False)])
def test_kernel_matches_torch_float32(t, e, k, i, act, bias):
    """I = 48: a masked K tail in the w2 GEMM and a partial N tile in the w13 GEMM."""
    h = 32
    w13, w2, b13, b2 = _experts(e, h, i, bias, seed=t + e)
    x, w, ids = _routed(t, e, k, h, seed=t * e)
    kw = dict(activation=act, w13_bias=b13, w2_bias=b2, swiglu_limit=1.0 if act == "swigluoai" else None)
    ref = fused_experts_torch(x, w13, w2, w, ids, **kw)
    out = fused_experts_triton(x, w13, w2, w, ids, **kw)
    assert out.shape == (t, h) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_kernel_bf16_within_rounding_and_large_m_config(monkeypatch):
    t, e, k, h, i = 17, 8, 2, 64, 32
    w13, w2, b13, b2 = _experts(e, h, i, True, seed=3, dtype=torch.bfloat16)
    x, w, ids = _routed(t, e, k, h, seed=4, dtype=torch.bfloat16)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids, w13_bias=b13.float(), w2_bias=b2.float())
    out = fused_experts_triton(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2)
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item()
    # the big-T table row (BLOCK_M 64, grouped launch order) and the parallel alignment give the same sums
    monkeypatch.setattr(triton_moe, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 0)
    cfg = (0, 64, (32, 32, 4, 2), (32, 32, 4, 2), 4)
    out2 = fused_experts_triton(x.float(), w13.float(), w2.float(), w, ids, w13_bias=b13.float(),
                                w2_bias=b2.float(), config=cfg)
    torch.testing.assert_close(out2, ref, rtol=1e-4, atol=1e-5)


def _load(layer: FusedMoE, w13, w2, b13=None, b2=None) -> None:
    i = w13.shape[1] // 2
    for x in range(w13.shape[0]):
        for shard, src, bsrc in (("w1", w13[x, :i], None if b13 is None else b13[x, :i]),
                                 ("w3", w13[x, i:], None if b13 is None else b13[x, i:]),
                                 ("w2", w2[x], None if b2 is None else b2[x])):
            layer.weight_loader(layer.w13 if shard != "w2" else layer.w2, src, x, shard)
            if bsrc is not None:
                layer.weight_loader(layer.w13_bias if shard != "w2" else layer.w2_bias, bsrc, x, shard)


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setattr(moe_layer, "FORCE_TRITON", True)


@pytest.mark.parametrize("ep", [False, True])
def test_two_rank_slices_sum_to_one_rank(force_triton, monkeypatch, ep):
    """Tensor parallel (intermediate split) and expert parallel (expert_start > 0 on rank 1: pairs routed
    to the other rank's experts contribute 0): the two ranks' partial outputs sum to the whole layer."""
    t, e, k, h, i = 5, 8, 2, 32, 32
    w13, w2, b13, b2 = _experts(e, h, i, True, seed=11)
    x, _, _ = _routed(t, e, k, h, seed=12)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(13)).to(DEV)
    args = dict(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, dtype=torch.float32,
                activation="swigluoai", has_bias=True, reduce_results=False)
    with torch.device(DEV):
        full = FusedMoE(**args)
    _load(full, w13, w2, b13, b2)
    ref = full(x, logits)
    parts = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_RANK", rank)
        monkeypatch.setattr(parallel_state, "_SIZE", 2)
        monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", ep)
        with torch.device(DEV):
            part = FusedMoE(**args)
        assert part.expert_start == (4 * rank if ep else 0)
        _load(part, w13, w2, b13, b2)
        parts.append(part(x, logits))
        torch.testing.assert_close(parts[-1], fused_experts_torch(
            x, part.w13, part.w2, *part.select(logits), activation="swigluoai", w13_bias=part.w13_bias,
            w2_bias=part.w2_bias, expert_start=part.expert_start), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts[0] + parts[1], ref, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- quantized experts


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantized_experts(force_triton, method):
    """FP8 e4m3 / INT8 weight-only experts (per-expert per-output-channel scales): the kernel equals the
    torch loop over the dequantized weights, and both stay within the format's bound of the dense layer:
    relative Frobenius error <= 6% for FP8 (3 mantissa bits: <= 2^-4 per weight, ~2.5% rms after two
    projections) and <= 2% for INT8."""
    t, e, k, h, i = 6, 4, 2, 64, 32
    w13, w2, _, _ = _experts(e, h, i, False, seed=21, dtype=torch.bfloat16)
    x, _, _ = _routed(t, e, k, h, seed=22, dtype=torch.bfloat16)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(23)).to(DEV)
    with torch.device(DEV):
        moe = FusedMoE(e, k, h, i, dtype=torch.bfloat16)
    _load(moe, w13, w2)
    dense = fused_experts_torch(x.float(), w13.float(), w2.float(), *moe.select(logits))
    assert moe.quantize_experts(method) and not moe.quantize_experts(method)
    assert moe.w13.dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int8)
    assert moe.w13_scale.shape == (e, 2 * i) and moe.w2_scale.shape == (e, h)
    out = moe(x, logits)
    loop = fused_experts_torch(x, moe.w13, moe.w2, *moe.select(logits), w13_scale=moe.w13_scale,
                               w2_scale=moe.w2_scale)
    assert (out.float() - loop.float()).abs().max() <= 2e-2 * loop.float().abs().max()
    rel = ((out.float() - dense).norm() / dense.norm()).item()
    assert rel <= (0.06 if method == "fp8" else 0.02), rel
    with torch.device(DEV):
        other = FusedMoE(e, k, h, i, dtype=torch.bfloat16)
    assert not other.quantize_experts("int4")  # formats without an expert kernel leave the experts dense


def test_quantize_model_hook_quantizes_experts():
    from kvserve.layers.quantization import quantize_model

    model = torch.nn.Module()
    model.mlp = FusedMoE(4, 2, 32, 32, dtype=torch.float32)
    model.mlp.w13.data.normal_()
    model.mlp.w2.data.normal_()
    model.down_proj = torch.nn.Linear(32, 32, bias=False)
    assert quantize_model(model, "int8", torch.float32) == 2
    assert model.mlp.w13.dtype == torch.int8 and model.mlp.quant_method == "int8"


# --------------------------------------------------------------------------- routing


def test_routing_matches_transformers_routers():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    hid = torch.randn(40, 16)
    hid[:8] = 0.0  # all-equal logits: ties broken as torch.topk breaks them
    hid[8:10] = 0.0
    hid[8:10, :2] = 1.0
    for router, renorm in (
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                           norm_topk_prob=True)), True),
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=False)), False),
        (MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)), True),
    ):
        torch.nn.init.normal_(router.weight, std=0.5)
        router.weight.data[:, :2] = 0.25  # two tokens with tied logits below (ids as torch.topk orders them)
        logits, ref_w, ref_ids = router(hid)
        w, ids = select_experts(logits, router.top_k, renormalize=renorm)
        assert torch.equal(ids.long(), ref_ids)
        torch.testing.assert_close(w, ref_w.float(), rtol=1e-6, atol=1e-7)
        if renorm:
            torch.testing.assert_close(w.sum(-1), torch.ones(40), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("renorm", [True, False])
def test_topk_softmax_kernel_matches_select_experts(renorm):
    logits = torch.randn(19, 12, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    logits[3] = 0.0  # all tied: the lower ids first
    w, ids = triton_moe.topk_softmax(logits, 3, renorm)
    ref_w, ref_ids = select_experts(logits, 3, renormalize=renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    untied = torch.arange(19) != 3
    assert torch.equal(ids.cpu()[untied], ref_ids.cpu()[untied]) and ids[3].tolist() == [0, 1, 2]
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_fused_moe_equals_transformers_qwen3_moe_block(force_triton):
    """The whole routed block (router + experts) of transformers' Qwen3-MoE, float32."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                         norm_topk_prob=True, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        ref = block(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
        with torch.device(DEV):
            moe = FusedMoE(6, 2, 32, 16, dtype=torch.float32, renormalize=True)
        _load(moe, block.experts.gate_up_proj.data, block.experts.down_proj.data)
        logits = torch.nn.functional.linear(x[0], block.gate.weight)
        out = moe(x[0].to(DEV), logits.to(DEV)).cpu()
    torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-5)
