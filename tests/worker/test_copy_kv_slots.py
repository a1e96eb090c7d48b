"""ModelRunner.copy_kv_slots: the prefix cache's copy-on-write, on every layer's cache."""

from __future__ import annotations

import torch

from kvserve.worker.model_runner import ModelRunner


def test_copy_kv_slots_copies_only_the_named_slots_on_every_layer():
    mr = ModelRunner.__new__(ModelRunner)  # no model needed
    mr.block_size, mr.device = 4, torch.device("cpu")
    shape = (2, 6, 4, 3, 5)  # (K/V, blocks, block_size, kv_heads, head_dim)
    mr.kv_caches = [torch.randn(shape) for _ in range(3)]
    before = [c.clone() for c in mr.kv_caches]
    mr.copy_kv_slots([(2, 4, 3), (1, 5, 1)])
    for c, b in zip(mr.kv_caches, before):
        want = b.clone()
        want[:, 4, :3] = b[:, 2, :3]
        want[:, 5, :1] = b[:, 1, :1]
        assert torch.equal(c, want)
    mr.copy_kv_slots([])  # no-op
