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
        """Inside the captured forward of ``t`` tokens: copy the kept states into the buffers."""
        if self.owner is not None:
            for i, v in self.owner.aux_hidden_states.items():
                self.bufs[i][:t].copy_(v)

    def publish(self, t: int) -> None:
        """After a replay of ``t`` rows: the model's ``aux_hidden_states`` are the buffers' rows."""
        if self.owner is not None:
            self.owner.aux_hidden_states = {i: b[:t] for i, b in self.bufs.items()}


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
    """

    def __init__(self, model, builder: AttentionMetadataBuilder, max_num_seqs: int,
                 max_blocks_per_group: list[int], max_model_len: int, device: torch.device,
                 max_query_len: int = 1) -> None:
        self.model = model
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
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.aux = AuxHiddenStates(model, t)

    def _meta(self, bs: int, q: int) -> list[AttentionMetadata]:
        return self.builder.capture_metadata(bs, q)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, q), largest first so smaller graphs reuse its memory pool."""
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        self.builder.prepare_for_capture(self.max_num_seqs, self.query_lens, self.max_blocks_per_group,
                                         self.max_model_len)
        for q in reversed(self.query_lens):
            for bs in reversed(self.sizes):
                t = bs * q
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
                self.graphs[(bs, q)] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d, query lengths %s) in %.1f s, %.2f GiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.query_lens, time.perf_counter() - t0,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

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

    def run(self, inp, pending: tuple[np.ndarray, np.ndarray, torch.Tensor] | None = None):
        """Replay the graph of the smallest captured size >= the batch.

        Args:
            inp: the step's ``BatchInputs`` (``can_run`` must hold).
            pending: ``(token indices, rows, sampled)``: tokens whose id is ``sampled[row]``
                on the device (the previous step's output).

        All inputs travel in one pinned host->device copy. Returns ``(hidden [bs * q, H]`` (a
        view into the graph's output buffer)``, row_start [R])``: request ``i``'s rows begin at
        ``row_start[i]``.
        """
        q = self._query_len(inp)
        r = len(inp.query_lens)
        bs = self.sizes[bisect.bisect_left(self.sizes, r)]
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
        # One packed host buffer: every (static tensor, values) pair, then pending dst | src.
        sizes = [v.size for _, v in pairs] + [k, k]
        offs = np.concatenate([[0], np.cumsum(sizes)])
        buf = np.empty(int(offs[-1]), dtype=np.int64)
        for (_, v), o in zip(pairs, offs):
            buf[o:o + v.size] = v.ravel()
        if k:
            buf[offs[-3]:offs[-2]] = dst[pending[0]]
            buf[offs[-2]:offs[-1]] = pending[1]
        dev = to_device(buf, self.input_ids.device)
        for (static, v), o in zip(pairs, offs):
            static.copy_(dev[o:o + v.size].view(static.shape))
        if k:
            tail = dev[offs[-3]:]
            self.input_ids.index_copy_(0, tail[:k], pending[2].index_select(0, tail[k:]))
        graph, out = self.graphs[(bs, q)]
        graph.replay()
        self.aux.publish(t)
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
        """Capture every size, largest first, all pieces sharing one memory pool."""
        t0 = time.perf_counter()
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
