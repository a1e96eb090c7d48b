"""CUDA graphs for the draft steps of an EAGLE-style head (EAGLE / EAGLE-3 / DeepSeek MTP).

The head's ``k`` draft steps run as one captured graph per (padded batch size, ``k``), the
way vLLM / SGLang capture their EAGLE draft loops:

- step 0 feeds each request's new pairs (``1 + accepted`` of them after a verify step) with
  every request padded to ``Q = 1 + num_speculative_tokens`` query rows (request ``i``'s
  ``j``-th pair at row ``i * Q + j``; padding rows store nothing, slot -1, and come after the
  real ones, so causal attention keeps them out), then gathers each request's last real row;
- steps ``1 .. k - 1`` are decodes (one row per request) fed the previous step's token and
  feature; their positions, slots (``block_table[p // B] * B + p % B``) and sequence lengths
  are computed on the device from static buffers, so the whole loop replays without the host;
- the drafted ids land in a static ``[N, K]`` buffer, read back once.

The inputs (token ids, positions, target features, slot mapping, block tables, lengths, last
rows) live in static buffers; a replay packs the host values into one host-to-device copy.
Attention metadata are views of those buffers, with the host ints the Triton kernels need fixed
at capture (``max_seq_len = max_model_len``, as the target's decode graphs do; each request
still reads only its own keys).

On the CPU the same code runs with ``eager=True``: a "graph" is the captured Python function,
called again at replay over the same static buffers, with the true host lengths (the CPU
backends read them), so padding, slicing and the device-side slot arithmetic are tested
without CUDA against the dynamic path.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from kvserve.attention.forward_context import forward_context, to_device
from kvserve.worker.cuda_graphs import capture_sizes

logger = logging.getLogger("kvserve")


class _EagerGraph:
    """The CPU stand-in of a captured graph: replay calls the captured function again."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()

    def reset(self) -> None:
        self.fn = None


class DraftGraphRunner:
    """Static buffers, capture and replay of ``k`` draft steps of ``proposer.head``.

    Args:
        proposer: a bound ``EagleProposer`` (its ``head``, ``head_backend``, ``block_size``,
            ``max_blocks``, ``device``).
        max_num_seqs: largest batch of drafting requests to capture.
        num_speculative_tokens: ``K``; graphs for every ``k`` in ``1..K``.
        max_model_len: the ``max_seq_len`` the graphs are captured with.
        feature_size: width of the target features step 0 reads (EAGLE-3: ``3 * hidden``).
        eager: run the "graphs" as Python functions (the CPU path; tests).
    """

    def __init__(self, proposer, max_num_seqs: int, num_speculative_tokens: int, max_model_len: int,
                 feature_size: int, eager: bool = False) -> None:
        self.proposer = proposer
        self.head = proposer.head
        self.metadata_cls = proposer.head_backend.metadata_builder_cls.metadata_cls
        self.block_size = proposer.block_size
        self.eager = eager
        self.max_k = num_speculative_tokens
        self.q = num_speculative_tokens + 1
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        n, w, dev = self.sizes[-1], proposer.max_blocks, proposer.device
        t = n * self.q
        self.input_ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.positions = torch.zeros(t, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.long, device=dev)
        self.hidden = torch.zeros((t, feature_size), dtype=self.head.dtype, device=dev)
        self.block_tables = torch.zeros((n, w), dtype=torch.int32, device=dev)
        self.seq_lens_pad = torch.full((n,), self.q, dtype=torch.int32, device=dev)  # step 0: n_prev + Q
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)  # pairs after step 0
        self.last_rows = torch.zeros(n, dtype=torch.long, device=dev)
        self.valid = torch.zeros(n, dtype=torch.bool, device=dev)
        self.qsl_pad = torch.arange(0, t + 1, self.q, dtype=torch.int32, device=dev)
        self.qsl_one = torch.arange(0, n + 1, dtype=torch.int32, device=dev)
        self.drafts = torch.zeros((n, self.max_k), dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], object] = {}
        self.pool = None
        self._host: tuple[list[int], list[int]] | None = None  # eager: this replay's true lengths
        self._kind = ""  # for the log line

    # ---- the captured function -------------------------------------------------------------
    def _meta(self, bs: int, q: int, slots: torch.Tensor, qsl: torch.Tensor, seq: torch.Tensor,
              seq_cpu: list[int] | None):
        length = self.max_model_len
        return self.metadata_cls(
            slot_mapping=slots, block_tables=self.block_tables[:bs], query_start_loc=qsl, seq_lens=seq,
            query_lens_cpu=[q] * bs, seq_lens_cpu=seq_cpu if seq_cpu is not None else [length] * bs,
            max_query_len=q, max_seq_len=max(seq_cpu) if seq_cpu is not None else length,
            num_decodes=bs if q == 1 else 0)

    def _step0(self, bs: int) -> torch.Tensor:
        """Step 0 over ``bs`` padded requests: the head's features ``[bs, hidden]`` at each
        request's last real row."""
        q, t = self.q, bs * self.q
        host = self._host if self.eager else None
        meta = self._meta(bs, q, self.slot_mapping[:t], self.qsl_pad[:bs + 1], self.seq_lens_pad[:bs],
                          None if host is None else host[0])
        with forward_context([meta]):
            feats = self.head(self.input_ids[:t], self.positions[:t], self.hidden[:t])
        return feats.index_select(0, self.last_rows[:bs])

    def _steps(self, bs: int, k: int) -> None:
        """Step 0 over ``bs`` padded requests, then ``k - 1`` decode steps; drafts into ``self.drafts``."""
        bsz = self.block_size
        host = self._host if self.eager else None
        seq0 = self.seq_lens[:bs]
        feats = self._step0(bs)
        tok = self.head.greedy_tokens(feats)
        self.drafts[:bs, 0].copy_(tok)
        tables = self.block_tables[:bs]
        for j in range(1, k):
            pos = seq0.long() + (j - 1)  # the pair (feature of the previous step, its token)
            blk = tables.gather(1, (pos // bsz)[:, None]).squeeze(1).long()
            slots = torch.where(self.valid[:bs], blk * bsz + pos % bsz, torch.full_like(pos, -1))
            meta = self._meta(bs, 1, slots, self.qsl_one[:bs + 1], seq0 + j,
                              None if host is None else [s + j for s in host[1]])
            with forward_context([meta]):
                feats = self.head(tok, pos, feats)
            tok = self.head.greedy_tokens(feats)
            self.drafts[:bs, j].copy_(tok)

    # ---- capture / replay -----------------------------------------------------------------
    def _key(self, bs: int, k: int) -> tuple:
        """The graph of ``bs`` padded requests drafting ``k`` steps."""
        return (bs, k)

    @torch.inference_mode()
    def capture(self) -> None:
        """A graph per (size, k), largest first, sharing one memory pool (CUDA), or the
        eager stand-ins (``eager``)."""
        t0 = time.perf_counter()
        if self.eager:
            for k in range(1, self.max_k + 1):
                for bs in self.sizes:
                    self.graphs[self._key(bs, k)] = _EagerGraph(lambda bs=bs, k=k: self._steps(bs, k))
            return
        free_before = torch.cuda.mem_get_info()[0]
        for k in range(self.max_k, 0, -1):
            for bs in reversed(self.sizes):
                self._steps(bs, k)  # warm-up: compiles kernels, cuBLAS workspaces
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._steps(bs, k)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[self._key(bs, k)] = graph
        torch.cuda.synchronize()
        logger.info("captured %d draft CUDA graphs%s (batch sizes %d..%d, k 1..%d) in %.1f s, %.2f GiB",
                    len(self.graphs), self._kind, self.sizes[0], self.sizes[-1], self.max_k, time.perf_counter() - t0,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def release(self) -> None:
        """Reset every graph (their pool goes back at once)."""
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()

    def can_run(self, num_reqs: int, qlens: list[int], k: int) -> bool:
        """Whether a step of ``num_reqs`` requests feeding ``qlens`` pairs each and drafting
        ``k`` fits the captured graphs (else the proposer drafts eagerly: prefill chunks)."""
        return 0 < num_reqs <= self.sizes[-1] and 1 <= k <= self.max_k and max(qlens) <= self.q

    @torch.inference_mode()
    def run(self, block_tables: np.ndarray, ids: np.ndarray, pos: np.ndarray, hidden: torch.Tensor,
            qlens: list[int], seq_lens: list[int], k: int) -> np.ndarray:
        """Replay ``k`` draft steps (``can_run`` must hold).

        Args:
            block_tables: ``[R, W]`` the requests' head block tables.
            ids / pos: ``[sum(qlens)]`` int64 the pairs' tokens and local positions.
            hidden: ``[sum(qlens), feature_size]`` their target features (device).
            qlens: new pairs per request; seq_lens: pairs after feeding them.
            k: drafts per request.
        Returns the drafts ``[R, k]`` int64 (host).
        """
        self._replay(block_tables, ids, pos, hidden, qlens, seq_lens, k)
        return self.drafts[:len(qlens), :k].cpu().numpy()

    def _replay(self, block_tables: np.ndarray, ids: np.ndarray, pos: np.ndarray, hidden: torch.Tensor,
                qlens: list[int], seq_lens: list[int], k: int) -> None:
        """Pack the inputs into the static buffers (one host-to-device copy) and replay."""
        r, q, bsz = len(qlens), self.q, self.block_size
        bs = self.sizes[bisect.bisect_left(self.sizes, r)]
        t = bs * q
        ql = np.asarray(qlens, dtype=np.int64)
        seq = np.asarray(seq_lens, dtype=np.int64)
        req = np.repeat(np.arange(r), ql)
        starts = np.concatenate([[0], np.cumsum(ql)[:-1]])
        dst = req * q + np.arange(len(req)) - starts[req]
        slots = np.full(t, -1, dtype=np.int64)
        slots[dst] = block_tables[req, pos // bsz].astype(np.int64) * bsz + pos % bsz
        ids_h, pos_h = np.zeros(t, dtype=np.int64), np.zeros(t, dtype=np.int64)
        ids_h[dst], pos_h[dst] = ids, pos
        w = block_tables.shape[1]
        tables = np.zeros((bs, w), dtype=np.int64)  # padding rows read the null block 0
        tables[:r] = block_tables
        seq_pad = np.full(bs, q, dtype=np.int64)
        seq_pad[:r] = seq - ql + q
        seq_tot = np.ones(bs, dtype=np.int64)
        seq_tot[:r] = seq
        last = np.arange(bs, dtype=np.int64) * q
        last[:r] += ql - 1
        valid = np.zeros(bs, dtype=np.int64)
        valid[:r] = 1
        pairs = [(self.input_ids[:t], ids_h), (self.positions[:t], pos_h), (self.slot_mapping[:t], slots),
                 (self.block_tables[:bs, :w], tables), (self.seq_lens_pad[:bs], seq_pad),
                 (self.seq_lens[:bs], seq_tot), (self.last_rows[:bs], last), (self.valid[:bs], valid),
                 (None, dst)]
        offs = np.concatenate([[0], np.cumsum([v.size for _, v in pairs])])
        buf = np.empty(int(offs[-1]), dtype=np.int64)
        for (_, v), o in zip(pairs, offs):
            buf[o:o + v.size] = v.ravel()
        dev = to_device(buf, self.input_ids.device)
        for (static, v), o in zip(pairs[:-1], offs):
            static.copy_(dev[o:o + v.size].view(static.shape))
        self.hidden.index_copy_(0, dev[offs[-2]:offs[-1]], hidden.to(self.hidden.dtype))
        if self.eager:
            self._host = (seq_pad.tolist(), seq_tot.tolist())
        self.graphs[self._key(bs, k)].replay()
