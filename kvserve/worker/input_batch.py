"""The worker's persistent input batch: per-request state kept across steps.

A worker never reads a scheduler ``Request``. It applies each ``SchedulerOutput`` diff to
this batch: new requests get a row (their tokens, block ids per KV cache group and sampling
state: seeds, penalty inputs), running requests get their new block ids appended and their
``num_computed_tokens`` set, finished / preempted ones lose their row. Tokens the worker
samples are appended by the worker itself. ``prepare`` then builds a step's flat varlen
host arrays (token ids, positions, slot mappings, block tables, query start offsets,
sequence lengths) with vectorized numpy over the rows, with no per-token Python.

Rows are not kept contiguous: a step gathers the rows it needs by index. Arrays grow when
more rows are live than expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.sample.metadata import plain_greedy
from kvserve.sampling_params import SamplingParams


class CachedRequestState:
    """A request as the worker knows it (also what the sampler reads, by these names).

    Attributes:
        req_id, prompt_token_ids, sampling_params, eos_token_id: as sent by the scheduler.
        output_token_ids: tokens generated so far, as this worker knows them.
        generator: the request's torch.Generator for seeded sampling (made lazily).
        row: its row in the ``InputBatch`` arrays.
    """

    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling_params", "eos_token_id",
                 "generator", "row")

    def __init__(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: Optional[int], row: int) -> None:
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.generator = None
        self.row = row

    @property
    def request_id(self) -> str:
        return self.req_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class BlockTable:
    """One KV cache group's block ids per row: int32 ``[rows, max_blocks]`` plus lengths."""

    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)

    def ensure_width(self, max_blocks: int) -> None:
        """Widen the table to at least ``max_blocks`` columns (bounded KV: requests may run past
        ``max_model_len``; doubles, so growth is amortized)."""
        w = self.table.shape[1]
        if max_blocks > w:
            t = np.zeros((self.table.shape[0], max(max_blocks, 2 * w)), dtype=np.int32)
            t[:, :w] = self.table
            self.table = t

    def set_row(self, row: int, ids: list[int]) -> None:
        n = len(ids)
        self.ensure_width(n)
        self.table[row, :n] = ids
        self.num_blocks[row] = n

    def append(self, row: int, ids: list[int]) -> None:
        n = int(self.num_blocks[row])
        self.ensure_width(n + len(ids))
        self.table[row, n:n + len(ids)] = ids
        self.num_blocks[row] = n + len(ids)

    def grow(self, num_rows: int) -> None:
        t = np.zeros((num_rows, self.table.shape[1]), dtype=np.int32)
        t[: len(self.table)] = self.table
        nb = np.zeros(num_rows, dtype=np.int64)
        nb[: len(self.num_blocks)] = self.num_blocks
        self.table, self.num_blocks = t, nb


@dataclass
class BatchInputs:
    """A step's flat varlen inputs on the host (requests ordered decodes first).

    Attributes:
        req_ids: the scheduled requests in batch order.
        query_lens / ctx_lens / seq_lens: int64 ``[R]``: tokens computed this step, tokens
            already cached, and their sum.
        query_start_loc: int64 ``[R + 1]`` prefix sums of ``query_lens``.
        positions: int64 ``[T]`` absolute position of each token.
        token_ids: int64 ``[T]``; entries of ``pending_idx`` are placeholders (0).
        pending_idx / pending_req: ``[P]`` token indices whose id is the previous step's
            sampled token, and the request owning each (async scheduling).
        block_tables: per KV cache group, int32 ``[R, max_blocks]`` (zero-padded).
        slot_mappings: per group, int64 ``[T]`` flat KV slot of each token.
        num_decodes: the first ``num_decodes`` requests have query length 1.
        num_drafts: int64 ``[R]`` draft tokens among each request's ``query_lens``.
        samples: bool ``[R]``: the request reaches its last known token and samples.
    """

    req_ids: list[str]
    query_lens: np.ndarray
    ctx_lens: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    pending_idx: np.ndarray
    pending_req: list[str]
    block_tables: list[np.ndarray]
    slot_mappings: list[np.ndarray]
    num_decodes: int
    num_drafts: np.ndarray
    samples: np.ndarray


class InputBatch:
    """Persistent per-request state of one worker.

    Args:
        max_num_reqs: rows to start with (grows when exceeded).
        max_model_len: longest sequence (token row width).
        block_size: tokens per KV block.
        max_blocks_per_group: per KV cache group, the block-table width.
        sliding_windows: per KV cache group, its window (None: full attention). Entries of a
            window group below the window of a row's first new token are given as the null
            block 0: the scheduler may have freed (and reused) those blocks.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_blocks_per_group: list[int], sliding_windows: Optional[list[Optional[int]]] = None) -> None:
        self.block_size = block_size
        self.sliding_windows = list(sliding_windows or [None] * len(max_blocks_per_group))
        self.max_model_len = max_model_len
        n = max(max_num_reqs, 1)
        self.token_ids = np.zeros((n, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(n, dtype=np.int64)  # known tokens per row
        self.num_computed = np.zeros(n, dtype=np.int64)  # the scheduler's count, before this step
        self.block_tables = [BlockTable(n, mb) for mb in max_blocks_per_group]
        self.states: dict[str, CachedRequestState] = {}
        # Request id -> its row (``states[r].row``), read over the batch at C speed every step.
        self.rows: dict[str, int] = {}
        # Requests that asked for prompt logprobs (the runner looks at these only, not every row).
        self.prompt_logprobs_reqs: set[str] = set()
        # Requests whose sampling is more than a plain argmax (``sample.metadata.plain_greedy``):
        # while none is held, the sampler skips its per-request look at the batch.
        self.sampling_extra_reqs: set[str] = set()
        self._free_rows = list(range(n - 1, -1, -1))

    @property
    def num_reqs(self) -> int:
        return len(self.states)

    # ---- applying a step's diff ----------------------------------------------------------
    def _take_row(self) -> int:
        if not self._free_rows:
            old = len(self.num_tokens)
            new = old * 2
            t = np.zeros((new, self.token_ids.shape[1]), dtype=np.int64)
            t[:old] = self.token_ids
            self.token_ids = t
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros(old, dtype=np.int64)])
            self.num_computed = np.concatenate([self.num_computed, np.zeros(old, dtype=np.int64)])
            for bt in self.block_tables:
                bt.grow(new)
            self._free_rows = list(range(new - 1, old - 1, -1))
        return self._free_rows.pop()

    def add_request(self, new: NewRequestData) -> CachedRequestState:
        """A request the worker has not seen (or that resumes after preemption)."""
        if new.req_id in self.states:
            self.remove_request(new.req_id)
        row = self._take_row()
        st = CachedRequestState(new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
                                new.sampling_params, new.eos_token_id, row)
        self.states[new.req_id] = st
        self.rows[new.req_id] = row
        if new.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs_reqs.add(new.req_id)
        if not plain_greedy(new.sampling_params):
            self.sampling_extra_reqs.add(new.req_id)
        p, o = len(st.prompt_token_ids), len(st.output_token_ids)
        self._ensure_token_cols(p + o)
        self.token_ids[row, :p] = st.prompt_token_ids
        if o:
            self.token_ids[row, p:p + o] = st.output_token_ids
        self.num_tokens[row] = p + o
        self.num_computed[row] = new.num_computed_tokens
        for bt, ids in zip(self.block_tables, new.block_ids):
            bt.set_row(row, ids)
        return st

    def remove_request(self, req_id: str) -> None:
        st = self.states.pop(req_id, None)
        if st is not None:
            del self.rows[req_id]
            self._free_rows.append(st.row)
            self.prompt_logprobs_reqs.discard(req_id)
            self.sampling_extra_reqs.discard(req_id)

    def update_cached(self, cached: CachedRequestData) -> None:
        """Append new block ids and set ``num_computed_tokens`` for running requests.

        Invariant shared with the scheduler's KV cache manager: before a step's allocation a
        request holds ``ceil(num_computed_tokens / block_size)`` blocks per group, so rows
        are cut to that first (blocks freed after rejected draft tokens) and then extended.
        """
        ids = cached.req_ids
        if not ids:
            return
        bs = self.block_size
        try:
            rows = np.fromiter(map(self.rows.__getitem__, ids), dtype=np.int64, count=len(ids))
        except KeyError as e:
            raise RuntimeError(f"step names request {e.args[0]!r} that this worker does not hold") from None
        nc = np.asarray(cached.num_computed_tokens, dtype=np.int64)
        # Over the batch at once, rows whose count changed (every decode row, each step).
        changed = np.flatnonzero(nc != self.num_computed[rows])
        if len(changed):
            crows, keep = rows[changed], -(-nc[changed] // bs)
            for bt in self.block_tables:
                cut = bt.num_blocks[crows] > keep
                if cut.any():
                    bt.num_blocks[crows[cut]] = keep[cut]
        self.num_computed[rows] = nc
        tables = self.block_tables
        nb = cached.new_block_ids
        if nb.count(None) != len(nb):  # C-speed checks first: most decode steps allocate few blocks
            for i, new_ids in enumerate(nb):
                if new_ids is not None:
                    row = int(rows[i])
                    for bt, b in zip(tables, new_ids):
                        if b:
                            bt.append(row, b)
        if any(cached.new_token_ids):
            for rid, toks in zip(ids, cached.new_token_ids):
                if toks:
                    self.append_tokens(rid, toks)

    def _ensure_token_cols(self, num_tokens: int) -> None:
        """Widen the token rows to hold ``num_tokens`` tokens (+ drafts); only bounded-KV requests
        outgrow ``max_model_len`` (doubling, amortized)."""
        w = self.token_ids.shape[1]
        if num_tokens + 1 > w:
            t = np.zeros((self.token_ids.shape[0], max(num_tokens + 1, 2 * w)), dtype=np.int64)
            t[:, :w] = self.token_ids
            self.token_ids = t

    def apply(self, sched: SchedulerOutput) -> None:
        """Apply a step's diff: drop finished rows, add new requests, update running ones, null
        the block-table entries bounded-KV eviction freed (``SchedulerOutput.evicted_blocks``)."""
        for rid in sched.finished_req_ids:
            self.remove_request(rid)
        for rid in sched.preempted_req_ids:
            self.remove_request(rid)
        for new in sched.scheduled_new_reqs:
            self.add_request(new)
        self.update_cached(sched.scheduled_cached_reqs)
        for rid, entries in sched.evicted_blocks.items():
            st = self.states.get(rid)
            if st is not None:
                for gid, col in entries:
                    self.block_tables[gid].table[st.row, col] = 0

    def append_tokens(self, req_id: str, tokens: list[int]) -> None:
        """Tokens sampled for ``req_id`` (ignored if the request is gone)."""
        st = self.states.get(req_id)
        if st is None:
            return
        row = st.row
        n = int(self.num_tokens[row])
        self._ensure_token_cols(n + len(tokens))
        k = min(len(tokens), self.token_ids.shape[1] - n)
        self.token_ids[row, n:n + k] = tokens[:k]
        self.num_tokens[row] = n + k
        st.output_token_ids.extend(tokens)

    def append_sampled(self, req_ids: list[str], tokens: list[int]) -> None:
        """One sampled token per request (``req_ids[i]`` gets ``tokens[i]``): ``append_tokens``
        over the batch at once (requests gone are skipped)."""
        sts = list(map(self.states.get, req_ids))
        if None in sts:
            keep = [i for i, st in enumerate(sts) if st is not None]
            sts, tokens, req_ids = [sts[i] for i in keep], [tokens[i] for i in keep], [req_ids[i] for i in keep]
        if not sts:
            return
        rows = np.fromiter(map(self.rows.__getitem__, req_ids), dtype=np.int64, count=len(sts))
        n = self.num_tokens[rows]
        self._ensure_token_cols(int(n.max()) + 1)
        self.token_ids[rows, n] = tokens
        self.num_tokens[rows] = n + 1
        for st, tok in zip(sts, tokens):
            st.output_token_ids.append(tok)

    # ---- building a step -------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> BatchInputs:
        """The step's flat inputs (call after ``apply``). Decodes (query length 1) go first.

        Raises RuntimeError if a token to compute is neither known nor the single token the
        previous step sampled for its request.
        """
        nst = sched.num_scheduled_tokens
        rids = list(nst)
        rows = np.fromiter(map(self.rows.__getitem__, rids), dtype=np.int64, count=len(rids))
        q = np.fromiter(nst.values(), dtype=np.int64, count=len(rids))
        spec = sched.scheduled_spec_decode_tokens
        k = np.zeros(len(rids), dtype=np.int64)
        if spec:
            for i, rid in enumerate(rids):
                d = spec.get(rid)
                if d:
                    k[i] = len(d)
                    row = rows[i]
                    n = self.num_tokens[row]
                    self.token_ids[row, n:n + len(d)] = d
        order = np.argsort(q != 1, kind="stable")
        if not (order[:-1] < order[1:]).all():
            rows, q, k = rows[order], q[order], k[order]
            rids = [rids[i] for i in order]
        ctx = self.num_computed[rows]
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        total = int(qsl[-1])
        req_idx = np.repeat(np.arange(len(q)), q)
        positions = np.arange(total, dtype=np.int64) - qsl[:-1][req_idx] + ctx[req_idx]
        tok_rows = rows[req_idx]
        token_ids = self.token_ids[tok_rows, positions]
        known = self.num_tokens[rows] + k
        unknown = positions >= known[req_idx]
        pending_idx = np.flatnonzero(unknown)
        pending_req: list[str] = []
        if len(pending_idx):
            token_ids[pending_idx] = 0
            preq = req_idx[pending_idx]
            ok = (positions[pending_idx] == self.num_tokens[rows[preq]]) & (k[preq] == 0)
            # preq is nondecreasing (token order): one pending token per request <=> strictly increasing.
            if not ok.all() or (len(preq) > 1 and not (preq[1:] != preq[:-1]).all()):
                bad = rids[int(preq[np.flatnonzero(~ok)[0]] if not ok.all() else preq[0])]
                raise RuntimeError(f"request {bad!r}: a scheduled token is neither known nor sampled by the "
                                   f"previous step")
            # Every request pending (the usual async decode step): preq is 0..R-1.
            pending_req = list(rids) if len(preq) == len(rids) else [rids[i] for i in preq.tolist()]
        bs = self.block_size
        blk, off = positions // bs, positions % bs
        block_tables, slots = [], []
        for bt, window in zip(self.block_tables, self.sliding_windows):
            nb = bt.num_blocks[rows]
            width = max(int(nb.max()), 1)
            tbl = bt.table[rows, :width]
            if (nb < width).any():  # columns past a row's blocks: the null block 0
                tbl[np.arange(width) >= nb[:, None]] = 0
            if window is not None:  # columns below the window: the null block 0
                skip = np.maximum(ctx - window + 1, 0) // bs
                if skip.any():
                    tbl[np.arange(width) < skip[:, None]] = 0
            block_tables.append(tbl)
            slots.append(tbl[req_idx, blk].astype(np.int64) * bs + off)
        num_decodes = int(np.count_nonzero(q == 1))
        samples = ctx + q - k >= self.num_tokens[rows]
        return BatchInputs(rids, q, ctx, ctx + q, qsl, positions, token_ids, pending_idx, pending_req,
                           block_tables, slots, num_decodes, k, samples)
