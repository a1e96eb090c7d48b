"""ModelRunner.run_block_ops: the prefix cache's copy-on-write, on every layer of the op's group."""

from __future__ import annotations

import torch

from kvserve.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from kvserve.core.sched_output import BlockOp
from kvserve.worker.model_runner import ModelRunner


def test_copy_ops_copy_only_the_named_slots_of_their_group():
    mr = ModelRunner.__new__(ModelRunner)  # no model needed
    mr.block_size, mr.device = 4, torch.device("cpu")
    shape = (2, 6, 4, 3, 5)  # (K/V, blocks, block_size, kv_heads, head_dim)
    spec = FullAttentionSpec(4, 3, 5, "float32", "float32")
    mr.kv_cache_config = KVCacheConfig([KVCacheGroup(0, [0, 2], spec, 6), KVCacheGroup(1, [1], spec, 6)])
    mr.kv_caches = {i: torch.randn(shape) for i in range(3)}
    before = {i: c.clone() for i, c in mr.kv_caches.items()}
    mr.run_block_ops([BlockOp("copy", 0, 2, 4, 3), BlockOp("copy", 0, 1, 5, 1), BlockOp("copy", 1, 3, 0, 2)])
    for i in (0, 2):
        want = before[i].clone()
        want[:, 4, :3] = before[i][:, 2, :3]
        want[:, 5, :1] = before[i][:, 1, :1]
        assert torch.equal(mr.kv_caches[i], want)
    want = before[1].clone()
    want[:, 0, :2] = before[1][:, 3, :2]
    assert torch.equal(mr.kv_caches[1], want)
    mr.run_block_ops([])  # no-op


def test_copy_ops_carry_codes_and_scales_of_quantized_pages():
    """Quantized pages keep codes and scales apart (kv_quant): a copy moves both, for the named
    slots only, and the destination reads back as the source's values."""
    from kvserve.attention.kv_quant import dequantize_pages, pages_to_rows, quantize_pages
    from kvserve.core.kv_cache_spec import get_kv_format

    mr = ModelRunner.__new__(ModelRunner)
    mr.block_size, mr.device = 4, torch.device("cpu")
    for name in ("int4", "fp8_e4m3"):
        spec = FullAttentionSpec(4, 3, 32, name, "float32")
        mr.kv_cache_config = KVCacheConfig([KVCacheGroup(0, [0], spec, 6)])
        fmt = get_kv_format(name)
        mr.kv_caches = {0: quantize_pages(torch.randn(2, 6, 4, 3, 32), fmt)}
        before = pages_to_rows(mr.kv_caches[0], 32, fmt)
        mr.run_block_ops([BlockOp("copy", 0, 2, 4, 3)])
        want = before.clone()
        want[:, 4, :3] = before[:, 2, :3]
        after = mr.kv_caches[0]
        assert torch.equal(pages_to_rows(after, 32, fmt).view(torch.uint8), want.view(torch.uint8))
        vals = dequantize_pages(after, 32, torch.float32, fmt)
        assert torch.equal(vals[:, 4, :3], vals[:, 2, :3])
