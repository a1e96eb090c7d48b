"""CUDA graphs: whole decode steps per padded batch size, and piecewise graphs for prefill.

A decode step of a small model is bound by host time: hundreds of kernel launches from
Python. Capturing the forward once per padded batch size and replaying it turns those
launches into one. The graphs read their inputs from static buffers that every replay
overwrites; rows past the real batch are padding (slot -1: nothing is stored; seq_len 1
over the null block 0: a finite, ignored output).

Only backends whose ``forward`` never reads device values back can be captured
(``AttentionBackend.cuda_graph_safe``).
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from kvserve.attention.forward_context import AttentionMetadata, forward_context
from kvserve.attention.metadata import AttentionMetadataBuilder, to_device

__all__ = ["AuxHiddenStates", "CUDAGraphRunner", "PiecewiseCUDAGraphRunner", "capture_sizes", "piecewise_sizes", "to_device"]

logger = logging.getLogger("kvserve")


class AuxHiddenStates:
    """Static buffers for the states a model keeps beside its output (``model.model.
    aux_hidden_states``: the residual stream entering the layers an EAGLE-3 head reads).

    Inside a graph those tensors live in the graph's pool at captured addresses; the graph
    copies them into one static buffer per layer (``[max_tokens, width]``, allocated at the
    warm-up, outside any graph) and ``publish`` points the model's dict at their first rows
    after a replay, where ``EagleProposer.record_hidden_states`` reads them.
    """

    def __init__(self, model, max_tokens: int) -> None:
        inner = getattr(model, "model", None)
        self.owner = inner if getattr(inner, "aux_hidden_state_layers", ()) else None
        self.max_tokens = max_tokens
        self.bufs: dict[int, torch.Tensor] = {}

    def allocate(self) -> None:
        """After an eager forward (the warm-up): a buffer per kept layer, as wide as its state."""
        if self.owner is None:
            return
        for i, v in self.owner.aux_hidden_states.items():
            b = self.bufs.get(i)
            if b is None or b.shape[-1] != v.shape[-1] or b.dtype != v.dtype:
                self.bufs[i] = torch.zeros((self.max_tokens, v.shape[-1]), dtype=v.dtype, device=v.device)

    def store(self, t: int) -> None:
        """Inside the captured forward of ``t`` tokens: copy the kept states into the buffers
        (none when the forward kept none: ``keep_aux_hidden_states`` off)."""
        if self.owner is not None:
            for i, v in self.owner.aux_hidden_states.items():
                self.bufs[i][:t].copy_(v)

    def publish(self, t: int, kept: bool = True) -> None:
        """After a replay of ``t`` rows: the model's ``aux_hidden_states`` are the buffers' rows
        (``kept``: the replayed graph copied them; else none)."""
        if self.owner is not None:
            self.owner.aux_hidden_states = {i: b[:t] for i, b in self.bufs.items()} if kept else {}

    def keep(self, on: bool) -> None:
        """Whether the model's next forwards keep the states (``LlamaModel.keep_aux_hidden_states``)."""
        if self.owner is not None:
            self.owner.keep_aux_hidden_states = on


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, every multiple of 8 up to 256, of 16 up to 512,
    of 32 beyond, and ``max_num_seqs``.

    Sparser above 256 (as vLLM's default list, which steps by 16 there) keeps the graph count,
    capture time and memory bounded at large ``max_num_seqs`` (67 graphs for 1024 instead of
    131) while padding wastes at most ~6% of a large batch, whose step is bound by the
    weights and KV reads rather than the padded rows.
    """
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, min(max_num_seqs, 256) + 1, 8))
    sizes += list(range(272, min(max_num_seqs, 512) + 1, 16))
    sizes += list(range(544, max_num_seqs + 1, 32))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CUDAGraphRunner:
    """Captures ``model(input_ids, positions)`` for decode batches and replays it.

    A graph is captured per padded batch size and query length ``q``: ``q = 1`` for plain
    decodes (the decode kernel), and ``q = 1 + k`` with speculative decoding, where each
    request verifies up to ``k`` drafts; a request with fewer tokens is padded to ``q`` with
    rows that store nothing (slot -1) and come after its real ones, so causal attention
    keeps them out of the real rows.

    The attention metadata lives in static buffers the backend's metadata builder owns
    (``AttentionMetadataBuilder.prepare_for_capture`` / ``capture_metadata`` /
    ``prepare_for_replay``); this runner owns the token inputs and the graphs.

    A graph's key is ``(padded batch size, q, aux)``. ``aux``: the forward keeps the EAGLE-3
    mid-layer states (``AuxHiddenStates``). With a model that keeps them, the ``q = 1`` graphs
    are captured twice: with them for a step after which the proposer drafts, without them
    (the plain engine's graph) for a step with speculation off; ``q > 1`` graphs verify drafts,
    so speculation is on and they keep them. Without such a model every key has ``aux`` False.

    ``eager=True`` is the CPU stand-in (tests): nothing is captured; a replay runs the model
    over the same static buffers and metadata views, with the step's true host lengths (the
    CPU backends read them). Not for exact-filling-block KV formats (their host slot lists).

    Args:
        model: the causal LM (``forward(input_ids [T], positions [T]) -> hidden [T, H]``),
            its attention layers bound to their caches (captured by address).
        builder: the backend's metadata builder for this model's KV cache groups.
        max_num_seqs: largest batch to capture.
        max_blocks_per_group: per KV cache group, the block-table columns.
        max_model_len: the ``max_seq_len`` the graphs are captured with (it fixes the
            decode kernel's split count; each request still walks only its own keys).
        device: the CUDA device.
        max_query_len: largest ``q`` (``1 + num_speculative_tokens``).
        eager: the CPU stand-in (no CUDA).
    """

    def __init__(self, model, builder: AttentionMetadataBuilder, max_num_seqs: int,
                 max_blocks_per_group: list[int], max_model_len: int, device: torch.device,
                 max_query_len: int = 1, eager: bool = False) -> None:
        self.model = model
        self.eager = eager
        self.builder = builder
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_group = max_blocks_per_group
        self.device = device
        t = max_num_seqs * max_query_len
        # Several q so a step whose k was lowered (dynamic speculation) pads to near its size.
        self.query_lens = sorted({q for q in (1, 2, 3, 5, 9) if q < max_query_len} | {max_query_len})
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = None
        self.aux = AuxHiddenStates(model, t)
        self.last_key: tuple[int, int, bool] | None = None  # the key of the last replay

    def _meta(self, bs: int, q: int) -> list[AttentionMetadata]:
        return self.builder.capture_metadata(bs, q)

    def aux_modes(self, q: int) -> tuple[bool, ...]:
        """The ``aux`` values captured for query length ``q`` (see the class doc)."""
        if self.aux.owner is None:
            return (False,)
        return (True, False) if q == 1 else (True,)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, q, aux), largest first so smaller graphs reuse its memory pool."""
        t0 = time.perf_counter()
        free_before = 0 if self.eager else torch.cuda.mem_get_info()[0]
        self.builder.prepare_for_capture(self.max_num_seqs, self.query_lens, self.max_blocks_per_group,
                                         self.max_model_len)
        try:
            for q in reversed(self.query_lens):
                for aux in self.aux_modes(q):
                    self.aux.keep(aux)
                    for bs in reversed(self.sizes):
                        self._capture_one(bs, q, aux)
        finally:
            self.aux.keep(True)
        if self.eager:
            return
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d, query lengths %s) in %.1f s, %.2f GiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.query_lens, time.perf_counter() - t0,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def _capture_one(self, bs: int, q: int, aux: bool) -> None:
        t = bs * q
        if self.eager:  # the stand-in's warm-up at padding lengths: the aux buffers' shapes
            with forward_context(self.builder.capture_metadata(bs, q, [q] * bs)):
                self.model(self.input_ids[:t], self.positions[:t])
            self.aux.allocate()
            self.graphs[(bs, q, aux)] = (None, None)
            return
        with forward_context(self._meta(bs, q)):
            self.model(self.input_ids[:t], self.positions[:t])  # warm-up: compiles kernels
        self.aux.allocate()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with forward_context(self._meta(bs, q)), torch.cuda.graph(graph, pool=self.pool):
            out = self.model(self.input_ids[:t], self.positions[:t])
            self.aux.store(t)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bs, q, aux)] = (graph, out)

    def _query_len(self, inp) -> int | None:
        """The captured q that serves this batch, or None."""
        if len(inp.query_lens) > self.sizes[-1] or (inp.query_lens - inp.num_drafts != 1).any():
            return None  # too many requests, or some request computes prefill tokens
        qmax = int(inp.query_lens.max())
        q = next((x for x in self.query_lens if x >= qmax), None)
        return q

    def can_run(self, inp) -> bool:
        """Whether a step (``BatchInputs``) is all decodes / draft verifications that fit."""
        return self._query_len(inp) is not None

    def graph_key(self, inp, aux: bool = False) -> tuple[int, int, bool]:
        """The captured graph a step replays (``can_run`` must hold): ``(padded batch size, q,
        aux)``; ``aux``: the proposer reads this step's EAGLE-3 states (ignored without them)."""
        q = self._query_len(inp)
        bs = self.sizes[bisect.bisect_left(self.sizes, len(inp.query_lens))]
        modes = self.aux_modes(q)
        return bs, q, bool(aux) if len(modes) > 1 else modes[0]

    def run(self, inp, pending: tuple[np.ndarray, np.ndarray, torch.Tensor] | None = None, aux: bool = True):
        """Replay the graph of the smallest captured size >= the batch.

        Args:
            inp: the step's ``BatchInputs`` (``can_run`` must hold).
            pending: ``(token indices, rows, sampled)``: tokens whose id is ``sampled[row]``
                on the device (the previous step's output).
            aux: keep the EAGLE-3 states this step (the proposer drafts after it); False
                replays the graph without them (``q = 1`` only; ignored without such states).

        All inputs travel in one pinned host->device copy. Returns ``(hidden [bs * q, H]`` (a
        view into the graph's output buffer)``, row_start [R])``: request ``i``'s rows begin at
        ``row_start[i]``.
        """
        bs, q, kept = key = self.graph_key(inp, aux)
        r = len(inp.query_lens)
        t = bs * q
        # Where each real token goes: request i's j-th token at row i * q + j.
        if q == 1:
            dst = np.arange(r)
        else:
            req_idx = np.repeat(np.arange(r), inp.query_lens)
            dst = req_idx * q + np.arange(len(req_idx)) - inp.query_start_loc[:-1][req_idx]
        ids = np.zeros(t, dtype=np.int64)
        ids[dst] = inp.token_ids
        pos = np.zeros(t, dtype=np.int64)
        pos[dst] = inp.positions
        pairs = [(self.input_ids[:t], ids), (self.positions[:t], pos)]
        pairs += self.builder.prepare_for_replay(inp, bs, q, dst)
        k = 0 if pending is None else len(pending[0])
        # One packed int64 host buffer: every (static tensor, values) pair, then pending dst | src.
        # int32 values (block tables) travel two to a slot: half the bytes, no widening on the host.
        half = [v.dtype == np.int32 for _, v in pairs]
        sizes = [(v.size + 1) // 2 if h else v.size for (_, v), h in zip(pairs, half)] + [k, k]
        offs = np.concatenate([[0], np.cumsum(sizes)])
        buf = np.empty(int(offs[-1]), dtype=np.int64)
        for (_, v), o, n, h in zip(pairs, offs, sizes, half):
            if h:
                buf[o:o + n].view(np.int32)[:v.size] = v.ravel()
            else:
                buf[o:o + n] = v.ravel()
        if k:
            buf[offs[-3]:offs[-2]] = dst[pending[0]]
            buf[offs[-2]:offs[-1]] = pending[1]
        dev = to_device(buf, self.input_ids.device)
        for (static, v), o, n, h in zip(pairs, offs, sizes, half):
            src = dev[o:o + n].view(torch.int32)[:v.size] if h else dev[o:o + n]
            static.copy_(src.view(static.shape))
        if k:
            tail = dev[offs[-3]:]
            self.input_ids.index_copy_(0, tail[:k], pending[2].index_select(0, tail[k:]))
        self.last_key = key
        graph, out = self.graphs[key]
        if self.eager:  # the stand-in: the model over the static buffers, true host lengths
            seq = np.full(bs, q, dtype=np.int64)
            seq[:r] = inp.ctx_lens + q
            self.aux.keep(kept)
            with forward_context(self.builder.capture_metadata(bs, q, seq.tolist())):
                out = self.model(self.input_ids[:t], self.positions[:t])
                self.aux.store(t)
        else:
            graph.replay()
        self.aux.publish(t, kept)
        return out[:t], np.arange(r) * q


def piecewise_sizes(max_num_tokens: int) -> list[int]:
    """Padded token counts for steps with prefill: powers of two from 16, plus 1.5x steps from
    512 (padding wastes at most a third there), then ``max_num_tokens`` itself."""
    sizes, s = [], 16
    while s < max_num_tokens:
        sizes.append(s)
        if s >= 512 and s * 3 // 2 < max_num_tokens:
            sizes.append(s * 3 // 2)
        s *= 2
    sizes.append(max_num_tokens)
    return sorted(set(sizes))


class PiecewiseCUDAGraphRunner:
    """CUDA graphs for steps that carry prefill tokens, captured in pieces between attention layers.

    A mixed step (prefill chunks beside decodes) has a shape that a whole-model graph cannot
    fix: how many requests, which are decodes, how long each chunk is. Everything except
    attention depends only on the token count, so the model is captured once per padded token
    count as ``num_layers + 1`` graphs that end where an attention layer begins; at replay,
    attention runs eagerly between the pieces with the step's real metadata (a handful of
    kernel launches per layer instead of ~15). The idea is vLLM's piecewise CUDA graphs,
    done here without torch.compile: ``Attention.forward`` calls a split hook while capturing.

    The pieces hand q/k/v to attention, and take its output back, through static buffers
    ``[max_num_tokens, width]``; rows past the real token count are padding whose slot is -1
    (nothing is stored) and which no request owns (their outputs are ignored).

    Args:
        model: the causal LM (``forward(input_ids [T], positions [T]) -> hidden [T, H]``),
            its attention layers bound to their caches.
        max_num_tokens: the largest step to capture (``max_num_batched_tokens``).
        device: the CUDA device.
    """

    def __init__(self, model, max_num_tokens: int, device: torch.device) -> None:
        self.model = model
        dev = device
        self.max_num_tokens = max_num_tokens
        self.sizes = piecewise_sizes(max_num_tokens)
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=dev)
        self.bufs: dict[str, torch.Tensor] = {}  # q, k, v, o, hidden: [max_num_tokens, width]
        self.layers: list = []  # Attention modules in call order
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self._pieces: list[torch.cuda.CUDAGraph] | None = None
        self.aux = AuxHiddenStates(model, max_num_tokens)

    def _buf(self, name: str, like: torch.Tensor) -> torch.Tensor:
        b = self.bufs.get(name)
        if b is None:
            b = self.bufs[name] = torch.zeros((self.max_num_tokens, like.shape[-1]), dtype=like.dtype,
                                              device=like.device)
        elif b.shape[-1] != like.shape[-1] or b.dtype != like.dtype:
            raise ValueError(f"piecewise graphs need one {name} width for all layers")
        return b

    def _split(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        for name, x in (("q", q), ("k", k), ("v", v)):
            self._buf(name, x)[:t].copy_(x)
        if self._pieces is not None:  # capturing: close this piece, open the next
            graph = self._pieces[-1]
            graph.capture_end()
            nxt = torch.cuda.CUDAGraph()
            nxt.capture_begin(pool=self.pool)
            self._pieces.append(nxt)
            self._order.append(layer)
        return self._buf("o", q)[:t]

    def _forward_split(self, t: int) -> None:
        from kvserve.layers.attention import attention_layers

        layers = attention_layers(self.model)
        for layer in layers:  # this model's layers only: another model in the process is untouched
            layer.split_hook = self._split
        try:
            with forward_context(None):
                out = self.model(self.input_ids[:t], self.positions[:t])
            self._buf("hidden", out)[:t].copy_(out)
            if self._pieces is None:
                self.aux.allocate()  # the warm-up
            self.aux.store(t)
        finally:
            for layer in layers:
                layer.split_hook = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all pieces sharing one memory pool (with the
        EAGLE-3 states kept: a prefill chunk's are what a proposer reads)."""
        t0 = time.perf_counter()
        self.aux.keep(True)  # a recapture may come after a step that turned them off
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t in reversed(self.sizes):
                self._forward_split(t)  # warm-up outside the graph (cuBLAS workspaces, kernels)
                torch.cuda.synchronize()
                first = torch.cuda.CUDAGraph()
                self._pieces, self._order = [first], []
                first.capture_begin(pool=self.pool)
                try:
                    self._forward_split(t)
                finally:
                    self._pieces[-1].capture_end()
                if not self.layers:
                    self.layers = self._order
                elif len(self._order) != len(self.layers):
                    raise RuntimeError("the model called attention a different number of times per size")
                self.graphs[t] = self._pieces
                self._pieces = None
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs for %d token counts (%d..%d, %d pieces each) in %.1f s, %.2f GiB",
                    len(self.sizes), self.sizes[0], self.sizes[-1], len(self.layers) + 1,
                    time.perf_counter() - t0, (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` replays at (None if it is too large)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        """Replay the pieces of the padded size, attention eager in between.

        Args:
            input_ids, positions: ``[T]`` int64 on the device.
            meta: the step's metadata per KV cache group; each ``slot_mapping`` must already be
                padded with -1 to ``padded_size(T)`` rows.
        Returns hidden states ``[T, hidden]`` (a view into a static buffer).
        """
        t = input_ids.shape[0]
        tp = self.padded_size(t)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        q, k, v, o = (self.bufs[n][:tp] for n in "qkvo")
        pieces = self.graphs[tp]
        with forward_context(meta):
            for graph, layer in zip(pieces, self.layers):
                graph.replay()
                o.copy_(layer.forward(q, k, v))
            pieces[-1].replay()
        self.aux.publish(t)
        return self.bufs["hidden"][:t]
