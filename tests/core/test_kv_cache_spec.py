"""KV cache specs and groups: exact page sizes and block counts, grouping, multi-group managers."""

from __future__ import annotations

import random

import pytest

# Imported before the tests below add a temporary format: kv_quant snapshots the unquantized
# formats by torch dtype at import, and an unquantized uint8 test format seen there would
# make every later int4 / int8 cache read as unquantized in this process.
import kvserve.attention.kv_quant  # noqa: F401
from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_spec import (
    KV_FORMATS,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVFormat,
    SlidingWindowSpec,
    get_kv_format,
    group_layers,
    make_kv_cache_config,
)
from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def test_page_size_and_bytes_per_token_follow_the_format():
    # SmolLM2-135M: 3 KV heads x 64 dims, block 16.
    f32 = FullAttentionSpec(16, 3, 64, "float32", "float32")
    assert f32.page_size_bytes == 2 * 16 * 3 * 64 * 4 == 24576
    assert f32.bytes_per_token == 1536
    bf16 = FullAttentionSpec(16, 3, 64, "bfloat16", "bfloat16")
    assert bf16.page_size_bytes == 12288
    # Scale bytes count in the page: a format with 4 bytes of scales per token and head.
    KV_FORMATS["test_q8"] = KVFormat("test_q8", 8, "uint8", scale_bytes_per_token_head=4)
    try:
        q8 = FullAttentionSpec(16, 3, 64, "test_q8", "bfloat16")
        assert q8.page_size_bytes == 16 * (2 * 3 * 64 + 3 * 4)
    finally:
        del KV_FORMATS["test_q8"]
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int7'.*bfloat16"):
        get_kv_format("int7")


def test_block_count_from_a_byte_budget():
    specs = {i: FullAttentionSpec(16, 3, 64, "float32", "float32") for i in range(30)}
    cfg = make_kv_cache_config(specs, 1 << 30)
    assert len(cfg.groups) == 1 and cfg.groups[0].layer_indices == list(range(30))
    assert cfg.bytes_per_block == 30 * 24576
    assert cfg.groups[0].num_blocks == (1 << 30) // (30 * 24576) == 1456
    assert cfg.bytes_per_token == 30 * 1536
    assert cfg.total_bytes <= 1 << 30
    assert make_kv_cache_config(specs, None, num_blocks_override=7).groups[0].num_blocks == 7


def test_layers_with_different_specs_form_groups():
    full = FullAttentionSpec(16, 2, 64, "bfloat16", "bfloat16")
    win = SlidingWindowSpec(16, 2, 64, "bfloat16", "bfloat16", sliding_window=512)
    groups = group_layers({i: (full if i % 6 == 5 else win) for i in range(18)})
    assert [g.spec for g in groups] == [win, full]
    assert groups[1].layer_indices == [5, 11, 17] and len(groups[0].layer_indices) == 15
    assert win.max_blocks_per_request(32768) == 33 and full.max_blocks_per_request(32768) == 2048
    with pytest.raises(ValueError, match="one block size"):
        group_layers({0: full, 1: FullAttentionSpec(8, 2, 64, "bfloat16", "bfloat16")})


def test_backend_rejects_a_format_it_cannot_read():
    from kvserve.attention.registry import get_attn_backend

    KV_FORMATS["test_q8"] = KVFormat("test_q8", 8, "uint8")
    try:
        with pytest.raises(ValueError, match="'torch_ref' cannot read a 'test_q8' KV cache"):
            get_attn_backend("torch_ref").validate_spec(FullAttentionSpec(16, 2, 8, "test_q8", "float32"))
    finally:
        del KV_FORMATS["test_q8"]


def _two_group_manager(num_blocks: int, bs: int) -> KVCacheManager:
    spec = FullAttentionSpec(bs, 1, 1, "float32", "float32")
    other = FullAttentionSpec(bs, 2, 1, "float32", "float32")
    return KVCacheManager(KVCacheConfig([KVCacheGroup(0, [0, 2], spec, num_blocks),
                                         KVCacheGroup(1, [1], other, num_blocks)]))


def test_two_groups_schedule_like_one_and_mirror_block_ids():
    """Two full-attention groups with equal pools: every step is the one-group step, and each
    request holds the same block ids in both groups (same allocation history)."""
    rng = random.Random(0)
    bs = 4
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    one = Scheduler(cfg, KVCacheManager.for_blocks(20, bs))
    two = Scheduler(cfg, _two_group_manager(20, bs))
    base = [rng.randrange(5) for _ in range(12)]
    for s in (one, two):
        r2 = random.Random(1)
        for i in range(10):
            n = r2.randint(2, 20)
            prompt = (base[:r2.randint(0, n)] + [r2.randrange(5) for _ in range(n)])[:n]
            s.add_request(Request(f"q{i}", prompt, SamplingParams(max_tokens=r2.randint(1, 20), ignore_eos=True),
                                  arrival_time=float(i)))
    steps = 0
    while one.has_unfinished_requests():
        a, b = one.schedule(), two.schedule()
        assert a.num_scheduled_tokens == b.num_scheduled_tokens
        assert a.preempted_req_ids == b.preempted_req_ids
        assert [(o.src, o.dst, o.num_tokens) for o in a.block_ops] == \
            [(o.src, o.dst, o.num_tokens) for o in b.block_ops if o.group_id == 0] == \
            [(o.src, o.dst, o.num_tokens) for o in b.block_ops if o.group_id == 1]
        for rid in a.num_scheduled_tokens:
            g0, g1 = two.kv.get_block_ids(rid)
            assert g0 == g1 == one.kv.get_block_ids(rid)[0]
        toks = {rid: [rng.randrange(5)] for rid in a.num_scheduled_tokens if one.requests[rid].num_pending_tokens}
        one.update_from_output(a, ModelRunnerOutput(toks))
        two.update_from_output(b, ModelRunnerOutput(toks))
        two.kv.check_invariants()
        steps += 1
    assert not two.has_unfinished_requests() and steps > 10
    assert one.prefix_cache_hits == two.prefix_cache_hits > 0
    assert all(g.pool.get_num_free_blocks() == g.pool.num_usable_blocks for g in two.kv.groups)


def test_hit_is_the_shortest_over_groups():
    bs = 4
    kv = _two_group_manager(16, bs)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(a)
    assert n == 0
    assert kv.allocate_slots(a, 12, hits) is not None
    a.num_computed_tokens = 12
    kv.free(a)  # its 3 full blocks stay cached in both groups
    # Group 1 forgets its cache: a new request with the same prompt hits nothing there.
    assert kv.groups[1].pool.reset_prefix_cache()
    b = Request("b", list(range(12)) + [99], SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(b)
    assert n == 0 and [len(h) for h in hits] == [0, 0]
    c = Request("c", list(range(12)) + [99], SamplingParams(max_tokens=1))
    hits0, n0 = kv.groups[0].get_computed_blocks(c)
    assert n0 == 12  # group 0 alone would have served all three blocks
