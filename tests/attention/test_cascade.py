"""Cascade attention (``kvserve/attention/triton/cascade.py``): the plan over random block
tables, and the cascade kernels against the per-request decode kernel and ``torch_ref`` on
batches with 0, 1 and several shared groups, ragged suffixes, every KV dtype (the Triton
interpreter on the CPU, tiny shapes)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import kv_format_for, view_of
from kvserve.attention.kv_quant import quantize_pages
from kvserve.attention.kv_rotation import rotation_matrix
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.triton import decode_attention
from kvserve.attention.triton.cascade import cascade_decode_attention, plan_cascade, plan_to_device
from kvserve.core.kv_cache_spec import get_kv_format

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must enable the interpreter"

BS = 4  # tokens per block


def _tables(groups: list[tuple[int, list[int]]], loners: list[int], gen: torch.Generator):
    """Block tables of requests in ``groups`` ((shared blocks, [suffix tokens per member])) and
    ``loners`` (tokens), in a shuffled order; shared blocks are the same ids. Returns
    ``(bt int32 [R, width], seq_lens [R], expected prefix tokens [R], num_blocks)``."""
    reqs = []  # (shared block ids or [], shared blocks, own tokens)
    next_id = 1  # block 0: the null block
    for shared, suffixes in groups:
        ids = list(range(next_id, next_id + shared))
        next_id += shared
        reqs += [(ids, s) for s in suffixes]
    reqs += [([], n) for n in loners]
    order = torch.randperm(len(reqs), generator=gen).tolist()
    reqs = [reqs[i] for i in order]
    rows, lens, prefix = [], [], []
    for ids, own in reqs:
        nb = -(-own // BS)
        rows.append(ids + list(range(next_id, next_id + nb)))
        next_id += nb
        lens.append(len(ids) * BS + own)
        prefix.append(len(ids) * BS)
    width = max(len(r) for r in rows) + 1
    bt = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        bt[i, :len(r)] = r
    return bt, np.asarray(lens), np.asarray(prefix), next_id + 1


def test_plan_groups_runs_of_shared_blocks():
    gen = torch.Generator().manual_seed(0)
    bt, lens, prefix, _ = _tables([(3, [1, 5, 9]), (2, [3, 4])], [6, 2], gen)
    plan = plan_cascade(bt, lens, len(lens), BS, per_item=2, min_shared_blocks=2)
    assert plan["num_groups"] == 2
    # a request's newest token's block is never shared: one of 4 tokens past 3 shared blocks
    # (suffix 1..4 tokens) still shares all 3, since its own block starts after them
    np.testing.assert_array_equal(plan["prefix_lens"], prefix)
    np.testing.assert_array_equal(plan["suffix_seq_lens"], lens - prefix)
    for i in range(len(lens)):
        k = prefix[i] // BS
        np.testing.assert_array_equal(plan["suffix_block_tables"][i, :bt.shape[1] - k], bt[i, k:])
    # items of at most 2 requests: 3 -> 2 + 1, 2 -> 2
    assert sorted(plan["item_count"].tolist()) == [1, 2, 2]
    members = plan["members"]
    assert sorted(members.tolist()) == sorted(np.nonzero(prefix)[0].tolist())
    # the minimum shared run: 3 shared blocks don't qualify at 4
    assert plan_cascade(bt, lens, len(lens), BS, per_item=2, min_shared_blocks=4) is None
    # no sharing, or a single member: no plan
    bt1, lens1, _, _ = _tables([(3, [2])], [5, 7], gen)
    assert plan_cascade(bt1, lens1, len(lens1), BS, per_item=2, min_shared_blocks=1) is None
    # the shared run of a group is its longest common run (here 2 of the first member's 3)
    bt2 = bt.copy()
    rows_a = np.nonzero(prefix == 3 * BS)[0]
    bt2[rows_a[0], 2] = 99
    plan2 = plan_cascade(bt2, lens, len(lens), BS, per_item=8, min_shared_blocks=2)
    assert (plan2["prefix_lens"][rows_a] == 2 * BS).all()
    # only the first num_decodes rows take part
    assert plan_cascade(bt, lens, 1, BS, per_item=2, min_shared_blocks=2) is None


CASES = [  # (groups, loners, q dtype, kv dtype, (prefix splits, suffix splits))
    ([(3, [1, 5, 9])], [6], torch.float32, "float32", (1, 1)),
    ([(3, [1, 5, 9]), (2, [3, 4]), (4, [4, 2])], [6], torch.float32, "float32", (2, 3)),
    ([(2, [2, 6]), (3, [5, 1, 3])], [3], torch.bfloat16, "bfloat16", (2, 2)),
    ([(2, [2, 6, 4])], [3], torch.float16, "float16", (1, 2)),
    ([(2, [2, 6]), (3, [5, 1])], [3], torch.float32, "fp8_e4m3", (2, 1)),
    ([(2, [2, 6]), (3, [5, 1])], [3], torch.float32, "int8", (1, 2)),
    ([(2, [2, 6]), (3, [5, 1])], [3], torch.float32, "int4", (2, 2)),
    ([(3, [2, 6, 5])], [3], torch.bfloat16, "int2", (1, 1)),
]


@pytest.mark.parametrize("groups,loners,qdt,kv_name,splits", CASES, ids=[c[3] + f"-{len(c[0])}g" for c in CASES])
def test_cascade_equals_per_request_decode(groups, loners, qdt, kv_name, splits):
    gen = torch.Generator().manual_seed(len(groups) * 7 + len(kv_name))
    heads, hkv, d = (6 if kv_name == "float16" else 4), 2, 32  # float16: 3 query heads per KV head (SmolLM2's)
    bt, lens, prefix, num_blocks = _tables(groups, loners, gen)
    r = len(lens)
    fmt = kv_format_for(kv_name, d)
    raw = torch.randn(2, num_blocks, BS, hkv, d, generator=gen)
    if fmt.kernel_code:
        cache = quantize_pages(raw, get_kv_format(kv_name))
    else:
        cache = raw.to(getattr(torch, kv_name))
    cache = cache.to(DEV)
    q = torch.randn(r, heads, d, generator=gen).to(qdt).to(DEV)
    bt_t = torch.from_numpy(bt).to(torch.int32).to(DEV)
    sl = torch.from_numpy(lens).to(torch.int32).to(DEV)
    qsl = torch.arange(r + 1, dtype=torch.int32, device=DEV)
    host = plan_cascade(bt, lens, r, BS, per_item=2, min_shared_blocks=2)
    np.testing.assert_array_equal(host["prefix_lens"], prefix)
    plan = plan_to_device(host, 2, torch.device(DEV))
    scale = d ** -0.5
    want = decode_attention(q, cache, bt_t, sl, qsl, r, int(lens.max()), scale, num_splits=1, kv_format=fmt)
    got = torch.full_like(q, float("nan"))  # every decode row must be written
    cascade_decode_attention(q, cache, bt_t, plan, qsl, r, scale, got, kv_format=fmt, prefix_splits=splits[0],
                             suffix_splits=splits[1])
    tol = 2e-5 if qdt == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if kv_name in ("float32", "int4"):  # and the reference backend reading the same bytes
        meta = AttentionMetadata(
            slot_mapping=torch.full((r,), -1, dtype=torch.int64, device=DEV), block_tables=bt_t, query_start_loc=qsl,
            seq_lens=sl, query_lens_cpu=[1] * r, seq_lens_cpu=lens.tolist(), max_query_len=1,
            max_seq_len=int(lens.max()), num_decodes=r)
        ref = TorchRefBackend().attend(q, q[:, :hkv], q[:, :hkv], view_of(cache, kv_name, d), meta, scale)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_cascade_with_rotation_and_sinks_matches_decode():
    """int4 with the in-kernel rotation (the decode kernel rotates q and its states back; the
    prefix kernel gets q R from torch) and learned sinks (added in the merge)."""
    gen = torch.Generator().manual_seed(3)
    heads, hkv, d = 4, 2, 32
    bt, lens, _, num_blocks = _tables([(3, [2, 5, 1])], [4], gen)
    r = len(lens)
    fmt = kv_format_for("int4", d)
    cache = quantize_pages(torch.randn(2, num_blocks, BS, hkv, d, generator=gen), get_kv_format("int4")).to(DEV)
    q = torch.randn(r, heads, d, generator=gen).to(DEV)
    sinks = torch.randn(heads, generator=gen).to(DEV)
    rot = rotation_matrix(d, DEV)
    bt_t = torch.from_numpy(bt).to(torch.int32).to(DEV)
    sl = torch.from_numpy(lens).to(torch.int32).to(DEV)
    qsl = torch.arange(r + 1, dtype=torch.int32, device=DEV)
    plan = plan_to_device(plan_cascade(bt, lens, r, BS, per_item=4, min_shared_blocks=2), 4, torch.device(DEV))
    want = decode_attention(q, cache, bt_t, sl, qsl, r, int(lens.max()), 0.25, num_splits=2, sinks=sinks,
                            rotate=True, kv_format=fmt)
    got = cascade_decode_attention(q, cache, bt_t, plan, qsl, r, 0.25, torch.empty_like(q), kv_format=fmt,
                                   rotate=True, kv_rotation=rot, sinks=sinks, prefix_splits=2, suffix_splits=1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_graph_buffers_replay_the_eager_plan(monkeypatch):
    """The CUDA-graph hooks on the CPU: the plan a replay copies into the static buffers (padded
    to a larger captured batch) gives the same attention as the eager plan and the plain decode
    kernel; a step without groups replays with no items."""
    from types import SimpleNamespace

    from kvserve.attention.triton.cascade import CascadeMetadataBuilder
    from kvserve.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup

    from kvserve.attention.triton import cascade

    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 2 * BS)  # the tiny tables share 2-3 blocks
    monkeypatch.setattr(cascade, "GRAPH_MIN_BATCH", 8)
    gen = torch.Generator().manual_seed(5)
    heads, hkv, d = 4, 2, 16
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=hkv, head_size=d, dtype="float32", compute_dtype="float32")
    layer = SimpleNamespace(kv_cache_group_id=0, num_heads=heads, num_kv_heads=hkv,
                            impl=SimpleNamespace(cascade_enabled=lambda dev: True))
    builder = CascadeMetadataBuilder([layer], [KVCacheGroup(0, [0], spec)], None, None, torch.device(DEV),
                                     torch.float32, 8)
    assert builder.cascade_per_item == {0: 32}
    width, n = 6, 8
    builder.prepare_for_capture(n, [1], [width], 64)
    assert builder.capture_metadata(4, 1)[0].cascade is None  # graphs below GRAPH_MIN_BATCH never plan
    bt, lens, prefix, num_blocks = _tables([(2, [1, 3]), (3, [2, 4, 1])], [2], gen)
    bt = np.pad(bt, ((0, 0), (0, width - bt.shape[1])))
    r, bs = len(lens), 8
    cache = torch.randn(2, num_blocks, BS, hkv, d, generator=gen).to(DEV)
    q = torch.randn(bs, heads, d, generator=gen).to(DEV)
    for shared in (True, False):
        b = bt if shared else np.where(np.arange(width)[None, :] < 3, bt + 100 * np.arange(r)[:, None], bt)
        inp = SimpleNamespace(query_lens=np.ones(r, dtype=np.int64), seq_lens=lens, ctx_lens=lens - 1,
                              block_tables=[b], slot_mappings=[np.full(r, -1)], num_decodes=r)
        pairs = builder.prepare_for_replay(inp, bs, 1, np.arange(r))
        meta = builder.capture_metadata(bs, 1)[0]
        for static, values in pairs:
            static.copy_(torch.from_numpy(np.ascontiguousarray(values)).view(static.shape))
        plan = meta.cascade
        assert int(plan.item_count.sum()) == (5 if shared else 0)
        np.testing.assert_array_equal(plan.prefix_lens[:r].cpu().numpy(), prefix if shared else 0)
        if not shared:
            continue
        qsl = torch.arange(bs + 1, dtype=torch.int32, device=DEV)
        want = decode_attention(q, cache, meta.block_tables, meta.seq_lens, qsl, bs, 64, 0.25, num_splits=1)
        got = cascade_decode_attention(q, cache, meta.block_tables, plan, qsl, bs, 0.25, torch.empty_like(q))
        torch.testing.assert_close(got[:r], want[:r], atol=2e-5, rtol=2e-5)

