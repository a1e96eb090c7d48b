"""Tree drafts, verified in one target pass (EAGLE-2, Li et al., arXiv:2406.16858; SpecInfer,
Miao et al., arXiv:2305.09781; SGLang's ``speculative_eagle_topk`` / ``speculative_num_draft_tokens``).

A tree of ``N`` drafted nodes travels through the scheduler as a flat draft list in topological
order (every node after its parent), with the parent indices kept by the proposer
(``Proposer.draft_tree``). Any prefix of that list is again a tree, so the scheduler may cut it
like a chain. The verify chunk is the root (the request's last token) plus the nodes: chunk row
``r`` (node ``r - 1``) is stored at sequence index ``ctx + r`` but rotated at position
``ctx + depth(r)``, and attends to the cached prefix plus its own ancestors only: a bit-packed
ancestor mask per row (``AttentionMetadata.tree_mask``, read by the Triton prefill kernel and the
torch reference). Trees hold at most 64 rows (the root included).

Acceptance: each row ``r`` is sampled by the ordinary sampler as if the path to ``r`` were
accepted; the walk starts at the root, follows the child whose token equals the sample at the
current node, and emits the sample where no child matches. For point proposals (a node's
children are distinct tokens) this *is* SpecInfer's multi-candidate rejection: trying the
children in order, child ``x_1`` is accepted with probability ``p(x_1)``, child ``x_2`` with
``(1 - p(x_1)) * p(x_2) / (1 - p(x_1)) = p(x_2)`` from the residual, ..., and a rejection of all
samples the residual ``p`` without the children, so every emitted token has the target's
distribution (greedy: the longest path of target argmaxes). Seeded requests sample the rows at
depth ``d`` with their generator advanced ``d`` draws, as the ``d``-th token without speculation
would be, so they give the same tokens with or without tree drafts.

After acceptance the accepted nodes' K/V are copied from their chunk rows into consecutive
slots ``ctx + 1 ..`` (the slots past the accepted length are rolled back by the scheduler as for
chains), and the proposer's recorded target states are reordered the same way.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvserve.sample.metadata import GREEDY_EPS, get_generator
from kvserve.spec_decode.rejection_sampler import DraftPosition, draft_positions, replay_generator

#: the most rows (root included) a tree may have: one int64 ancestor mask per row
MAX_TREE_ROWS = 64


def tree_depths(parents: list[int]) -> np.ndarray:
    """int64 ``[1 + N]``: the depth of each chunk row (root 0) for nodes with parent indices
    ``parents`` ``[N]`` (-1: the root; else an earlier node). Raises ValueError otherwise."""
    depth = np.zeros(len(parents) + 1, dtype=np.int64)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree parent {p} of node {i}: must be -1 (the root) or an earlier node")
        depth[i + 1] = depth[p + 1] + 1
    return depth


def tree_ancestor_bits(parents: list[int]) -> np.ndarray:
    """int64 ``[1 + N]``: per chunk row, bit ``j`` set for each chunk row ``j`` it sees (the root,
    its ancestors, itself). Raises ValueError past ``MAX_TREE_ROWS`` rows."""
    if len(parents) + 1 > MAX_TREE_ROWS:
        raise ValueError(f"a tree holds at most {MAX_TREE_ROWS} rows, got {len(parents) + 1}")
    bits = [1]
    for i, p in enumerate(parents):
        bits.append(bits[p + 1] | (1 << (i + 1)))
    return np.array(bits, dtype=np.uint64).view(np.int64)


def walk_tree(drafts: list[int], parents: list[int], samples: list[int]) -> tuple[list[int], list[int]]:
    """Acceptance of a tree: ``samples`` ``[1 + N]`` were drawn at each chunk row as if its path
    were accepted. Returns ``(tokens, rows)``: the accepted nodes' tokens then the sample where the
    walk stops, and the chunk rows whose samples those tokens are (``[0] + accepted rows``)."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(drafts, parents)):
        children.setdefault(p + 1, {}).setdefault(int(t), i + 1)
    cur, rows = 0, [0]
    while True:
        nxt = children.get(cur, {}).get(int(samples[cur]))
        if nxt is None:
            break
        cur = nxt
        rows.append(cur)
    return [int(drafts[r - 1]) for r in rows[1:]] + [int(samples[cur])], rows


def tree_draft_positions(state, drafts: list[int], parents: list[int], device: torch.device,
                         vocab_size: int) -> list[DraftPosition]:
    """Sampler rows of one request verifying a tree: row ``r`` as if the path to it were accepted.
    A seeded random request's row at depth ``d`` gets its own generator, the request's advanced
    ``d`` draws (the request's own generator is not advanced here)."""
    base = list(state.output_token_ids)
    paths = [[]]
    for t, p in zip(drafts, parents):
        paths.append(paths[p + 1] + [int(t)])
    out = [DraftPosition(state, base + path) for path in paths]
    sp = state.sampling_params
    if sp.seed is not None and sp.temperature >= GREEDY_EPS:
        s0 = get_generator(state, device).get_state()
        for pos, path in zip(out, paths):
            g = torch.Generator(device=device)
            replay_generator(g, s0, len(path), vocab_size)
            pos.generator = g
    return out


class _TreeRequest:
    __slots__ = ("drafts", "parents", "root_pos", "slots")

    def __init__(self, drafts, parents, root_pos, slots) -> None:
        self.drafts, self.parents, self.root_pos, self.slots = drafts, parents, root_pos, slots


class TreeVerification:
    """One step's tree requests: built by ``build`` from the step's inputs (rotary positions set
    to depth), attached to the attention metadata, then used by sampling and acceptance."""

    def __init__(self) -> None:
        self.reqs: dict[str, _TreeRequest] = {}
        self.mask: Optional[np.ndarray] = None
        self.start: Optional[np.ndarray] = None
        self._copies: list[tuple[np.ndarray, np.ndarray]] = []
        self._reorders: list[tuple[str, int, list[int]]] = []

    @classmethod
    def build(cls, proposer, inp, drafts: dict[str, list[int]]) -> Optional["TreeVerification"]:
        """The tree requests among ``inp``'s (``BatchInputs``) with ``drafts``; None when every
        request verifies a chain. Rewrites ``inp.positions`` of the tree rows to ``ctx + depth``.
        Raises ValueError for a model with several KV cache groups."""
        tv = None
        for i, rid in enumerate(inp.req_ids):
            d = drafts.get(rid)
            parents = proposer.draft_tree(rid, d) if d else None
            if parents is None or all(p == j - 1 for j, p in enumerate(parents)):
                continue  # a chain: the plain causal path
            if tv is None:
                if len(inp.slot_mappings) != 1:
                    raise ValueError("tree drafts need a model with one KV cache group (full attention)")
                tv = cls()
                tv.mask = np.full(len(inp.positions), -1, dtype=np.int64)
                tv.start = inp.seq_lens.astype(np.int32).copy()  # no tree keys for other requests
            n = len(d) + 1
            r0 = int(inp.query_start_loc[i + 1]) - n
            root = int(inp.seq_lens[i]) - n
            inp.positions[r0:r0 + n] = root + tree_depths(parents)
            tv.mask[r0:r0 + n] = tree_ancestor_bits(parents)
            tv.start[i] = root
            tv.reqs[rid] = _TreeRequest(list(d), list(parents), root, inp.slot_mappings[0][r0:r0 + n].copy())
        return tv

    def attach(self, metas: list, device: torch.device) -> None:
        """Set the tree mask on the step's attention metadata (every group)."""
        mask = torch.from_numpy(self.mask).to(device)
        start = torch.from_numpy(self.start).to(device)
        for m in metas:
            m.tree_mask, m.tree_start = mask, start

    def draft_positions(self, states: list, req_ids: list[str], drafts: list[list[int]], device: torch.device,
                        vocab_size: int) -> list[DraftPosition]:
        """``rejection_sampler.draft_positions`` for the step's spec requests, tree ones by path."""
        out = []
        for st, rid, d in zip(states, req_ids, drafts):
            t = self.reqs.get(rid)
            if t is None:
                out.extend(draft_positions([st], [d], device))
            else:
                out.extend(tree_draft_positions(st, d, t.parents, device, vocab_size))
        return out

    def accept(self, rid: str, samples: list[int]) -> Optional[tuple[list[int], list[int]]]:
        """``walk_tree`` for a tree request (None for a chain); queues its K/V compaction."""
        t = self.reqs.get(rid)
        if t is None:
            return None
        toks, rows = walk_tree(t.drafts, t.parents, samples)
        if len(rows) > 1 and rows != list(range(len(rows))):
            self._copies.append((t.slots[rows[1:]], t.slots[1:len(rows)]))
        self._reorders.append((rid, t.root_pos, rows))
        return toks, rows

    @torch.inference_mode()
    def finish(self, runner) -> None:
        """Copy the accepted nodes' K/V into consecutive slots (every layer) and tell the proposer
        which rows its recorded target states keep (``Proposer.tree_accepted``)."""
        if self._copies:
            from kvserve.attention.kv_format import format_of_spec

            src = torch.from_numpy(np.concatenate([s for s, _ in self._copies])).to(runner.device)
            dst = torch.from_numpy(np.concatenate([d for _, d in self._copies])).to(runner.device)
            fmt = format_of_spec(runner.kv_cache_config.groups[0].spec)
            for cache in runner.kv_caches.values():
                # gather first: a source row is never an earlier destination (node rows >= depth)
                fmt.copy_slots(cache, src, dst)
        if runner.proposer is not None:
            for rid, root, rows in self._reorders:
                runner.proposer.tree_accepted(rid, root, rows)
        self._copies, self._reorders = [], []


# ---- drafting (EAGLE heads) -------------------------------------------------------------------
def select_tree(tok: np.ndarray, score: np.ndarray, parent: np.ndarray, num_nodes: int) -> tuple[list, list]:
    """The best ``num_nodes`` nodes of one request's candidate pool by cumulative draft log-prob
    (EAGLE-2's re-ranking). The pool ``[P]`` is in level order (parents before children, ``parent``
    -1 for the root's children); a child's score never exceeds its parent's, so the best nodes
    (ties to the shallower) always include their ancestors. Returns ``(tokens, parents)`` in pool
    order (topological), parents as indices into the returned list."""
    rank = np.empty(len(score), dtype=np.int64)
    rank[np.argsort(-score, kind="stable")] = np.arange(len(score))
    return select_ranked(tok, rank, parent, num_nodes)


def select_ranked(tok: np.ndarray, rank: np.ndarray, parent: np.ndarray, num_nodes: int) -> tuple[list, list]:
    """``select_tree`` given each pool node's rank ``[P]`` int64 (0: the best score; ties in pool
    order, as ``pool_ranks`` computes them on the device)."""
    keep = np.flatnonzero(rank < num_nodes)
    where = {int(p): j for j, p in enumerate(keep)}
    return [int(tok[p]) for p in keep], [where[int(parent[p])] if parent[p] >= 0 else -1 for p in keep]


def pool_ranks(score: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, P]``: each pool node's place when sorting ``score`` ``[R, P]`` descending, ties
    kept in pool order (a stable sort; no host sync, so it runs inside a CUDA graph)."""
    order = torch.sort(-score.float(), dim=1, stable=True).indices
    pos = torch.arange(score.shape[1], device=score.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, pos)


def _map_tokens(head, idx: torch.Tensor) -> torch.Tensor:
    return idx + head.d2t[idx] if head.eagle3 else idx


def tree_pool(head, feats: torch.Tensor, topk: int, depth: int, forward) -> tuple[torch.Tensor, ...]:
    """EAGLE-2's candidate pool, on the device without host syncs (the eager and the CUDA-graph
    tree paths share it). ``feats`` ``[R, hidden]``: the head's outputs at each request's last
    context pair. At depth 1 the root's top ``topk`` tokens are the frontier; at each later depth
    ``d`` the head runs once over the frontier, ``forward(d, ids [R*K], hidden [R*K, H], bits [R*K])``
    (node ``j`` of request ``r`` in the head's local slot ``tot[r] + (d - 1) * K + j``, seeing the
    head's context and the slots of its ancestor bits, bit ``b`` = slot ``tot[r] + b``), every
    frontier node offers its top ``K`` children (cumulative log-prob), and the best ``K`` of those
    ``K * K`` form the next frontier. Returns the pool in level order: tokens, scores (float32)
    and parents (pool indices, -1: the root), each ``[R, K + (depth - 1) * K * K]``."""
    R, dev = feats.shape[0], feats.device
    lp = torch.log_softmax(head.compute_logits(feats), dim=-1).clamp_(max=0.0)  # children never outscore parents
    score, idx = lp.topk(min(topk, lp.shape[-1]), dim=-1)  # [R, K]
    K = score.shape[1]
    tok = _map_tokens(head, idx)
    pool_tok, pool_score, pool_parent = [tok], [score], [torch.full((R, K), -1, dtype=torch.long, device=dev)]
    front_pool = torch.arange(K, device=dev).expand(R, K)  # pool index of each frontier node
    front_in = feats.unsqueeze(1).expand(R, K, feats.shape[-1])  # features fed with each node
    front_bits = (1 << torch.arange(K, device=dev, dtype=torch.long)).expand(R, K)  # head slots it sees
    pool_n = K
    for d in range(1, depth):
        f = forward(d, tok.reshape(-1), front_in.reshape(R * K, -1), front_bits.reshape(-1))
        lp = torch.log_softmax(head.compute_logits(f), dim=-1).clamp_(max=0.0)  # [R * K, V]
        s, ix = lp.topk(K, dim=-1)
        cand = (score.unsqueeze(-1) + s.view(R, K, K)).view(R, K * K)
        cand_tok = _map_tokens(head, ix).view(R, K * K)
        cand_parent = front_pool.unsqueeze(-1).expand(R, K, K).reshape(R, K * K)
        pool_tok.append(cand_tok)
        pool_score.append(cand)
        pool_parent.append(cand_parent)
        score, sel = cand.topk(K, dim=-1)  # the next frontier
        src = sel // K  # which frontier node each child comes from
        tok = cand_tok.gather(1, sel)
        front_pool = pool_n + sel
        pool_n += K * K
        front_in = f.view(R, K, -1).gather(1, src.unsqueeze(-1).expand(R, K, f.shape[-1]))
        front_bits = front_bits.gather(1, src) | (1 << (d * K + torch.arange(K, device=dev, dtype=torch.long)))
    return torch.cat(pool_tok, 1), torch.cat(pool_score, 1).float(), torch.cat(pool_parent, 1)


def draft_tree(prop, rows, feats: torch.Tensor, depth: int) -> np.ndarray:
    """EAGLE-2 tree drafting, eager (``EagleProposer``'s path when the tree graphs don't fit):
    ``tree_pool`` of ``depth`` with one head forward per depth over the frontier (``_tree_forward``).
    Returns int64 ``[R, 3, P]`` (host): per request the pool's tokens, parents and ranks
    (``pool_ranks``), for ``finish_tree``."""
    tot = np.array([r[4] for r in rows], dtype=np.int64)

    def forward(d, ids, hidden, bits):
        K = ids.shape[0] // len(rows)  # topk, or the draft vocabulary if smaller
        return _tree_forward(prop, rows, ids, tot + d - 1, (d - 1) * K, K, hidden, bits)

    tok, score, parent = tree_pool(prop.head, feats, prop.tree_topk, depth, forward)
    return torch.stack([tok, parent, pool_ranks(score)], 1).cpu().numpy()


def finish_tree(prop, requests: list, rows, pool: np.ndarray, out: list) -> list:
    """The best ``speculative_num_draft_tokens - 1`` nodes of each request's pool (``pool``
    ``[R, 3, P]`` from ``draft_tree`` or the tree graphs) are its tree: fills ``out`` (tokens per
    request) and the proposer's trees, and drops the head's fed features."""
    num_nodes = min(prop.config.speculative_config.speculative_num_draft_tokens - 1, prop.num_drafts_allowed)
    for r, (i, st, toks, f0, total) in enumerate(rows):
        d_tok, d_par = select_ranked(pool[r, 0], pool[r, 2], pool[r, 1], num_nodes)
        out[i] = d_tok
        prop.trees[requests[i].req_id] = (d_tok, d_par)
        st.n = total
        keep = st.base + total - st.pend_start  # drop fed features; keep any computed beyond
        st.pend, st.pend_start = st.pend[keep:], st.base + total
    return out


def _tree_forward(prop, rows, ids: torch.Tensor, pos: np.ndarray, slot0: int, K: int, hidden: torch.Tensor,
                  bits: torch.Tensor) -> torch.Tensor:
    """One head forward over ``K`` frontier nodes per request: node ``j`` of request ``r`` at rotary
    position ``pos[r]``, its KV in the head's local slot ``tot[r] + slot0 + j``, seeing the head's
    context ``[0, tot[r])`` and the slots of its ancestor bits (bit ``b`` = slot ``tot[r] + b``)."""
    dev, bs, R = prop.device, prop.block_size, len(rows)
    bt = np.zeros((R, prop.max_blocks), dtype=np.int32)
    for r, (_, st, *_rest) in enumerate(rows):
        bt[r, : len(st.blocks)] = st.blocks
    tot = np.array([r[4] for r in rows], dtype=np.int64)
    local = (tot + slot0)[:, None] + np.arange(K)[None, :]  # [R, K]
    slots = (bt[np.arange(R)[:, None], local // bs].astype(np.int64) * bs + local % bs).reshape(-1)
    seq = (tot + slot0 + K).tolist()
    qsl = np.arange(R + 1, dtype=np.int32) * K
    meta = prop.head_backend.metadata_builder_cls.metadata_cls(
        slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(bt).to(dev),
        query_start_loc=torch.from_numpy(qsl).to(dev), seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
        query_lens_cpu=[K] * R, seq_lens_cpu=seq, max_query_len=K, max_seq_len=max(seq), num_decodes=0)
    meta.tree_mask = bits.to(dev)
    meta.tree_start = torch.from_numpy(tot.astype(np.int32)).to(dev)
    from kvserve.attention.forward_context import forward_context

    p = torch.from_numpy(np.repeat(pos, K)).to(dev)
    with forward_context([meta]):
        return prop.head(ids.to(dev), p, hidden.to(prop.head.dtype))
