"""Triton attention kernels vs ``TorchRefBackend`` and a float64 dense reference.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set in conftest.py) at tiny
shapes and few parametrizations; on CUDA the ``gpu``-marked matrix runs at larger shapes.
Every case uses fresh random inputs, shuffled block tables whose padding points at unused
blocks, NaN-poisoned outputs (every element must be written) and NaN-poisoned cache slots
outside the live sequences (a kernel must never read past ``seq_len``). The reference
backend runs on a NaN-free copy of the cache (its batched decode gathers whole blocks).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kvserve.attention.registry import get_attn_backend
from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import view_of
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.triton import (
    TritonBackend,
    choose_num_splits,
    decode_attention,
    prefill_attention,
    store_kv,
)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must enable the interpreter"

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _tol(dtype):
    return (1e-4, 1e-4) if dtype == F32 else (2e-2, 2e-2)


def make_batch(ctx_lens, q_lens, num_heads, hkv, d, block_size, q_dtype, kv_dtype, seed):
    """A random batch. Request i has ``ctx_lens[i]`` cached tokens and ``q_lens[i]`` new ones."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    used, spare = perm[: sum(nblk)], perm[sum(nblk):]
    max_blocks = max(nblk) + 1
    # Padding entries point at never-written (NaN) blocks.
    bt = torch.tensor([spare[0]] * (len(seq_lens) * max_blocks)).view(len(seq_lens), max_blocks)
    # Built in fp32 (holding values exactly representable in kv_dtype), cast at the end.
    kv = torch.full((2, num_blocks, block_size, hkv, d), float("nan"))
    at = 0
    for i, (c, n) in enumerate(zip(ctx_lens, nblk)):
        bt[i, :n] = torch.tensor(used[at:at + n])
        at += n
        pos = torch.arange(c)  # cached prefix
        kv[:, bt[i, pos // block_size], pos % block_size] = (
            torch.randn(2, c, hkv, d, generator=g).to(kv_dtype).float())
    kv = kv.to(kv_dtype)
    t = sum(q_lens)
    q = torch.randn(t, num_heads, d, generator=g).to(q_dtype)
    k = torch.randn(t, hkv, d, generator=g).to(q_dtype)
    v = torch.randn(t, hkv, d, generator=g).to(q_dtype)
    if not CUDA:
        # The interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even,
        # as torch does): keep the new K/V exactly representable in the cache dtype here.
        k, v = k.to(kv_dtype).to(q_dtype), v.to(kv_dtype).to(q_dtype)
    slots = []
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        for p in range(c, c + n):
            slots.append(int(bt[i, p // block_size]) * block_size + p % block_size)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        block_tables=bt.to(torch.int32).to(DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        query_lens_cpu=list(q_lens), seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decodes=sum(1 for _ in itertools.takewhile(lambda n: n == 1, q_lens)),
    )
    return q.to(DEV), k.to(DEV), v.to(DEV), kv.to(DEV), meta


def nan_free(kv):
    """A copy of the cache with the NaN poison zeroed (exact round trip through fp32)."""
    return torch.nan_to_num(kv.float(), nan=0.0).to(kv.dtype)


def dense_ref(q, kv_cache, meta, scale, window):
    """float64 attention computed from the (already stored) cache, position by position."""
    bs = kv_cache.shape[2]
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    bt = meta.block_tables.cpu()
    cache = kv_cache.cpu()
    num_heads, hkv = q.shape[1], kv_cache.shape[3]
    for i, s in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(s)
        blocks = bt[i, pos // bs].long()
        k = cache[0, blocks, pos % bs].to(q.dtype).double()  # [s, hkv, d]
        v = cache[1, blocks, pos % bs].to(q.dtype).double()
        k = k.repeat_interleave(num_heads // hkv, 1).transpose(0, 1)  # [h, s, d]
        v = v.repeat_interleave(num_heads // hkv, 1).transpose(0, 1)
        qi = q[qsl[i]:qsl[i + 1]].cpu().double().transpose(0, 1)  # [h, n, d]
        n = qi.shape[1]
        qpos = torch.arange(s - n, s)[:, None]
        mask = pos[None, :] <= qpos
        if window is not None:
            mask &= pos[None, :] > qpos - window
        sc = (qi @ k.transpose(1, 2)) * scale
        sc = sc.masked_fill(~mask, float("-inf"))
        out[qsl[i]:qsl[i + 1]] = (sc.softmax(-1) @ v).transpose(0, 1)
    return out


def run_case(ctx_lens, q_lens, num_heads, hkv, d, block_size, q_dtype, kv_dtype, window,
             num_splits=None, seed=0):
    q, k, v, kv, meta = make_batch(ctx_lens, q_lens, num_heads, hkv, d, block_size,
                                   q_dtype, kv_dtype, seed)
    scale = d ** -0.5
    ref_cache = nan_free(kv)
    ref = TorchRefBackend().forward(q, k, v, view_of(ref_cache), meta, scale, window)

    store_kv(k, v, kv, meta.slot_mapping)
    # The store wrote exactly the new slots, cast like torch_ref's.
    written = kv.flatten(1, 2)[:, meta.slot_mapping]
    assert torch.equal(written.float(), ref_cache.flatten(1, 2)[:, meta.slot_mapping].float())
    out = torch.full_like(q, float("nan"))
    nd = meta.num_decodes
    r = len(q_lens)
    if nd:
        decode_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                         meta.max_seq_len, scale, window, out=out, num_splits=num_splits)
    if r > nd:
        prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                          r - nd, meta.max_query_len, scale, window, out=out)
    assert not out.isnan().any(), "some output element was not written (or NaN was read)"
    rtol, atol = _tol(q_dtype)
    exact = dense_ref(q, kv, meta, scale, window)
    torch.testing.assert_close(out.cpu().double(), exact, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


def _gpu_matrix():
    """Every (block size, GQA ratio, head dim) with dtype pairs / windows cycled through,
    plus every (dtype pair, window) at one shape: 37 cases instead of the 270 of a full product."""
    dtypes = [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32), (BF16, F16)]
    windows = [None, 100]
    cases = []
    for i, (bs, g, d) in enumerate(itertools.product((16, 32, 64), (1, 4, 8), (64, 128, 256))):
        qd, kd = dtypes[i % len(dtypes)]
        cases.append((bs, (2 * g, 2), d, qd, kd, windows[i % 2]))
    for (qd, kd), w in itertools.product(dtypes, windows):
        cases.append((16, (8, 2), 128, qd, kd, w))
    return cases


GPU_MATRIX = _gpu_matrix()


# ----------------------------------------------------------------------------- store


def test_store_kv_skips_negative_slots_and_casts():
    g = torch.Generator().manual_seed(1)
    hkv, d, bs, nb = 2, 16, 16, 4
    kv = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=BF16, device=DEV)
    # Non-contiguous key/value: slices of a fused projection output.
    fused = torch.randn(5, 3 * hkv * d, generator=g).to(DEV)
    key = fused[:, hkv * d:2 * hkv * d].view(5, hkv, d)
    value = fused[:, 2 * hkv * d:].view(5, hkv, d)
    slots = torch.tensor([17, -1, 0, 63, 40], dtype=torch.int64, device=DEV)
    store_kv(key, value, kv, slots)
    flat = kv.flatten(1, 2)
    # Exact (round to nearest even) on the GPU; the interpreter truncates fp32 -> bf16.
    tol = dict(rtol=0, atol=0) if CUDA else dict(rtol=2 ** -7, atol=0)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(flat[0, s], key[t].to(BF16), **tol)
            torch.testing.assert_close(flat[1, s], value[t].to(BF16), **tol)
    assert int((~flat.isnan().all(-1).all(-1)).sum()) == 2 * 4  # only the 4 valid slots


# ----------------------------------------------------------------------------- decode

DECODE_CPU = [
    # block, (H, Hkv), D, q dtype, kv dtype, window, splits
    (16, (2, 2), 64, F32, F32, None, None),
    (32, (8, 2), 64, BF16, BF16, None, 1),
    (16, (8, 1), 128, F16, F32, 9, None),
    (16, (4, 1), 64, F32, BF16, 20, 3),
    (32, (4, 1), 16, F16, F16, None, 8),  # more splits than keys: empty splits combine to 0
]
DECODE_GPU = [pytest.param(*c, None, marks=pytest.mark.gpu) for c in GPU_MATRIX]


@pytest.mark.parametrize("bs,heads,d,q_dtype,kv_dtype,window,splits", DECODE_CPU + DECODE_GPU)
def test_decode(bs, heads, d, q_dtype, kv_dtype, window, splits):
    if CUDA:
        ctx = [0, 14, 15, 16, 31, 63, 200, 511, 1000, 1500]
    else:
        ctx = [0, 14, 15, 16, 40]  # seq lens 1, 15, 16, 17, 41
    run_case(ctx, [1] * len(ctx), heads[0], heads[1], d, bs, q_dtype, kv_dtype, window,
             num_splits=splits, seed=bs + d)


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 1024) == 1
    assert choose_num_splits(1, 8, 1024) == 16  # 132 SMs: 2 waves over 8 kv heads, 64 keys each
    assert choose_num_splits(1, 8, 10) == 1
    assert choose_num_splits(1, 1, 100_000) == 32


# ----------------------------------------------------------------------------- prefill / mixed

MIXED_CPU = [
    # block, (H, Hkv), D, q dtype, kv dtype, window
    (16, (2, 2), 64, F32, F32, None),
    (32, (8, 2), 64, BF16, BF16, 7),
    (16, (8, 1), 128, F32, BF16, None),
    (16, (4, 1), 64, F16, F32, 18),
    (32, (4, 4), 32, F32, F16, 1),  # window 1: each row sees only itself
]
MIXED_GPU = [pytest.param(*c, marks=pytest.mark.gpu) for c in GPU_MATRIX]


@pytest.mark.parametrize("bs,heads,d,q_dtype,kv_dtype,window", MIXED_CPU + MIXED_GPU)
def test_mixed_decode_and_prefill(bs, heads, d, q_dtype, kv_dtype, window):
    """Decodes first, then prefill chunks with and without cached prefixes."""
    if CUDA:
        ctx = [0, 16, 300, 0, 0, 16, 100, 1000, 64]
        ql = [1, 1, 1, 15, 300, 17, 1, 257, 128]
    else:
        ctx = [3, 16, 0, 0, 16, 5]
        ql = [1, 1, 15, 17, 16, 1]
    run_case(ctx, ql, heads[0], heads[1], d, bs, q_dtype, kv_dtype, window, seed=3 * bs + d)


def test_prefill_only_odd_group_and_tile_overrides():
    """G = 3 (not a power of two) and a tile smaller than a query chunk; no decodes."""
    q, k, v, kv, meta = make_batch([0, 9], [33, 20], 6, 2, 16, 16, F32, F32, seed=7)
    store_kv(k, v, kv, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, 2,
                      meta.max_query_len, 0.25, None, out=out, block_m=16, block_n=16)
    torch.testing.assert_close(out.cpu().double(), dense_ref(q, kv, meta, 0.25, None),
                               rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- backend


@pytest.mark.parametrize("q_dtype,kv_dtype,window", [(F32, F32, None), (BF16, F32, 12)])
def test_backend_matches_torch_ref(q_dtype, kv_dtype, window):
    """The registered "triton" backend on strided q/k/v views of a fused projection."""
    backend = get_attn_backend("triton")
    assert isinstance(backend, TritonBackend) and backend.name == "triton"
    h, hkv, d, bs = 4, 2, 32, 16
    ctx, ql = [20, 0, 0, 33], [1, 1, 18, 5]
    _, _, _, kv, meta = make_batch(ctx, ql, h, hkv, d, bs, q_dtype, kv_dtype, seed=11)
    t = sum(ql)
    qkv = torch.randn(t, (h + 2 * hkv) * d, device=DEV).to(q_dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
    ref_cache = nan_free(kv)
    ref = TorchRefBackend().forward(q, k, v, view_of(ref_cache), meta, d ** -0.5, window)
    out = backend.forward(q, k, v, view_of(kv), meta, d ** -0.5, window)
    assert out.shape == q.shape and out.dtype == q_dtype
    rtol, atol = _tol(q_dtype)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.cpu().double(), dense_ref(q, kv, meta, d ** -0.5, window),
                               rtol=rtol, atol=atol)


@pytest.mark.gpu
def test_cuda_graph_capture():
    """forward has no host syncs: capture it once, replay on new query/key/value contents."""
    h, hkv, d, bs = 16, 8, 128, 16
    ctx, ql = [100, 1000, 0, 300], [1, 1, 200, 64]
    q, k, v, kv, meta = make_batch(ctx, ql, h, hkv, d, bs, BF16, BF16, seed=5)
    kv = nan_free(kv)
    backend = TritonBackend()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        backend.forward(q, k, v, view_of(kv), meta, d ** -0.5)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, view_of(kv), meta, d ** -0.5)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    ref_cache = kv.clone()
    ref = TorchRefBackend().forward(q, k, v, view_of(ref_cache), meta, d ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(kv, ref_cache)
