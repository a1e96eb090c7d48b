"""CUDA graphs for decode-only steps, one per padded batch size.

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

logger = logging.getLogger("kvserve")


def to_device(x: np.ndarray | list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host array -> tensor on ``device``; on CUDA through pinned memory with ``non_blocking``.

    A copy from pageable memory may wait for the stream, which would stall the host behind
    the step in flight (async scheduling). Pinned buffers come from torch's caching host
    allocator, which keeps each one until its copy is done.
    """
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else torch.tensor(x, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CUDAGraphRunner:
    """Captures ``model(input_ids, positions)`` for decode batches and replays it.

    Args:
        model: the causal LM (``forward(input_ids [T], positions [T]) -> hidden [T, H]``).
        kv_caches: per-layer KV tensors (captured by address; never reallocated).
        max_num_seqs: largest batch to capture.
        max_blocks_per_seq: block-table columns (``ceil(max_model_len / block_size)``).
        max_model_len: the ``max_seq_len`` the graphs are captured with (it fixes the
            decode kernel's split count; each request still walks only its own keys).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        dev = kv_caches[0].device
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            query_lens_cpu=[1] * bs, seq_lens_cpu=[self.max_model_len] * bs,
            max_query_len=1, max_seq_len=self.max_model_len, num_decodes=bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            with forward_context(meta, self.kv_caches):
                self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up: compiles kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.model(self.input_ids[:bs], self.positions[:bs])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s, %.2f GiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - t0,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def can_run(self, num_reqs: int) -> bool:
        return num_reqs <= self.sizes[-1]

    def run(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            block_table: np.ndarray, seq_lens: np.ndarray,
            pending: tuple[np.ndarray, np.ndarray, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= the batch.

        Args (host numpy, one row per decode request): token ids, positions, slots and
        seq_lens ``[R]``, ``block_table [R, nb]``; ``pending = (rows, src, sampled)``: rows
        whose token id is ``sampled[src]`` on the device (the previous step's output).
        All inputs travel in one pinned host->device copy.
        Returns hidden states ``[R, hidden]`` (a view into the graph's output buffer).
        """
        r = len(token_ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, r)]
        nb = block_table.shape[1]
        k = 0 if pending is None else len(pending[0])
        # ids | positions | slots | seq_lens | block table | pending rows | pending src.
        # Padding rows: no store (slot -1), one key from the null block.
        buf = np.zeros(4 * bs + bs * nb + 2 * k, dtype=np.int64)
        buf[:r] = token_ids
        buf[bs:bs + r] = positions
        buf[2 * bs + r:3 * bs] = -1
        buf[2 * bs:2 * bs + r] = slots
        buf[3 * bs:4 * bs] = 1
        buf[3 * bs:3 * bs + r] = seq_lens
        buf[4 * bs:4 * bs + r * nb] = block_table.ravel()
        if k:
            buf[4 * bs + bs * nb:4 * bs + bs * nb + k] = pending[0]
            buf[4 * bs + bs * nb + k:] = pending[1]
        dev = to_device(buf, self.input_ids.device)
        self.input_ids[:bs].copy_(dev[:bs])
        self.positions[:bs].copy_(dev[bs:2 * bs])
        self.slot_mapping[:bs].copy_(dev[2 * bs:3 * bs])
        self.seq_lens[:bs].copy_(dev[3 * bs:4 * bs])
        self.block_tables[:bs, :nb].copy_(dev[4 * bs:4 * bs + bs * nb].view(bs, nb))
        if k:
            tail = dev[4 * bs + bs * nb:]
            self.input_ids.index_copy_(0, tail[:k], pending[2].index_select(0, tail[k:]))
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:r]


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
        model: the causal LM (``forward(input_ids [T], positions [T]) -> hidden [T, H]``).
        kv_caches: per-layer KV tensors.
        max_num_tokens: the largest step to capture (``max_num_batched_tokens``).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], max_num_tokens: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        dev = kv_caches[0].device
        self.max_num_tokens = max_num_tokens
        self.sizes = piecewise_sizes(max_num_tokens)
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=dev)
        self.bufs: dict[str, torch.Tensor] = {}  # q, k, v, o, hidden: [max_num_tokens, width]
        self.layers: list = []  # Attention modules in call order
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self._pieces: list[torch.cuda.CUDAGraph] | None = None

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
        from kvserve.layers.attention import set_split_hook

        set_split_hook(self._split)
        try:
            with forward_context(None, self.kv_caches):
                out = self.model(self.input_ids[:t], self.positions[:t])
            self._buf("hidden", out)[:t].copy_(out)
        finally:
            set_split_hook(None)

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

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the pieces of the padded size, attention eager in between.

        Args:
            input_ids, positions: ``[T]`` int64 on the device.
            meta: the step's metadata; ``slot_mapping`` must already be padded with -1 to
                ``padded_size(T)`` rows.
        Returns hidden states ``[T, hidden]`` (a view into a static buffer).
        """
        t = input_ids.shape[0]
        tp = self.padded_size(t)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        q, k, v, o = (self.bufs[n][:tp] for n in "qkvo")
        pieces = self.graphs[tp]
        with forward_context(meta, self.kv_caches):
            for graph, layer in zip(pieces, self.layers):
                graph.replay()
                o.copy_(layer.forward(q, k, v))
            pieces[-1].replay()
        return self.bufs["hidden"][:t]
