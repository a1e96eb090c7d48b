"""Bounded-KV attention (``kvserve.attention.bounded``) vs a dense float64 reference, through
every backend's ``forward_bounded`` (cpu, torch_ref, and triton -- its store kernel under
``TRITON_INTERPRET=1`` on the CPU): StreamingLLM with a null gap between the sink blocks and
the window (the null block is NaN-poisoned: it must never be read), decodes and prefill
chunks in one batch; H2O with arbitrary evicted blocks, and its per-block attention mass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve.attention.bounded import build_plans
from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import view_of
from kvserve.attention.registry import get_attn_backend
from kvserve.attention.kv_quant import dequantize, quantize
from kvserve.attention.kv_rotation import rotation_matrix
from kvserve.attention.torch_ref import store_kv
from kvserve.core.bounded_kv import sink_shift
from kvserve.core.kv_cache_spec import KVCacheSpec, get_kv_format

BS, H, HKV, D = 4, 4, 2, 16
INV = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def _rot(x, pos):  # x [T, h, d] float64, rotated at positions pos [T]
    ang = pos.double()[:, None] * INV[None, :]
    ang = torch.cat((ang, ang), -1)
    half = D // 2
    return x * ang.cos()[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * ang.sin()[:, None]


def _batch(policy, ctx_lens, q_lens, sinks, window, evict_cols, seed=0, kv_dtype=None):
    """Random raw q/k/v per request, rotated at their positions; a cache holding each
    request's context (evicted columns -> null block 0, NaN-poisoned). With ``kv_dtype`` (a
    quantized format) the cache is in that format and k/v are their quantized values."""
    g = torch.Generator().manual_seed(seed)
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [-(-s // BS) for s in seq]
    num_blocks = sum(nblk) + 1
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(nblk)
    table = np.zeros((len(seq), width), dtype=np.int32)
    cache = torch.zeros(2, num_blocks, BS, HKV, D)
    cache[:, 0] = float("nan")
    reqs, at = [], 0
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        L = c + n
        k = _rot(torch.randn(L, HKV, D, generator=g, dtype=torch.float64), torch.arange(L))
        v = torch.randn(L, HKV, D, generator=g, dtype=torch.float64)
        q = _rot(torch.randn(n, H, D, generator=g, dtype=torch.float64), torch.arange(c, L))
        table[i, :nblk[i]] = ids[at:at + nblk[i]]
        at += nblk[i]
        for p in range(c):
            cache[0, table[i, p // BS], p % BS] = k[p].float()
            cache[1, table[i, p // BS], p % BS] = v[p].float()
        for col in evict_cols[i]:
            table[i, col] = 0
        if kv_dtype is not None:  # the values the quantized cache holds
            fmt = get_kv_format(kv_dtype)
            k = dequantize(quantize(k.float(), fmt), D, torch.float32, fmt).double()
            v = dequantize(quantize(v.float(), fmt), D, torch.float32, fmt).double()
        reqs.append((q, k, v, c, L))
    if kv_dtype is not None:
        spec = KVCacheSpec(BS, HKV, D, kv_dtype, "float32")
        qcache = get_attn_backend("torch_ref").allocate_kv_cache(spec, num_blocks, torch.device("cpu"))
        live = cache[0, 1:].reshape(-1, HKV, D), cache[1, 1:].reshape(-1, HKV, D)
        store_kv(live[0], live[1], view_of(qcache, kv_dtype, D), torch.arange(BS, num_blocks * BS))
        cache = qcache
    return reqs, table, cache, seq


def _dense(policy, q, k, v, c, L, sinks, window, table_row):
    """float64 reference: masked attention, sink keys scored with the query rotated back."""
    qpos = torch.arange(c, L)
    kpos = torch.arange(L)
    kk = k.repeat_interleave(H // HKV, 1)
    vv = v.repeat_interleave(H // HKV, 1)
    s = torch.einsum("nhd,lhd->hnl", q, kk)
    if policy == "streaming":
        shifts = torch.tensor([sink_shift(int(p), sinks, window, BS) for p in qpos])
        qs = _rot(q, -shifts)
        ss = torch.einsum("nhd,lhd->hnl", qs, kk)
        sink_keys = kpos < -(-sinks // BS) * BS
        s = torch.where(sink_keys[None, None], ss, s)
        mask = (kpos[None] <= qpos[:, None]) & ((kpos[None] < sinks) | (kpos[None] > qpos[:, None] - window))
    else:
        live = torch.from_numpy(table_row[(kpos // BS).numpy()] != 0)
        mask = (kpos[None] <= qpos[:, None]) & live[None]
    s = (s / math.sqrt(D)).masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("hnl,lhd->nhd", p, vv), p


def _run(backend_name, policy, reqs, table, cache, seq, q_lens, sinks, window, kv_rotation=None, kv_dtype=None):
    """``forward_bounded`` over the layer view of ``cache`` (format ``kv_dtype``, plain if None);
    with ``kv_rotation`` the view rotates q/k/v (and the output back) by it."""
    order = sorted(range(len(reqs)), key=lambda i: q_lens[i] != 1)  # decodes first, as the runner does
    reqs = [reqs[i] for i in order]
    table, seq, ql = table[order], np.asarray([seq[i] for i in order]), np.asarray([q_lens[i] for i in order])
    qsl = np.concatenate([[0], np.cumsum(ql)])
    query = torch.cat([r[0].float() for r in reqs])
    key = torch.cat([r[1][r[3]:].float() for r in reqs])
    value = torch.cat([r[2][r[3]:].float() for r in reqs])
    slots = np.concatenate([table[i, np.arange(r[3], r[4]) // BS].astype(np.int64) * BS + np.arange(r[3], r[4]) % BS
                            for i, r in enumerate(reqs)])
    # The Triton backend's store kernel needs device tensors on a GPU machine (interpreted on the CPU).
    dev = torch.device("cuda" if backend_name == "triton" and torch.cuda.is_available() else "cpu")
    query, key, value = query.to(dev), key.to(dev), value.to(dev)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(table).to(dev),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
        seq_lens=torch.from_numpy(seq.astype(np.int32)).to(dev),
        query_lens_cpu=ql.tolist(), seq_lens_cpu=seq.tolist(), max_query_len=int(ql.max()),
        max_seq_len=int(seq.max()), num_decodes=int((ql == 1).sum()))
    meta.bounded = build_plans(policy, table, seq, ql, [sinks] * len(reqs), [window] * len(reqs), BS,
                               dev, INV.float().to(dev))
    kv = view_of(cache.clone().to(dev), kv_dtype, D)
    kv.rotation = None if kv_rotation is None else kv_rotation.to(dev)
    out = get_attn_backend(backend_name).forward_bounded(query, key, value, kv, meta, 1 / math.sqrt(D))
    return out.cpu(), meta, reqs, table, qsl


@pytest.mark.parametrize("backend,kv_dtype", [("cpu", None), ("torch_ref", None), ("triton", None),
                                              ("cpu", "int8"), ("triton", "int4")])
def test_streaming_matches_dense_reference(backend, kv_dtype):
    """Quantized KV formats too: stored keys are never rewritten, so any format serves."""
    if backend == "triton":
        pytest.importorskip("triton")
    sinks, window = 5, 6  # sinks end inside block 1: its tail is masked
    ctx, ql = [30, 9, 0, 41, 17], [1, 1, 7, 5, 1]
    # Columns below each request's first-query window (past the 2 sink blocks) are evicted.
    evict = [list(range(2, max(c - window + 1, 0) // BS)) for c in ctx]
    assert any(evict)
    reqs, table, cache, seq = _batch("streaming", ctx, ql, sinks, window, evict, kv_dtype=kv_dtype)
    out, _, reqs, _, qsl = _run(backend, "streaming", reqs, table, cache, seq, ql, sinks, window, kv_dtype=kv_dtype)
    assert not torch.isnan(out).any()
    for i, (q, k, v, c, L) in enumerate(reqs):
        ref, _ = _dense("streaming", q, k, v, c, L, sinks, window, None)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), ref, atol=1e-4, rtol=1e-4)


def test_h2o_matches_dense_reference_and_reports_block_mass():
    ctx, ql = [33, 20, 0], [1, 1, 9]
    evict = [[2, 3, 5, 6], [1, 3], []]  # arbitrary kept blocks (the heavy hitters)
    reqs, table, cache, seq = _batch("h2o", ctx, ql, 4, 4, evict, seed=1)
    out, meta, reqs, table, qsl = _run("cpu", "h2o", reqs, table, cache, seq, ql, 4, 4)
    for i, (q, k, v, c, L) in enumerate(reqs):
        ref, p = _dense("h2o", q, k, v, c, L, 4, 4, table[i])
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), ref, atol=1e-4, rtol=1e-4)
        plan = meta.bounded.plans[i]
        per_block = p.sum(dim=(0, 1))  # [L] over heads and queries
        nb = -(-L // BS)
        per_block = torch.nn.functional.pad(per_block, (0, nb * BS - L)).view(nb, BS).sum(1)
        assert np.all(table[i, plan.cols] != 0)
        torch.testing.assert_close(plan.mass.double(), per_block[plan.cols], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["cpu", "torch_ref"])
def test_streaming_in_the_rotated_basis(backend):
    """int4 / int2 layers attend in a Hadamard-rotated basis (the view's ``rotation``): the
    backend attends with ``x R`` against a cache holding ``k R``, ``v R`` and returns the
    output times ``R^T``; the sink queries' rotary shift must then act on the unrotated
    channels, or the sink scores are wrong (as rotating around a backend that is not told R)."""
    sinks, window = 5, 6
    ctx, ql = [30, 9, 0, 41, 17], [1, 1, 7, 5, 1]
    evict = [list(range(2, max(c - window + 1, 0) // BS)) for c in ctx]
    reqs, table, cache, seq = _batch("streaming", ctx, ql, sinks, window, evict)
    r = rotation_matrix(D).double()
    rreqs = [(q @ r, k @ r, v @ r, c, L) for q, k, v, c, L in reqs]
    rcache = (cache.double() @ r).float()  # the null block stays NaN
    for rot, ok in ((r.float(), True), (None, False)):
        if rot is not None:  # the view rotates q/k/v, and the output back
            out, _, sreqs, _, qsl = _run(backend, "streaming", reqs, table, rcache, seq, ql, sinks, window, rot)
            out = out.double()
        else:  # rotated around a backend that does not know R
            out, _, sreqs, _, qsl = _run(backend, "streaming", rreqs, table, rcache, seq, ql, sinks, window)
            out = out.double() @ r.T
        order = sorted(range(len(reqs)), key=lambda i: ql[i] != 1)
        close = []
        for j, i in enumerate(order):
            q, k, v, c, L = reqs[i]
            ref, _ = _dense("streaming", q, k, v, c, L, sinks, window, None)
            close.append(torch.allclose(out[qsl[j]:qsl[j + 1]], ref, atol=1e-4, rtol=1e-4))
        assert all(close) if ok else not all(close)
