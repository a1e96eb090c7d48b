"""EAGLE speculation: a one-layer head over the target's hidden states drafts ``k`` tokens
(EAGLE-1/2, Li et al., arXiv:2401.15077; EAGLE-3, arXiv:2503.01840; chain drafts).

Pair ``p`` of a request is ``(h_p, t_{p+1})``: the target's feature at position ``p`` (the
final-normed hidden state for EAGLE-1/2; three residual-stream states for EAGLE-3) and the
token that follows it. The head keeps one KV entry per pair in its own small paged pool
(like ``draft_model``); its output at the last pair drafts the next token, and each later
draft step feeds ``(head output, drafted token)``.

The model runner hands every step's target hidden states to ``record_hidden_states``
(prefill chunks, verification steps); the proposer keeps the rows not yet fed to the head.
After verification, only the pairs of accepted tokens are fed (rejected rows are dropped,
and the head's KV written by draft steps is overwritten: rollback is free). Positions the
target never computed (prefix-cache hits) are absent from the head's context: it starts at
the first computed position (quality only; verification keeps outputs exact).

Drafts are greedy point proposals, verified losslessly at any temperature (``rejection_sampler``).
On CUDA the ``k`` draft steps of a decode step replay captured graphs (``draft_graphs.py``);
the first draft after a prefill chunk runs eagerly.
With ``speculative_eagle_topk > 1`` the head drafts trees instead (EAGLE-2; ``tree.py``; on CUDA
captured per batch size, topk and depth, ``tree_graphs.py``).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from kvserve.attention.forward_context import forward_context
from kvserve.attention.registry import get_attn_backend
from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import FullAttentionSpec
from kvserve.layers.attention import attention_layers, bind_attention, bind_kv_cache
from kvserve.spec_decode.proposer import Proposer

logger = logging.getLogger("kvserve")

#: The head shipped for the default model (``"model": "default"``), trained by ``train_eagle``.
DEFAULT_EAGLE_HEAD = os.path.join(os.path.dirname(__file__), "data", "eagle-smollm2-135m")


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 head reads: low, mid, high
    (``(2, L // 2, L - 3)``, the published recipe's choice)."""
    return (2, num_layers // 2, num_layers - 3)


class _EagleState:
    __slots__ = ("blocks", "base", "n", "pend_start", "pend")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.base = -1  # target position of the head's first pair (-1: not started)
        self.n = 0  # pairs whose KV the head holds (local indices 0..n-1)
        self.pend_start = 0  # target position of pend[0]
        self.pend: torch.Tensor | None = None  # target features not fed yet [m, D]


class EagleProposer(Proposer):
    """``{"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens": k}``.

    ``HEAD_DIR`` holds a published EAGLE head (``kvserve.models.llama_eagle``). Extra keys:
    ``eagle_num_blocks`` (KV blocks of the head's pool; default: ``min(max_num_seqs, 32)``
    requests of ``max_model_len`` tokens; a request that finds no room gets no drafts) and,
    for EAGLE-1/2, ``draft_vocab_size`` (draft among token ids below it; default: the head's
    ``config.json`` value, else the whole vocabulary). ``speculative_eagle_topk`` /
    ``speculative_num_draft_tokens`` (config fields): tree drafts (``kvserve/spec_decode/tree.py``).

    Raises ValueError at start-up for a head whose hidden / vocab size differ from the target's,
    an EAGLE-1 checkpoint given as eagle3 (or the reverse), tensor parallelism, or eagle3 on a
    non-Llama target.
    """

    uses_hidden_states = True
    supports_tree_drafts = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        sc = config.speculative_config
        if config.parallel_config.world_size > 1:
            raise ValueError("EAGLE speculation runs with one worker (tensor_parallel_size 1) for now")
        self.eagle3 = sc.method == "eagle3"
        self.device = torch.device(config.device)
        self.block_size = config.cache_config.block_size
        self.head_path = sc.draft_model_path or sc.model
        self.head = None  # built in bind_target (needs the target's embedding / lm_head)
        sched = config.scheduler_config
        self.tree_topk = sc.speculative_eagle_topk  # > 1: tree drafts (kvserve/spec_decode/tree.py)
        self.trees: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (tokens, parents)
        per_req = -(-(sched.max_model_len + self.num_speculative_tokens * self.tree_topk) // self.block_size)
        self.num_blocks = int(sc.extra.get("eagle_num_blocks", per_req * min(sched.max_num_seqs, 32) + 1))
        self.max_blocks = per_req + 1
        self.free_blocks = list(range(self.num_blocks - 1, 0, -1))  # block 0: padding reads it
        self.states: dict[str, _EagleState] = {}
        self.aux_layers: tuple[int, ...] = ()
        self.feature_size = 0  # width of the target features the head reads (bind_target)
        self.draft_graphs = None  # DraftGraphRunner (capture_cuda_graphs)
        self._idle = True  # speculation off and every state reset: a k = 0 propose has nothing to do

    # ---- set-up ---------------------------------------------------------------------------
    @property
    def needs_eager_target(self) -> bool:
        """False: the target's decode / verify graphs copy EAGLE-3's mid-layer states into
        static buffers (``kvserve.worker.cuda_graphs.AuxHiddenStates``), so it runs graphed."""
        return False

    def bind_target(self, target) -> None:
        """Load the head for ``target`` (sharing its embedding, and for EAGLE-1/2 its lm_head),
        give it its backend and KV pool, and for EAGLE-3 make the target keep its aux states."""
        from kvserve.models.llama_eagle import load_eagle_head
        from kvserve.worker.model_runner import torch_dtype

        mc = self.config.model_config
        dtype = torch_dtype(mc.dtype)
        hf = getattr(target, "config", None) or mc.hf_config
        self.head = load_eagle_head(self.head_path, hf, dtype, self.device, self.eagle3,
                                    self.config.scheduler_config.max_model_len)
        self.head.share_target(target)
        if not self.eagle3:
            self.head.limit_draft_vocab(self.config.speculative_config.extra.get(
                "draft_vocab_size", getattr(self.head.config, "draft_vocab_size", None)))
        self.target = target
        self.feature_size = hf.hidden_size * (3 if self.eagle3 else 1)
        if self.eagle3:
            from kvserve.models.llama import LlamaModel

            if not isinstance(getattr(target, "model", None), LlamaModel):
                raise ValueError(f"eagle3 needs a Llama-family target (it reads mid-layer states), got "
                                 f"{type(target).__name__}")
            self.aux_layers = tuple(getattr(self.head.config, "eagle_aux_hidden_state_layer_ids", None)
                                    or eagle3_layers(hf.num_hidden_layers))
            target.model.aux_hidden_state_layers = self.aux_layers
        backend = self.head_backend = get_attn_backend(self.config.attention_backend)
        bind_attention(self.head, backend)
        layer = attention_layers(self.head)[0]
        spec = FullAttentionSpec(self.block_size, layer.num_kv_heads, layer.head_size,
                                 self.config.cache_config.kv_cache_dtype, mc.dtype)
        bind_kv_cache(self.head, {0: backend.allocate_kv_cache(spec, self.num_blocks, self.device)}, specs={0: spec})
        logger.info("EAGLE%s head %s: %d KV blocks of %d tokens", "-3" if self.eagle3 else "", self.head_path,
                    self.num_blocks, self.block_size)

    def capture_cuda_graphs(self, eager: bool = False) -> None:
        """Capture the head's ``k`` draft steps per batch size (``draft_graphs.py``; tree drafts:
        per batch size, topk and depth, ``tree_graphs.py``); ``eager``:
        the CPU stand-in that runs the same static-buffer path without CUDA (tests)."""
        from kvserve.spec_decode.draft_graphs import DraftGraphRunner
        from kvserve.spec_decode.tree_graphs import TreeDraftGraphRunner

        sc = self.config.scheduler_config
        runner = TreeDraftGraphRunner if self.tree_topk > 1 else DraftGraphRunner
        self.draft_graphs = runner(self, sc.max_num_seqs, self.num_speculative_tokens, sc.max_model_len,
                                             self.feature_size, eager=eager)
        self.draft_graphs.capture()

    def release_cuda_graphs(self) -> None:
        if self.draft_graphs is not None:
            self.draft_graphs.release()
            self.draft_graphs = None

    def _graph_ready(self, rows) -> bool:
        """Whether these rows may draft through the graphs (a hook: MTP's first pair)."""
        return True

    # ---- bookkeeping ----------------------------------------------------------------------
    def remove_requests(self, req_ids) -> None:
        for r in req_ids:
            st = self.states.pop(r, None)
            self.trees.pop(r, None)
            if st is not None:
                self.free_blocks.extend(st.blocks)

    def _ensure_blocks(self, st: _EagleState, num: int) -> bool:
        need = -(-num // self.block_size) - len(st.blocks)
        if need <= 0:
            return True
        if need > len(self.free_blocks) or len(st.blocks) + need > self.max_blocks:
            return False
        st.blocks.extend(self.free_blocks.pop() for _ in range(need))
        return True

    def _reset(self, st: _EagleState) -> None:
        self.free_blocks.extend(st.blocks)
        st.blocks, st.base, st.n = [], -1, 0

    def _drop_backlog(self, st: _EagleState) -> None:
        """Forget unfed features but the newest (a later ``propose`` restarts the head there)."""
        if st.pend is not None and len(st.pend) > 1:
            st.pend_start += len(st.pend) - 1
            st.pend = st.pend[-1:].clone()

    @torch.no_grad()
    def record_hidden_states(self, req_ids: list[str], starts, query_lens, hidden: torch.Tensor,
                             row_start) -> None:
        """Keep this step's target features: request ``req_ids[i]`` computed positions
        ``starts[i] .. starts[i] + query_lens[i] - 1`` in rows ``row_start[i] ..`` of ``hidden``
        ``[T, hidden]`` (EAGLE-3: the target's ``aux_hidden_states`` rows, concatenated).
        Nothing is kept while speculation is off (``k == 0``): the head restarts when it resumes."""
        if self.k <= 0:
            return
        self._idle = False
        if self.eagle3:
            aux = self.target.model.aux_hidden_states
            hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        for rid, s, q, r0 in zip(req_ids, starts, query_lens, row_start):
            s, q, r0 = int(s), int(q), int(r0)
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = _EagleState()
            rows = hidden[r0:r0 + q].clone()
            if st.pend is not None and st.pend_start <= s <= st.pend_start + len(st.pend):
                st.pend = torch.cat([st.pend[:s - st.pend_start], rows])
            else:
                st.pend, st.pend_start = rows, s

    # ---- proposing ------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return self.k <= 0 and self._idle  # off, and every state already reset

    @torch.inference_mode()
    def propose(self, requests: list, batch) -> list[list[int]]:
        k = self.k
        out: list[list[int]] = [[] for _ in requests]
        if k <= 0:  # speculation off: nothing is recorded now, so the head restarts when it resumes;
            if not self._idle:  # its KV blocks go back to the pool meanwhile (once: then idle)
                for st in self.states.values():
                    self._reset(st)
                    st.pend = None
                self._idle = True
            return out
        rows = []  # (index, state, tokens, first pair to feed, pairs after feeding)
        for i, req in enumerate(requests):
            toks = batch.token_ids[req.row, : batch.num_tokens[req.row]]
            st = self.states.get(req.req_id)
            if st is None or st.pend is None:
                continue
            last = len(toks) - 2  # the last pair's position: (h_{N-2}, t_{N-1})
            if st.base < 0 or st.pend_start > st.base + st.n or st.base + st.n > last + 1:
                self._reset(st)  # a gap (prefix hit after preemption) or a rewind: start over
                st.base = st.pend_start
            first = st.base + st.n
            if st.pend_start + len(st.pend) <= last or first > last:
                continue  # features missing (or nothing new): no drafts this step
            total = last + 1 - st.base
            if not self._ensure_blocks(st, total + (k - 1) * self.tree_topk):
                self._drop_backlog(st)  # no room in the head's pool: no drafts this step
                continue
            rows.append((i, st, toks, first, total))
        if not rows:
            return out
        rows.sort(key=lambda r: r[4] - r[1].n != 1)  # decodes (one new pair) first
        ids = np.concatenate([t[f + 1:f + 1 + tot - st.n] for _, st, t, f, tot in rows])
        pos = np.concatenate([np.arange(st.n, tot) for _, st, _, _, tot in rows])
        hid = torch.cat([st.pend[f - st.pend_start:f - st.pend_start + tot - st.n] for _, st, _, f, tot in rows])
        qlens = [tot - st.n for _, st, _, _, tot in rows]
        seq = [tot for *_, tot in rows]
        if self.tree_topk > 1:  # EAGLE-2 tree drafts (kvserve/spec_decode/tree.py)
            from kvserve.spec_decode.tree import finish_tree

            return finish_tree(self, requests, rows, self._draft_tree(rows, ids, pos, hid, qlens, seq, k), out)
        d = self._draft(rows, ids, pos, hid, qlens, seq, k)
        for r, (i, st, toks, f, tot) in enumerate(rows):
            out[i] = d[r].tolist()
            st.n = tot
            keep = st.base + tot - st.pend_start  # drop fed features; keep any computed beyond
            st.pend, st.pend_start = st.pend[keep:], st.base + tot
        return out

    def _draft(self, rows, ids: np.ndarray, pos: np.ndarray, hid: torch.Tensor, qlens: list[int],
               seq: list[int], k: int) -> np.ndarray:
        """``k`` greedy drafts ``[R, k]`` for ``rows`` after feeding their new pairs (``ids``,
        local ``pos``, features ``hid``; ``qlens`` per row, ``seq``: pairs after feeding):
        through the draft CUDA graphs when they fit, else eagerly."""
        g = self.draft_graphs
        if g is not None and g.can_run(len(rows), qlens, k) and self._graph_ready(rows):
            return g.run(self._block_tables(rows), ids, pos, hid, qlens, seq, k)
        return self._draft_eager(rows, ids, pos, hid, qlens, seq, k)

    def _draft_tree(self, rows, ids: np.ndarray, pos: np.ndarray, hid: torch.Tensor, qlens: list[int],
                    seq: list[int], k: int) -> np.ndarray:
        """A tree of depth ``k`` per row (arguments as ``_draft``): the candidate pool ``[R, 3, P]``
        (tokens, parents, ranks; ``tree.finish_tree``), through the tree CUDA graphs when they fit."""
        g = self.draft_graphs
        if g is not None and g.can_run(len(rows), qlens, k) and self._graph_ready(rows):
            return g.run(self._block_tables(rows), ids, pos, hid, qlens, seq, k)
        return self._draft_tree_eager(rows, ids, pos, hid, qlens, seq, k)

    def _draft_tree_eager(self, rows, ids: np.ndarray, pos: np.ndarray, hid: torch.Tensor, qlens: list[int],
                          seq: list[int], k: int) -> np.ndarray:
        from kvserve.spec_decode.tree import draft_tree

        feats = self._forward(rows, ids, pos, hid, qlens, seq)
        return draft_tree(self, rows, feats[torch.from_numpy(np.cumsum(qlens) - 1).to(self.device)], k)

    def _draft_eager(self, rows, ids: np.ndarray, pos: np.ndarray, hid: torch.Tensor, qlens: list[int],
                     seq: list[int], k: int) -> np.ndarray:
        feats = self._forward(rows, ids, pos, hid, qlens, seq)
        last_rows = torch.from_numpy(np.cumsum(qlens) - 1).to(self.device)
        feats = feats[last_rows]
        tok = self.head.greedy_tokens(feats)
        drafts = [tok]
        for j in range(1, k):
            seq_j = [s + j for s in seq]
            p = np.asarray(seq_j, dtype=np.int64) - 1
            feats = self._forward(rows, drafts[-1], p, feats, [1] * len(rows), seq_j)
            drafts.append(self.head.greedy_tokens(feats))
        return torch.stack(drafts, dim=1).cpu().numpy()

    def _block_tables(self, rows) -> np.ndarray:
        bt = np.zeros((len(rows), self.max_blocks), dtype=np.int32)
        for r, (_, st, *_rest) in enumerate(rows):
            bt[r, : len(st.blocks)] = st.blocks
        return bt

    def draft_tree(self, req_id: str, drafts: list[int]) -> list[int] | None:
        t = self.trees.get(req_id)
        if t is None or self.tree_topk == 1:
            return None
        if list(t[0][:len(drafts)]) != list(drafts):
            raise RuntimeError(f"{req_id}: scheduled drafts are not the proposed tree's")
        return t[1][:len(drafts)]

    def tree_accepted(self, req_id: str, root_pos: int, rows: list[int]) -> None:
        st = self.states.get(req_id)
        if st is None or st.pend is None:
            return
        i0 = root_pos - st.pend_start
        if i0 < 0 or i0 + max(rows) >= len(st.pend):
            return
        keep = torch.as_tensor([i0 + r for r in rows], device=st.pend.device)
        st.pend = torch.cat([st.pend[:i0], st.pend.index_select(0, keep)])

    def _forward(self, rows, ids, pos: np.ndarray, hidden: torch.Tensor, qlens: list[int],
                 seq_lens: list[int]) -> torch.Tensor:
        """One head forward over ``rows`` (local positions ``pos``); returns features ``[T, hidden]``."""
        dev, bs, R = self.device, self.block_size, len(rows)
        bt = self._block_tables(rows)
        q = np.asarray(qlens, dtype=np.int64)
        qsl = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        slots = bt[np.repeat(np.arange(R), q), pos // bs].astype(np.int64) * bs + pos % bs
        meta = self.head_backend.metadata_builder_cls.metadata_cls(  # the backend's own metadata class
            slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(bt).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), query_lens_cpu=list(qlens),
            seq_lens_cpu=list(seq_lens), max_query_len=int(q.max()), max_seq_len=max(seq_lens),
            num_decodes=int(np.count_nonzero(q == 1)))
        with forward_context([meta]):
            return self.head(torch.as_tensor(ids, dtype=torch.long, device=dev),
                             torch.as_tensor(pos, dtype=torch.long, device=dev), hidden.to(self.head.dtype))
