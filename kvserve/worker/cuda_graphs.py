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
            block_table: np.ndarray, seq_lens: np.ndarray) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= the batch.

        Args (host numpy, one row per decode request): token ids, positions and slots
        ``[R]`` int64, ``block_table [R, nb]`` int32, ``seq_lens [R]`` int32.
        Returns hidden states ``[R, hidden]`` (a view into the graph's output buffer).
        """
        r = len(token_ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, r)]
        nb = block_table.shape[1]
        # Padding rows: no store (slot -1), one key from the null block.
        ids = np.zeros(bs, dtype=np.int64)
        ids[:r] = token_ids
        pos = np.zeros(bs, dtype=np.int64)
        pos[:r] = positions
        sl = np.full(bs, -1, dtype=np.int64)
        sl[:r] = slots
        lens = np.ones(bs, dtype=np.int32)
        lens[:r] = seq_lens
        bt = np.zeros((bs, nb), dtype=np.int32)
        bt[:r] = block_table
        self.input_ids[:bs].copy_(torch.from_numpy(ids), non_blocking=True)
        self.positions[:bs].copy_(torch.from_numpy(pos), non_blocking=True)
        self.slot_mapping[:bs].copy_(torch.from_numpy(sl), non_blocking=True)
        self.seq_lens[:bs].copy_(torch.from_numpy(lens), non_blocking=True)
        self.block_tables[:bs, :nb].copy_(torch.from_numpy(bt), non_blocking=True)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:r]
