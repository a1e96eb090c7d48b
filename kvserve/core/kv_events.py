"""KV cache events: the prefix cache's block stores, evictions and clears, in vLLM's wire schema.

``KVEventRecorder`` sits on a block pool (``BlockPool.kv_events``) of a full-attention KV cache
group and turns the radix tree's changes into events, in order:

* ``BlockStored``: full blocks registered in the prefix cache (a block gets its hash when the
  step that fills it is scheduled; ``PrefixCache.insert_blocks``). A chain registered together
  is one event: ``block_hashes`` in order, ``parent_block_hash`` the hash of the block before the
  first (None at a root), ``token_ids`` the blocks' tokens concatenated.
* ``BlockRemoved``: cached blocks evicted from the pool (``BlockPool.allocate`` / ``_evict``),
  consecutive ones merged.
* ``AllBlocksCleared``: ``reset_prefix_cache`` emptied the pool's cache.

The engine core takes the events after each step and publishes them as one ``KVEventBatch``
(``kvserve.engine.kv_events``). The structs are vLLM's (``vllm.distributed.kv_events``), field
for field: ``KVEventBatch`` is a positional array ``[ts, events, data_parallel_rank]``; each event
is a msgpack map tagged by its class name under ``"type"`` (vLLM encodes events as maps since its
PR #42892; the consumers of llm-d, Dynamo and SGLang decode this form).

Block hashes: the engine's chained hash ``h_i = hash((h_{i-1}, tokens_i, cache_salt))`` (a
signed 64-bit Python int) is sent as the unsigned 64-bit int with the same bits
(``external_block_hash``), as vLLM sends its 64-bit hashes. Python salts ``hash`` per process
for ``None`` and strings, so a consumer cannot recompute them: it chains the blocks by
``parent_block_hash`` and keys them by their ``token_ids`` (``kvserve.router.kv_events``).
A salted request's blocks carry ``extra_keys = [(cache_salt,)]`` per block.

Pure Python (msgspec only).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

#: The tier a block lives in (vLLM's ``MEDIUM_GPU``): the engine's own KV pool, on any device.
MEDIUM_GPU = "GPU"
_U64 = (1 << 64) - 1


def external_block_hash(h: Optional[int]) -> Optional[int]:
    """The engine's signed 64-bit block hash as the unsigned int sent in events (None stays None)."""
    return None if h is None else h & _U64


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # seconds since the epoch
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (tagged by class name under ``"type"``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class KVEventRecorder:
    """Collects one block pool's events between two ``take()`` calls (see the module docstring).

    Args:
        block_size: tokens per block.
        group_idx: the KV cache group of the pool (sent in every event).
        medium: the tier named in the events.
    """

    __slots__ = ("block_size", "group_idx", "medium", "events", "num_events")

    def __init__(self, block_size: int, group_idx: int = 0, medium: str = MEDIUM_GPU) -> None:
        self.block_size = block_size
        self.group_idx = group_idx
        self.medium = medium
        self.events: list[KVCacheEvent] = []
        self.num_events = 0  # cumulative, events recorded

    def stored(self, block_hash: int, parent_hash: Optional[int], tokens: tuple[int, ...], salt=None) -> None:
        """A full block entered the prefix cache (``parent_hash``: its parent's hash, None at a root)."""
        h, parent = block_hash & _U64, external_block_hash(parent_hash)
        ev = self.events[-1] if self.events else None
        extra = None if salt is None else (salt,)
        if type(ev) is BlockStored and ev.block_hashes[-1] == parent \
                and (ev.extra_keys[-1] if ev.extra_keys else None) == extra:
            ev.block_hashes.append(h)
            ev.token_ids.extend(tokens)
            if ev.extra_keys is not None:
                ev.extra_keys.append(extra)
            return
        self.num_events += 1
        self.events.append(BlockStored(
            [h], parent, list(tokens), self.block_size, None, self.medium, None,
            extra_keys=None if extra is None else [extra], group_idx=self.group_idx,
            kv_cache_spec_kind="full_attention"))

    def removed(self, block_hash: int) -> None:
        """A cached block was evicted (its hash left the pool)."""
        ev = self.events[-1] if self.events else None
        if type(ev) is BlockRemoved:
            ev.block_hashes.append(block_hash & _U64)
            return
        self.num_events += 1
        self.events.append(BlockRemoved([block_hash & _U64], self.medium, group_idx=self.group_idx))

    def cleared(self) -> None:
        """Every cached block of the pool was dropped (``reset_prefix_cache``)."""
        self.num_events += 1
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first (the recorder starts afresh)."""
        out, self.events = self.events, []
        return out
