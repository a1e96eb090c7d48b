"""Draft-model speculation: a smaller model with the target's vocabulary proposes ``k`` tokens
greedily (Leviathan et al., arXiv:2211.17192; Chen et al., arXiv:2302.01318).

The draft runs in the worker's process beside the target with its own paged KV cache and
its own attention backend instance (per-layer binding keeps the two models' caches apart).
Its blocks come from a private pool; per request it remembers which tokens its cache holds,
so after verification only the part that changed is recomputed: the longest common prefix
of the tokens it cached and the request's tokens stays, everything after is overwritten
(rejected drafts roll back for free). Each ``propose`` runs one batched catch-up pass (the new
prompt of a fresh request, or the accepted drafts + the verified token), then ``k - 1``
batched one-token steps.

Drafts are point proposals (greedy), verified losslessly at any temperature
(``rejection_sampler``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from kvserve.attention.forward_context import forward_context
from kvserve.attention.registry import get_attn_backend
from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import FullAttentionSpec
from kvserve.layers.attention import attention_layers, bind_attention, bind_kv_cache
from kvserve.spec_decode.proposer import Proposer

logger = logging.getLogger("kvserve")


class _DraftState:
    __slots__ = ("blocks", "tokens")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.tokens = np.zeros(0, dtype=np.int64)  # tokens whose KV the draft cache holds


class DraftModelProposer(Proposer):
    """``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``.

    Extra keys: ``draft_num_blocks`` (KV blocks of the draft's pool; default: enough for
    ``min(max_num_seqs, 16)`` requests of 512 tokens, capped by ``max_model_len``). A request
    that finds no room in the pool gets no drafts (it still decodes).

    Raises ValueError (at start-up) if the draft's vocabulary differs from the target's.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        sc = config.speculative_config
        self.device = torch.device(config.device)
        self.block_size = config.cache_config.block_size
        mc = config.model_config
        dcfg = replace(mc, model=sc.draft_model_path, load_format=sc.draft_load_format,
                       hf_config=sc.draft_hf_config, tokenizer=None)
        self.model = self._load(dcfg)
        self.backend = get_attn_backend(config.attention_backend)
        bind_attention(self.model, self.backend)
        layers = attention_layers(self.model)
        sched = config.scheduler_config
        per_req = -(-min(sched.max_model_len, 512 + self.num_speculative_tokens) // self.block_size)
        n = int(sc.extra.get("draft_num_blocks", per_req * min(sched.max_num_seqs, 16) + 1))
        kv_dtype = config.cache_config.kv_cache_dtype
        caches, specs = {}, {}
        for layer in layers:
            spec = specs[layer.layer_idx] = FullAttentionSpec(self.block_size, layer.num_kv_heads, layer.head_size,
                                                              kv_dtype, mc.dtype)
            caches[layer.layer_idx] = self.backend.allocate_kv_cache(spec, n, self.device)
        bind_kv_cache(self.model, caches, specs=specs)
        self.max_blocks = -(-sched.max_model_len // self.block_size) + 1
        self.free_blocks = list(range(n - 1, 0, -1))  # block 0 stays unused (padding reads it)
        self.states: dict[str, _DraftState] = {}
        logger.info("draft model %s: %d KV blocks of %d tokens", sc.draft_model_path, n, self.block_size)

    def _load(self, dcfg):
        from kvserve.model_loader import get_model

        torch.manual_seed(dcfg.seed)
        return get_model(dcfg, str(self.device))

    # ---- blocks ---------------------------------------------------------------------------
    def remove_requests(self, req_ids) -> None:
        for r in req_ids:
            st = self.states.pop(r, None)
            if st is not None:
                self.free_blocks.extend(st.blocks)

    def _ensure_blocks(self, st: _DraftState, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(st.blocks)
        if need <= 0:
            return True
        if need > len(self.free_blocks):
            return False
        st.blocks.extend(self.free_blocks.pop() for _ in range(need))
        return True

    # ---- proposing ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list, batch) -> list[list[int]]:
        k = self.k
        if k <= 0:
            return [[] for _ in requests]
        rows = []  # (index in requests, state, tokens, start)
        for i, req in enumerate(requests):
            toks = batch.token_ids[req.row, : batch.num_tokens[req.row]]
            st = self.states.get(req.req_id)
            if st is None:
                st = self.states[req.req_id] = _DraftState()
            m = min(len(st.tokens), len(toks) - 1)  # keep at least the last token to feed
            diff = np.flatnonzero(st.tokens[:m] != toks[:m])
            start = int(diff[0]) if len(diff) else m
            if not self._ensure_blocks(st, len(toks) + k - 1):
                st.tokens = st.tokens[:start]
                continue  # no room in the draft pool: no drafts for this request this step
            st.tokens = toks.copy()
            rows.append((i, st, toks, start))
        out: list[list[int]] = [[] for _ in requests]
        if not rows:
            return out
        # Catch-up pass: decodes (one new token) first, as backends expect.
        rows.sort(key=lambda r: len(r[2]) - r[3] != 1)
        qlens = [len(t) - s for _, _, t, s in rows]
        seq_lens = [len(t) for _, _, t, _ in rows]
        ids = np.concatenate([t[s:] for _, _, t, s in rows])
        pos = np.concatenate([np.arange(s, len(t)) for _, _, t, s in rows])
        nxt = self._forward(rows, ids, pos, qlens, seq_lens)
        drafts = [nxt]
        for j in range(1, k):
            seq_lens = [len(t) + j for _, _, t, _ in rows]
            p = np.asarray(seq_lens, dtype=np.int64) - 1
            nxt = self._forward(rows, drafts[-1], p, [1] * len(rows), seq_lens)
            drafts.append(nxt)
        d = np.stack(drafts, axis=1)  # [R, k]
        for r, (i, st, toks, _) in enumerate(rows):
            out[i] = d[r].tolist()
            st.tokens = np.concatenate([toks, d[r, : k - 1]])  # the cache also holds fed drafts
        return out

    def _forward(self, rows, ids: np.ndarray, pos: np.ndarray, qlens: list[int], seq_lens: list[int]) -> np.ndarray:
        """One draft forward over ``rows``; returns each row's greedy next token (int64 ``[R]``)."""
        dev = self.device
        bs = self.block_size
        R = len(rows)
        bt = np.zeros((R, self.max_blocks), dtype=np.int32)
        for r, (_, st, _, _) in enumerate(rows):
            bt[r, : len(st.blocks)] = st.blocks
        q = np.asarray(qlens, dtype=np.int64)
        qsl = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        req_idx = np.repeat(np.arange(R), q)
        slots = bt[req_idx, pos // bs].astype(np.int64) * bs + pos % bs
        meta = self.backend.metadata_builder_cls.metadata_cls(  # the backend's own metadata class
            slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(bt).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), query_lens_cpu=list(qlens),
            seq_lens_cpu=list(seq_lens), max_query_len=int(q.max()), max_seq_len=max(seq_lens),
            num_decodes=int(np.count_nonzero(q == 1)))  # rows are ordered decodes first
        with forward_context([meta]):
            hidden = self.model(torch.as_tensor(ids, dtype=torch.long, device=dev),
                                torch.as_tensor(pos, dtype=torch.long, device=dev))
        last = torch.from_numpy(qsl[1:] - 1).to(dev)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1).cpu().numpy()
