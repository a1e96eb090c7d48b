"""Learned attention sinks (gpt-oss): one extra logit per query head in the softmax denominator,
with no value. The Triton decode (one split and split-KV + reduce) and prefill kernels and the
CPU backend against the torch reference and a float64 dense reference; the refusals."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.kv_format import view_of
from kvserve.attention.registry import get_attn_backend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.triton import TritonBackend
from test_triton_kernels import DEV, F32, make_batch, nan_free


def _dense_with_sinks(q, kv_cache, meta, scale, window, sinks):
    """float64 attention from the stored cache, one sink logit per head in every softmax."""
    bs = kv_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    bt = meta.block_tables.cpu()
    h, hkv = q.shape[1], kv_cache.shape[3]
    for i, s in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(s)
        blocks = bt[i, pos // bs].long()
        k = kv_cache[0, blocks, pos % bs].cpu().double().repeat_interleave(h // hkv, 1).transpose(0, 1)
        v = kv_cache[1, blocks, pos % bs].cpu().double().repeat_interleave(h // hkv, 1).transpose(0, 1)
        qi = q[qsl[i]:qsl[i + 1]].cpu().double().transpose(0, 1)  # [h, n, d]
        n = qi.shape[1]
        qpos = torch.arange(s - n, s)[:, None]
        mask = pos[None, :] <= qpos
        if window is not None:
            mask &= pos[None, :] > qpos - window
        sc = ((qi @ k.transpose(1, 2)) * scale).masked_fill(~mask, float("-inf"))
        sc = torch.cat([sc, sinks.cpu().double().view(h, 1, 1).expand(h, n, 1)], -1)
        out[qsl[i]:qsl[i + 1]] = (sc.softmax(-1)[..., :-1] @ v).transpose(0, 1)
    return out


def _case(ctx, ql, h, hkv, d, bs, window, seed):
    q, k, v, kv, meta = make_batch(ctx, ql, h, hkv, d, bs, F32, F32, seed)
    # sinks from below to above the scores' range: some heads mostly attend to "nothing"
    sinks = torch.linspace(-3.0, 6.0, h, device=DEV)
    return q, k, v, kv, meta, sinks


@pytest.mark.parametrize("window,splits", [(None, 1), (6, 3)])
def test_triton_backend_with_sinks_matches_torch_ref(window, splits):
    """Decodes then prefill chunks (with and without a cached prefix), GQA 2; one split (the
    running max starts at the sink) and three (the reduce kernel adds it)."""
    ctx, ql = [5, 19, 0, 12], [1, 1, 13, 6]
    q, k, v, kv, meta, sinks = _case(ctx, ql, 4, 2, 16, 4, window, seed=5)
    scale = 0.3
    ref_view = view_of(nan_free(kv))
    ref_view.sinks = sinks
    ref = TorchRefBackend().forward(q, k, v, ref_view, meta, scale, window)
    view = view_of(kv)
    view.sinks = sinks
    out = TritonBackend(decode_num_splits=splits).forward(q, k, v, view, meta, scale, window)
    exact = _dense_with_sinks(q, ref_view.cache, meta, scale, window, sinks)
    torch.testing.assert_close(ref.cpu().double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu().double(), exact, rtol=1e-4, atol=1e-4)
    # the sinks matter: without them the result differs
    plain = TorchRefBackend().forward(q, k, v, view_of(nan_free(kv)), meta, scale, window)
    assert (plain - ref).abs().max() > 1e-2


@pytest.mark.parametrize("block_diagonal", [True, False])
def test_cpu_backend_with_sinks_matches_torch_ref(block_diagonal):
    ctx, ql = [5, 19, 2, 0], [1, 1, 1, 9]
    q, k, v, kv, meta, sinks = _case(ctx, ql, 4, 2, 16, 4, 7, seed=6)
    kv = nan_free(kv)
    views = [view_of(kv.clone()), view_of(kv.clone())]
    for view in views:
        view.sinks = sinks
    ref = TorchRefBackend().forward(q, k, v, views[0], meta, 0.3, 7)
    out = get_attn_backend("cpu").__class__(block_diagonal=block_diagonal).forward(q, k, v, views[1], meta, 0.3, 7)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sinks_refused_with_bounded_kv_and_backends_without_them():
    from kvserve.attention.backend import AttentionBackend
    from kvserve.core.kv_cache_spec import BoundedKVSpec
    from kvserve.layers.attention import Attention, bind_attention, bind_kv_cache

    layer = Attention(4, 16, 0.25, 2, 0, has_sinks=True)
    model = torch.nn.ModuleList([layer])

    class NoSinks(TorchRefBackend):
        supports_attention_sinks = False

    with pytest.raises(ValueError, match="does not implement learned attention sinks"):
        bind_attention(model, NoSinks())
    assert not AttentionBackend.supports_attention_sinks
    spec = BoundedKVSpec(4, 2, 16, "float32", "float32", policy="streaming", sink_tokens=4, window=8)
    cache = torch.zeros(2, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="learned attention sinks, which bounded KV"):
        bind_kv_cache(model, {0: cache}, specs={0: spec})
    bind_kv_cache(model, {0: cache})  # a plain cache: the view carries the layer's sinks
    assert layer.kv.sinks is layer.sinks


def test_sinks_with_int4_rotated_cache_and_exact_own_block():
    """int4 (rotated in the kernels, each query's own block read exactly from the residual):
    sinks leave the rotation and the exact-block pass untouched; Triton (3 splits) equals torch_ref."""
    from kvserve.attention.kv_rotation import rotation_matrix
    from test_triton_kv_residual import _batch, _fresh, _view

    reqs = [(19, 1), (5, 1), (6, 11)]  # decodes mid-block and in the first block, a chunk over a prefix
    gen = torch.Generator().manual_seed(8)
    h, hkv, d = 4, 2, 16
    meta, cache, res = _batch(reqs, 8, hkv, d, "int4", gen)
    t = sum(n for _, n in reqs)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(DEV) for n in (h, hkv, hkv))
    c_ref, res_ref = cache.clone(), res.clone()
    r = rotation_matrix(d, DEV)
    sinks = torch.tensor([-2.0, 0.5, 3.0, 6.0], device=DEV)
    view = _view(cache, "int4", d, res, r)
    view.sinks = sinks
    out = TritonBackend(3).forward(q, k, v, view, _fresh(meta), d ** -0.5)
    ref_view = _view(c_ref, "int4", d, res_ref)
    ref_view.sinks = sinks
    ref = TorchRefBackend().forward(q @ r, k @ r, v @ r, ref_view, _fresh(meta), d ** -0.5) @ r.T
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
