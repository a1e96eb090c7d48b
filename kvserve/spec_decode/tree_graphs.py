"""CUDA graphs for EAGLE-2 tree drafts (Li et al., arXiv:2406.16858; SGLang's
``speculative_eagle_topk``): one graph per (padded batch size, topk, depth).

A replay runs the whole tree draft of ``kvserve/spec_decode/tree.py`` (``tree_pool``) on the
device: step 0 feeds each request's new pairs exactly as the chain graphs do
(``DraftGraphRunner``: padded to ``1 + num_speculative_tokens`` rows, last real row gathered),
then for each depth ``d = 1 .. depth - 1`` one head forward over the frontier (``topk`` nodes
per request) with the tree attention mask: node ``j`` at rotary position ``tot + d - 1``, its KV
in the head's local slot ``tot + (d - 1) * topk + j`` (slot and block computed on the device from
the static block tables and ``tot``, the request's pairs after step 0), seeing the head's context
and its ancestors' slots through int64 ancestor bits (``tree_start = tot``); the top-k selection
(``torch.topk``) and the parent bookkeeping stay on the device, and so does EAGLE-2's re-ranking
(``tree.pool_ranks``: a stable sort of the cumulative log-probs). The pool's tokens, parents and
ranks ``[R, 3, P]`` come back in one copy; the host only keeps each request's best
``speculative_num_draft_tokens - 1`` nodes (``tree.finish_tree``), as the eager path does.

Padding requests (past the real ones, up to the captured size) store nothing (slot -1) and
read the null block 0. Attention metadata of the tree steps are views of the static buffers;
the host ints are fixed at capture (``max_seq_len = max_model_len + depth * topk``; the Triton
prefill kernel reads lengths from the device). Steps the graphs don't fit run eagerly
(``tree.draft_tree``). On the CPU ``eager=True`` replays the captured Python function over the
same static buffers (tests).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.attention.forward_context import forward_context
from kvserve.spec_decode.draft_graphs import DraftGraphRunner
from kvserve.spec_decode.tree import pool_ranks, tree_pool


class TreeDraftGraphRunner(DraftGraphRunner):
    """``DraftGraphRunner`` whose graphs draft trees of ``proposer.tree_topk`` children per node
    and every depth ``1 .. num_speculative_tokens``; ``run`` returns the candidate pool
    ``[R, 3, P]`` int64 (tokens, parents, ranks; ``P = K + (depth - 1) * K * K``). Arguments as
    ``DraftGraphRunner``."""

    def __init__(self, proposer, max_num_seqs: int, num_speculative_tokens: int, max_model_len: int,
                 feature_size: int, eager: bool = False) -> None:
        super().__init__(proposer, max_num_seqs, num_speculative_tokens, max_model_len, feature_size, eager)
        self.topk = kk = proposer.tree_topk
        n, dev = self.sizes[-1], proposer.device
        self.qsl_tree = torch.arange(0, n * kk + 1, kk, dtype=torch.int32, device=dev)
        self.node = torch.arange(kk, dtype=torch.long, device=dev)
        self.pool_out = torch.zeros((n, 3, kk + (self.max_k - 1) * kk * kk), dtype=torch.long, device=dev)
        self.width: dict[int, int] = {}  # depth -> pool width P (set when the graph is captured)
        self._kind = f" for trees (topk {kk})"

    def _key(self, bs: int, k: int) -> tuple:
        return (bs, self.topk, k)

    def _tree_forward(self, bs: int, d: int, ids: torch.Tensor, hidden: torch.Tensor,
                      bits: torch.Tensor) -> torch.Tensor:
        """Depth ``d``'s head forward over the frontier ``[bs * K]`` (``tree.tree_pool``'s ``forward``)."""
        kk, bsz = ids.shape[0] // bs, self.block_size
        tot32 = self.seq_lens[:bs]  # the request's pairs after step 0 (padding: 1)
        tot = tot32.long()
        local = tot[:, None] + (d - 1) * kk + self.node[:kk]  # [bs, K] head-local slots
        blk = self.block_tables[:bs].gather(1, local // bsz).long()
        slots = torch.where(self.valid[:bs, None], blk * bsz + local % bsz, torch.full_like(local, -1))
        pos = (tot + (d - 1))[:, None].expand(bs, kk).reshape(-1)
        host = None if not self.eager else [s + d * kk for s in self._host[1]]
        length = self.max_model_len + self.max_k * kk
        meta = self.metadata_cls(
            slot_mapping=slots.reshape(-1), block_tables=self.block_tables[:bs],
            query_start_loc=self.qsl_tree[:bs + 1] if kk == self.topk else torch.arange(
                0, bs * kk + 1, kk, dtype=torch.int32, device=ids.device),
            seq_lens=tot32 + d * kk, query_lens_cpu=[kk] * bs, seq_lens_cpu=host or [length] * bs,
            max_query_len=kk, max_seq_len=max(host) if host else length, num_decodes=0)
        meta.tree_mask, meta.tree_start = bits, tot32
        with forward_context([meta]):
            return self.head(ids, pos, hidden.to(self.head.dtype))

    def _steps(self, bs: int, k: int) -> None:
        """Step 0 over ``bs`` padded requests, then a tree of depth ``k``; its pool into ``pool_out``."""
        feats = self._step0(bs)
        tok, score, parent = tree_pool(self.head, feats, self.topk, k,
                                       lambda d, ids, hid, bits: self._tree_forward(bs, d, ids, hid, bits))
        p = tok.shape[1]
        self.width[k] = p
        out = self.pool_out[:bs, :, :p]
        out[:, 0].copy_(tok)
        out[:, 1].copy_(parent)
        out[:, 2].copy_(pool_ranks(score))

    @torch.inference_mode()
    def run(self, block_tables: np.ndarray, ids: np.ndarray, pos: np.ndarray, hidden: torch.Tensor,
            qlens: list[int], seq_lens: list[int], k: int) -> np.ndarray:
        """Replay a tree draft of depth ``k`` (``can_run`` must hold; arguments as
        ``DraftGraphRunner.run``). Returns the pool ``[R, 3, P]`` int64 (host)."""
        self._replay(block_tables, ids, pos, hidden, qlens, seq_lens, k)
        return self.pool_out[:len(qlens), :, :self.width[k]].cpu().numpy()
