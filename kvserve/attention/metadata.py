"""The attention metadata builder: each step's ``AttentionMetadata``, per KV cache group.

A backend owns its builder (``AttentionBackend.metadata_builder_cls``); the model runner
hands it the step's host inputs and gets back one ``AttentionMetadata`` per KV cache group,
with the typed feature metadata of the group's format and spec:

- ``residual`` (``ResidualMetadata``): groups whose format keeps the filling block exact
  (``KVFormat.residual``; ``ExactFillingBlocks`` in ``kv_residual.py`` owns the residuals);
- ``bounded`` (``BoundedAttention``): bounded-KV groups (``BoundedKVSpec``; ``BoundedPlanner``
  in ``bounded.py``).

CUDA graphs (``kvserve/worker/cuda_graphs.py``) use the capture / replay hooks, in the spirit
of mini-sglang's ``prepare_for_capture`` / ``prepare_for_replay``: ``prepare_for_capture``
allocates the static metadata tensors, ``capture_metadata`` views them for one captured
shape, ``prepare_for_replay`` lists the host values each replay copies into them.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvserve.attention.bounded import BoundedPlanner
from kvserve.attention.forward_context import AttentionMetadata, to_device
from kvserve.attention.kv_residual import ExactFillingBlocks
from kvserve.core.kv_cache_spec import BoundedKVSpec, KVCacheGroup

__all__ = ["AttentionMetadataBuilder", "base_metadata", "metadata_from_arrays", "to_device"]


class AttentionMetadataBuilder:
    """Builds each step's metadata for the KV cache groups of one model.

    Args:
        layers: the model's attention layers (each with its ``kv`` view and
            ``kv_cache_group_id``) -- bound to their caches.
        groups: the KV cache groups (``KVCacheConfig.groups``).
        input_batch: the runner's ``InputBatch`` (request rows and sampling params).
        model: the model (bounded KV widens its rotary tables).
        device / dtype: where the metadata goes; the compute dtype.
        max_num_seqs: requests per step (exact-filling-block slots to start with).
    """

    #: the metadata class this builder makes (a backend may subclass it)
    metadata_cls: type[AttentionMetadata] = AttentionMetadata

    def __init__(self, layers: list, groups: list[KVCacheGroup], input_batch, model, device: torch.device,
                 dtype: torch.dtype, max_num_seqs: int) -> None:
        self.groups = groups
        self.input_batch = input_batch
        self.device = device
        self.block_size = groups[0].spec.block_size
        self.bounded_specs = [g.spec if isinstance(g.spec, BoundedKVSpec) else None for g in groups]
        self.residual_groups = [g.spec.format.residual and self.bounded_specs[i] is None
                                for i, g in enumerate(groups)]
        self.residual: Optional[ExactFillingBlocks] = None
        if any(self.residual_groups):
            exact = [(layer.kv_cache_group_id, layer.kv) for layer in layers
                     if self.residual_groups[layer.kv_cache_group_id]]
            self.residual = ExactFillingBlocks(exact, max_num_seqs, self.block_size, dtype, device)
        self.bounded: Optional[BoundedPlanner] = None
        if any(s is not None for s in self.bounded_specs):
            self.bounded = BoundedPlanner(model, self.block_size, device)
        self._static = None  # CUDA-graph buffers (prepare_for_capture)

    @property
    def decode_graphs_supported(self) -> bool:
        """Whether whole decode steps can be captured: not with bounded KV, whose attention
        reads per-step host plans (it stays eager between piecewise-graphed pieces)."""
        return self.bounded is None

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, sched, inp) -> bool:
        """Per-step feature work before ``build`` (``sched``: the ``SchedulerOutput``, ``inp``:
        its ``BatchInputs``): exact filling blocks of joining requests and this step's slots;
        bounded KV's rotary tables. Returns True when a buffer that CUDA graphs read by
        address was reallocated (the runner then captures its graphs again)."""
        stale = False
        if self.residual is not None:
            states = self.input_batch.states
            slots = np.fromiter((states[r].row for r in inp.req_ids), dtype=np.int64, count=len(inp.req_ids))
            max_rows = len(self.input_batch.num_tokens)
            if len(slots) and int(slots.max()) >= self.residual.num_slots:  # before a joining row is filled
                self.residual.grow(max_rows)
            if sched.scheduled_new_reqs:
                self.residual.fill(sched.scheduled_new_reqs, states)
            stale |= self.residual.step_inputs(slots, inp.positions, inp.query_lens, inp.seq_lens, max_rows)
        if self.bounded is not None and inp.req_ids:
            stale |= self.bounded.grow_rotary(int(inp.seq_lens.max()))
        return stale

    def build(self, inp, pad_to: int | None = None) -> list[AttentionMetadata]:
        """The step's metadata per KV cache group; ``pad_to``: pad the token rows (slot -1) to
        that many (piecewise CUDA graphs). Call after ``prepare``."""
        metas = self._base(inp, pad_to)
        res = None
        if self.residual is not None:
            res = self.residual.metadata(inp.query_lens.tolist(), inp.seq_lens.tolist(), self.device, pad_to)
        for gi, m in enumerate(metas):
            if res is not None and self.residual_groups[gi]:
                m.residual = res
            spec = self.bounded_specs[gi]
            if spec is not None and inp.req_ids:
                m.bounded = self.bounded.plans(spec, inp, inp.block_tables[gi], self.input_batch.states)
        return metas

    def _base(self, inp, pad_to: int | None = None) -> list[AttentionMetadata]:
        return base_metadata(inp, self.device, pad_to, self.metadata_cls)

    def kv_block_mass(self, inp, metas: list[AttentionMetadata]) -> dict:
        """After the forward: h2o's attention mass per kept block (request id -> group id ->
        {block-table column: mass}), for the scheduler's eviction; empty without h2o."""
        if self.bounded is None:
            return {}
        return self.bounded.block_mass(inp.req_ids, metas)

    @classmethod
    def dummy(cls, block_table: np.ndarray, lens: list[int], block_size: int,
              device: torch.device) -> tuple[list[AttentionMetadata], torch.Tensor]:
        """Metadata for a prefill of ``lens`` tokens per row over ``block_table`` (one group, no
        features; memory profiling, training tools); returns ``(metadata list, positions)``."""
        q = np.asarray(lens, dtype=np.int64)
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        req_idx = np.repeat(np.arange(len(q)), q)
        pos = np.arange(int(qsl[-1])) - qsl[:-1][req_idx]
        slots = block_table[req_idx, pos // block_size].astype(np.int64) * block_size + pos % block_size
        metas = metadata_from_arrays(q, q, qsl, [block_table], [slots], int(np.count_nonzero(q == 1)), device,
                                     None, cls.metadata_cls)
        return metas, to_device(pos, device)

    # ---- CUDA graphs -----------------------------------------------------------------------
    def prepare_for_capture(self, max_num_seqs: int, query_lens: list[int], max_blocks_per_group: list[int],
                            max_model_len: int) -> None:
        """Allocate the static metadata the decode graphs read: per group slots ``[T]`` and
        block tables ``[N, width]``, ``seq_lens [N]``, ``query_start_loc`` per captured query
        length, and the features' (exact filling blocks). ``T = N * max(query_lens)``."""
        dev = self.device
        n = max_num_seqs
        t = n * max(query_lens)
        self._static = dict(
            slot_mappings=[torch.full((t,), -1, dtype=torch.long, device=dev) for _ in max_blocks_per_group],
            block_tables=[torch.zeros((n, w), dtype=torch.int32, device=dev) for w in max_blocks_per_group],
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            query_start_locs={q: torch.arange(0, n * q + 1, q, dtype=torch.int32, device=dev) for q in query_lens},
            max_model_len=max_model_len)
        if self.residual is not None:
            self.residual.prepare_for_capture(n, t, dev)

    def capture_metadata(self, bs: int, q: int, seq_lens_cpu: list[int] | None = None) -> list[AttentionMetadata]:
        """Metadata over the static buffers for a captured batch of ``bs`` requests of query
        length ``q`` (every request at ``max_model_len``: it fixes the decode split count).
        ``seq_lens_cpu``: the replayed step's true host lengths instead (the graph runner's CPU
        stand-in, whose backends read them); the static ``seq_lens`` are then left as copied."""
        st = self._static
        length = st["max_model_len"]
        if seq_lens_cpu is None:
            st["seq_lens"][:bs].fill_(q)
            seq_lens_cpu = [length] * bs
        metas = [self.metadata_cls(
            slot_mapping=sm[: bs * q], block_tables=bt[:bs], query_start_loc=st["query_start_locs"][q][: bs + 1],
            seq_lens=st["seq_lens"][:bs], query_lens_cpu=[q] * bs, seq_lens_cpu=list(seq_lens_cpu),
            max_query_len=q, max_seq_len=max(seq_lens_cpu), num_decodes=bs if q == 1 else 0,
        ) for sm, bt in zip(st["slot_mappings"], st["block_tables"])]
        if self.residual is not None:
            res = self.residual.capture_metadata(bs, bs * q, [q] * bs, list(seq_lens_cpu))
            for m, on in zip(metas, self.residual_groups):
                if on:
                    m.residual = res
        return metas

    def prepare_for_replay(self, inp, bs: int, q: int, dst: np.ndarray) -> list[tuple[torch.Tensor, np.ndarray]]:
        """``(static tensor, host values)`` pairs a replay of ``bs`` requests of query length
        ``q`` copies (the graph runner packs them into one host-to-device copy). ``dst``: the
        row of each real token (request ``i``'s ``j``-th at ``i * q + j``); padding rows store
        nothing (slot -1) and read the null block with ``seq_len = q``. Call after ``prepare``."""
        st = self._static
        r = len(inp.query_lens)
        t = bs * q
        pairs = []
        for g, (sm, bt) in enumerate(zip(st["slot_mappings"], st["block_tables"])):
            slots = np.full(t, -1, dtype=np.int64)
            slots[dst] = inp.slot_mappings[g]
            w = inp.block_tables[g].shape[1]
            table = np.zeros((bs, w), dtype=np.int32)  # padding rows read the null block
            table[:r] = inp.block_tables[g]
            pairs += [(sm[:t], slots), (bt[:bs, :w], table)]
        seq = np.full(bs, q, dtype=np.int64)
        seq[:r] = inp.ctx_lens + q
        pairs.append((st["seq_lens"][:bs], seq))
        if self.residual is not None:
            pairs += self.residual.prepare_for_replay(bs, t, dst)
        return pairs


def base_metadata(inp, device: torch.device, pad_to: int | None = None,
                  metadata_cls: type[AttentionMetadata] = AttentionMetadata) -> list[AttentionMetadata]:
    """The featureless metadata of a step (``BatchInputs``) per KV cache group; ``pad_to``
    pads each slot mapping with -1 to that many rows."""
    return metadata_from_arrays(inp.query_lens, inp.seq_lens, inp.query_start_loc, inp.block_tables,
                                inp.slot_mappings, inp.num_decodes, device, pad_to, metadata_cls)


def metadata_from_arrays(query_lens: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray,
                         block_tables: list[np.ndarray], slot_mappings: list[np.ndarray], num_decodes: int,
                         device: torch.device, pad_to: int | None = None,
                         metadata_cls: type[AttentionMetadata] = AttentionMetadata) -> list[AttentionMetadata]:
    """One featureless ``AttentionMetadata`` per KV cache group from host arrays (int64
    ``[R]`` lengths, ``[R + 1]`` prefix sums; per group a block table ``[R, width]`` and a
    slot mapping ``[T]``); ``pad_to`` pads each slot mapping with -1 to that many rows."""
    qsl = to_device(query_start_loc.astype(np.int32), device)
    sl = to_device(seq_lens.astype(np.int32), device)
    q_list, s_list = query_lens.tolist(), seq_lens.tolist()
    max_q = int(query_lens.max()) if len(query_lens) else 0
    max_s = int(seq_lens.max()) if len(seq_lens) else 0
    metas = []
    for bt, sm in zip(block_tables, slot_mappings):
        if pad_to is not None and pad_to > len(sm):
            sm = np.concatenate([sm, np.full(pad_to - len(sm), -1, dtype=np.int64)])
        metas.append(metadata_cls(
            slot_mapping=to_device(sm, device), block_tables=to_device(bt, device), query_start_loc=qsl,
            seq_lens=sl, query_lens_cpu=q_list, seq_lens_cpu=s_list, max_query_len=max_q, max_seq_len=max_s,
            num_decodes=num_decodes,
        ))
    return metas
