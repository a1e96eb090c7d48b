"""Attention over a bounded KV cache: StreamingLLM (arXiv:2309.17453) sinks + window, and H2O's
(arXiv:2306.14048) kept blocks.

The block accounting lives in ``kvserve.core.bounded_kv`` (read its docstring for the policies
and the position scheme). This module is the attention side, shared by every backend
(``AttentionBackend.forward_bounded``: each backend stores K/V its own way, then this
reference computes attention; a fused kernel may replace it later, and must match it):

* ``streaming``: a query at position ``p`` sees the keys ``k <= p`` with ``k < N`` (the sinks)
  or ``k > p - W`` (its window) -- exactly, by position, whatever blocks are still held. Its
  scores against keys of the sink blocks use the query rotated back by ``delta(p)``
  (``bounded_kv.sink_shift``): the distance to a sink is then the in-cache distance.
* ``h2o``: a query sees every key of every block its request still holds (entries that are
  not the null block 0), causally, at original positions; the attention probabilities are
  summed per block (over query rows, heads and layers) into ``BoundedPlan.mass``, the score
  the eviction policy ranks blocks by.

Per step the attention metadata builder (``BoundedPlanner``, ``kvserve/attention/metadata.py``)
builds one ``BoundedPlan`` per request (host work, once for all layers: which block-table
columns to read, key positions, the mask, the sink-query rotation) and attaches them to the
group's ``AttentionMetadata.bounded``. Each layer then gathers only
the kept blocks: ``O(sinks + window)`` keys per query, not ``O(position)``.

Numerics: scores, softmax and the weighted sum run in float32 and the result is cast to the
query's dtype. Queries are tiled by ``QUERY_TILE`` rows so a long prefill chunk's score
matrix stays bounded in memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from kvserve.attention.kv_format import KVCacheFormat

logger = logging.getLogger("kvserve")

QUERY_TILE = 256


@dataclass
class BoundedPlan:
    """One request's reads for a step (built on the host, shared by every layer of the group).

    Attributes:
        cols: ``[C]`` int64 block-table columns to read (sink blocks first, then in order).
        block_ids: ``[C]`` int64 their block ids (device).
        kpos: ``[C * block_size]`` int64 key positions (device).
        mask: ``[n, C * block_size]`` bool, True where query row ``j`` sees the key (device).
        num_sink_keys: the first keys that are scored with the rotated-back query (0: none).
        sink_cos / sink_sin: ``[n, head_size]`` float32 rotation by ``-delta(p)`` per query row,
            or None when no row has a shift.
        mass: h2o: ``[C]`` float32 attention mass accumulated over layers (device), else None.
    """

    cols: np.ndarray
    block_ids: torch.Tensor
    kpos: torch.Tensor
    mask: torch.Tensor
    num_sink_keys: int = 0
    sink_cos: Optional[torch.Tensor] = None
    sink_sin: Optional[torch.Tensor] = None
    mass: Optional[torch.Tensor] = None


@dataclass
class DecodeBatch:
    """The batch's leading decode requests (query length 1) as padded tensors, so that one
    batched attention serves them all (their ``BoundedPlan`` tensors are views into these).

    Attributes:
        block_ids: ``[n, C]`` int64 block ids to read (padding: the null block 0, masked).
        mask: ``[n, C * block_size]`` bool, True where the request's query sees the key.
        num_sink_keys: the widest sink span; keys below it are scored with the rotated-back
            query where ``sink_keys`` says so (0: none).
        sink_keys: ``[n, num_sink_keys]`` bool, or None.
        cos / sin: ``[n, head_size]`` float32 rotation by ``-delta(p)`` (identity rows where none).
        mass: h2o: ``[n, C]`` float32 attention mass per column, else None.
    """

    block_ids: torch.Tensor
    mask: torch.Tensor
    num_sink_keys: int = 0
    sink_keys: Optional[torch.Tensor] = None
    cos: Optional[torch.Tensor] = None
    sin: Optional[torch.Tensor] = None
    mass: Optional[torch.Tensor] = None


@dataclass
class BoundedAttention:
    """A bounded-KV group's per-step attention description (``AttentionMetadata.bounded``).

    Attributes:
        policy: ``"streaming"`` or ``"h2o"``.
        plans: per request of the batch (batch order), its ``BoundedPlan``.
        decode: the leading decode requests batched (``DecodeBatch``), or None.
        query_start_loc: ``[R + 1]`` prefix sums of the query lengths (host ints).
    """

    policy: str
    plans: list[BoundedPlan] = field(default_factory=list)
    decode: Optional[DecodeBatch] = None
    query_start_loc: list[int] = field(default_factory=list)


def _rotation(shifts: np.ndarray, inv_freq: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[n, 2 * len(inv_freq)]`` float32 of the angles ``shifts * inv_freq`` (float64 math)."""
    ang = torch.from_numpy(shifts.astype(np.float64))[:, None] * inv_freq.double().cpu()[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def build_plans(policy: str, block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                sinks: list[int], windows: list[int], block_size: int, device: torch.device,
                inv_freq: Optional[torch.Tensor] = None) -> BoundedAttention:
    """Per request, which blocks to read, the mask and the sink-query rotation (host work).

    Args:
        policy: ``"streaming"`` or ``"h2o"``.
        block_table: int32 ``[R, max_blocks]`` (null entries 0 where blocks were evicted).
        seq_lens / query_lens: int64 ``[R]`` tokens after this step / computed this step.
        sinks / windows: per request, its attention sinks and window (tokens).
        block_size: tokens per block.
        device: where the plans' tensors go.
        inv_freq: the model's rotary inverse frequencies ``[head_size / 2]`` (streaming).

    Raises ValueError when a streaming plan needs a rotation and ``inv_freq`` is None.
    """
    bs = block_size
    out = BoundedAttention(policy, query_start_loc=[0] + np.cumsum(query_lens).tolist())
    ar = np.arange(bs, dtype=np.int64)
    nd = 0  # leading decodes (the runner orders decodes first): planned as one padded batch
    while nd < len(query_lens) and int(query_lens[nd]) == 1:
        nd += 1
    if nd:
        _decode_batch(out, policy, block_table[:nd], seq_lens[:nd], sinks[:nd], windows[:nd], bs, device, inv_freq)
    for i in range(nd, len(seq_lens)):
        L, n = int(seq_lens[i]), int(query_lens[i])
        ctx = L - n
        nb = -(-L // bs)
        row = block_table[i, :nb]
        N, W = sinks[i], windows[i]
        sb = min(-(-N // bs), nb)
        if policy == "streaming":
            wcol = max(max(ctx - W + 1, 0) // bs, sb)
            cols = np.concatenate([np.arange(sb), np.arange(wcol, nb)]).astype(np.int64)
        else:
            cols = np.flatnonzero(row != 0).astype(np.int64)
        kpos = (cols[:, None] * bs + ar[None, :]).reshape(-1)
        qpos = np.arange(ctx, L, dtype=np.int64)
        mask = kpos[None, :] <= qpos[:, None]
        plan_sinks, cos, sin = 0, None, None
        if policy == "streaming":
            mask &= (kpos[None, :] < N) | (kpos[None, :] > qpos[:, None] - W)
            shifts = bs * np.maximum(0, (qpos - W + 1) // bs - -(-N // bs))
            if shifts.any() and sb:
                if inv_freq is None:
                    raise ValueError("streaming attention needs the model's rotary inv_freq")
                plan_sinks = sb * bs
                cos, sin = _rotation(shifts, inv_freq, device)
        out.plans.append(BoundedPlan(
            cols=cols, block_ids=torch.from_numpy(row[cols].astype(np.int64)).to(device),
            kpos=torch.from_numpy(kpos).to(device), mask=torch.from_numpy(mask).to(device),
            num_sink_keys=plan_sinks, sink_cos=cos, sink_sin=sin,
            mass=torch.zeros(len(cols), dtype=torch.float32, device=device) if policy == "h2o" else None))
    return out


def _decode_batch(out: BoundedAttention, policy: str, block_table: np.ndarray, seq_lens: np.ndarray,
                  sinks: list[int], windows: list[int], bs: int, device: torch.device,
                  inv_freq: Optional[torch.Tensor]) -> None:
    """Plans of ``n`` decode requests as one ``DecodeBatch`` (a few host-to-device copies in
    all, not several per request); appends their ``BoundedPlan`` views to ``out.plans``."""
    n = len(seq_lens)
    cols_l, sb_l, shifts = [], [], np.zeros(n, dtype=np.int64)
    for i in range(n):
        L = int(seq_lens[i])
        nb = -(-L // bs)
        N, W = sinks[i], windows[i]
        sb = min(-(-N // bs), nb)
        if policy == "streaming":
            cols = np.concatenate([np.arange(sb), np.arange(max(max(L - W, 0) // bs, sb), nb)])
            shifts[i] = bs * max(0, (L - W) // bs - -(-N // bs))
        else:
            cols = np.flatnonzero(block_table[i, :nb] != 0)
        cols_l.append(cols.astype(np.int64))
        sb_l.append(sb if shifts[i] and sb else 0)
    C = max(len(c) for c in cols_l)
    ids = np.zeros((n, C), dtype=np.int64)
    mask = np.zeros((n, C * bs), dtype=bool)
    ns = max(sb_l) * bs
    sink_keys = np.zeros((n, ns), dtype=bool)
    for i, cols in enumerate(cols_l):
        L, c = int(seq_lens[i]), len(cols)
        ids[i, :c] = block_table[i, cols]
        kpos = (cols[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)
        m = kpos <= L - 1
        if policy == "streaming":
            m &= (kpos < sinks[i]) | (kpos > L - 1 - windows[i])
        mask[i, :c * bs] = m
        sink_keys[i, :sb_l[i] * bs] = True
    dec = DecodeBatch(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device), ns)
    if ns:
        if inv_freq is None:
            raise ValueError("streaming attention needs the model's rotary inv_freq")
        dec.sink_keys = torch.from_numpy(sink_keys).to(device)
        dec.cos, dec.sin = _rotation(shifts, inv_freq, device)
    if policy == "h2o":
        dec.mass = torch.zeros((n, C), dtype=torch.float32, device=device)
    out.decode = dec
    for i, cols in enumerate(cols_l):
        c = len(cols)
        out.plans.append(BoundedPlan(
            cols=cols, block_ids=dec.block_ids[i, :c], kpos=torch.from_numpy(
                (cols[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)),
            mask=dec.mask[i:i + 1, :c * bs], num_sink_keys=sb_l[i] * bs,
            sink_cos=dec.cos[i:i + 1] if sb_l[i] else None, sink_sin=dec.sin[i:i + 1] if sb_l[i] else None,
            mass=dec.mass[i, :c] if dec.mass is not None else None))


def _decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, dec: DecodeBatch, fmt: KVCacheFormat,
                      scale: float, out: torch.Tensor, rotation: Optional[torch.Tensor] = None) -> None:
    """One batched attention for the ``n`` leading decode requests (padded to ``C`` blocks)."""
    n, C = dec.block_ids.shape
    _, _, bs, hkv, _ = kv_cache.shape
    d = query.shape[2]
    g = query.shape[1] // hkv
    ids = dec.block_ids.reshape(-1)
    k = fmt.load_blocks(kv_cache, 0, ids, torch.float32).reshape(n, C * bs, hkv, d)
    v = fmt.load_blocks(kv_cache, 1, ids, torch.float32).reshape(n, C * bs, hkv, d)
    v.masked_fill_(~dec.mask.view(n, C * bs, 1, 1), 0.0)  # padding reads the null block: any bits, even NaN
    q = query[:n].float()
    scores = torch.einsum("rkgd,rlkd->rkgl", q.view(n, hkv, g, d), k)
    ns = dec.num_sink_keys
    if ns:
        qs = rotate_back(q, dec.cos, dec.sin, rotation).view(n, hkv, g, d)
        ss = torch.einsum("rkgd,rlkd->rkgl", qs, k[:, :ns])
        scores[..., :ns] = torch.where(dec.sink_keys[:, None, None, :], ss, scores[..., :ns])
    scores.mul_(scale)
    scores.masked_fill_(~dec.mask[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out[:n] = torch.einsum("rkgl,rlkd->rkgd", p, v).reshape(n, hkv * g, d).to(query.dtype)
    if dec.mass is not None:
        dec.mass += p.sum(dim=(1, 2)).view(n, C, bs).sum(dim=-1)


def rotate_back(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotation: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotary (neox, rotate-half) rotation of ``q [n, H, d]`` by minus the angles ``cos/sin [n, d]``.

    With ``rotation`` (``R [d, d]``, a rotated KV format: ``q`` is ``q0 R``) the rotary shift
    acts on the unrotated channels: ``rotate_back(q R^T) R``.
    """
    if rotation is not None:
        return rotate_back(q @ rotation.T.to(q.dtype), cos, sin) @ rotation.to(q.dtype)
    half = q.shape[-1] // 2
    rot = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos[:, None, :] - rot * sin[:, None, :]


def bounded_attention(query: torch.Tensor, kv_cache: torch.Tensor, fmt: KVCacheFormat, bounded: BoundedAttention,
                      scale: float, kv_rotation: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of every request of the batch over its kept keys (K/V already stored).

    Args:
        query: ``[T, H, d]`` (already rotated at the tokens' positions).
        kv_cache: ``[2, num_blocks, block_size, Hkv, row]`` in format ``fmt``.
        bounded: the step's plans (``build_plans``).
        scale: softmax scale.
        kv_rotation: ``[d, d]`` when query and cache are in a rotated basis (int4 / int2,
            ``kvserve/attention/kv_rotation.py``): only the sink queries' rotary shift needs it.

    Returns ``[T, H, d]`` in the query's dtype. h2o plans accumulate their ``mass``.
    """
    out = torch.empty_like(query)
    _, _, bs, hkv, _ = kv_cache.shape
    d = query.shape[2]
    g = query.shape[1] // hkv
    query_start_loc = bounded.query_start_loc
    if query.shape[0] > query_start_loc[-1]:  # piecewise CUDA graphs pad the step's rows
        out[query_start_loc[-1]:].zero_()
    start = 0
    if bounded.decode is not None:
        _decode_attention(query, kv_cache, bounded.decode, fmt, scale, out, kv_rotation)
        start = bounded.decode.block_ids.shape[0]
    for i in range(start, len(bounded.plans)):
        plan = bounded.plans[i]
        s, e = query_start_loc[i], query_start_loc[i + 1]
        c = len(plan.cols)
        # Whole pages, dequantized from the page layout (codes, then scales, per block).
        k = fmt.load_blocks(kv_cache, 0, plan.block_ids, torch.float32).reshape(c * bs, hkv, d)  # [L, hkv, d]
        v = fmt.load_blocks(kv_cache, 1, plan.block_ids, torch.float32).reshape(c * bs, hkv, d)
        for t0 in range(s, e, QUERY_TILE):
            t1 = min(t0 + QUERY_TILE, e)
            q = query[t0:t1].float()
            n = t1 - t0
            qg = q.view(n, hkv, g, d)
            scores = torch.einsum("nkgd,lkd->kgnl", qg, k)
            ns = plan.num_sink_keys
            if ns:
                qs = rotate_back(q, plan.sink_cos[t0 - s:t1 - s], plan.sink_sin[t0 - s:t1 - s],
                                 kv_rotation).view(n, hkv, g, d)
                scores[..., :ns] = torch.einsum("nkgd,lkd->kgnl", qs, k[:ns])
            scores.mul_(scale)
            scores.masked_fill_(~plan.mask[t0 - s:t1 - s], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            o = torch.einsum("kgnl,lkd->nkgd", p, v)
            out[t0:t1] = o.reshape(n, hkv * g, d).to(query.dtype)
            if plan.mass is not None:
                plan.mass += p.sum(dim=(0, 1, 2)).view(c, bs).sum(dim=1)
    return out


class BoundedPlanner:
    """A bounded-KV group's per-step plans, for the attention metadata builder: per-request
    sinks and window (``SamplingParams`` may lower the engine's), the rotary tables widened as
    positions pass them (bounded requests run past ``max_model_len``), h2o's block mass."""

    def __init__(self, model, block_size: int, device: torch.device) -> None:
        # The model's rotary tables (``kvserve.layers.rotary.RotaryEmbedding``: ``inv_freq``,
        # ``max_position``, ``extend``), found by shape so attention imports no layer module.
        self.ropes = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "extend")]
        self.block_size = block_size
        self.device = device

    def grow_rotary(self, max_seq_len: int) -> bool:
        """Widen the rotary tables to cover ``max_seq_len`` positions (doubling, so O(log
        length) times). Returns True when they grew: graphed pieces read them by address."""
        grown = False
        for r in self.ropes:
            if max_seq_len > r.max_position:
                r.extend(max(max_seq_len, 2 * r.max_position))
                grown = True
        if grown:
            logger.info("rotary tables grown to %d positions", self.ropes[0].max_position)
        return grown

    def plans(self, spec, inp, block_table: np.ndarray, states: dict) -> BoundedAttention:
        """The step's ``BoundedAttention`` for a group of ``BoundedKVSpec`` ``spec``
        (``inp``: the step's ``BatchInputs``; ``states``: request id -> input-batch state)."""
        from kvserve.core.bounded_kv import request_limits

        lims = [request_limits(states[r].sampling_params, spec.sink_tokens, spec.window) for r in inp.req_ids]
        return build_plans(spec.policy, block_table, inp.seq_lens, inp.query_lens, [a for a, _ in lims],
                           [b for _, b in lims], self.block_size, self.device,
                           self.ropes[0].inv_freq if self.ropes else None)

    @staticmethod
    def block_mass(req_ids: list[str], metas: list) -> dict:
        """h2o: request id -> group id -> {block-table column: attention mass} of this step."""
        out: dict = {}
        for gi, m in enumerate(metas):
            b = m.bounded
            if b is None or b.policy != "h2o":
                continue
            dec = b.decode.mass.cpu().numpy() if b.decode is not None else None  # one copy for the decodes
            for i, (rid, plan) in enumerate(zip(req_ids, b.plans)):
                mass = dec[i, :len(plan.cols)] if dec is not None and i < len(dec) else plan.mass.cpu().numpy()
                out.setdefault(rid, {})[gi] = dict(zip(plan.cols.tolist(), mass.tolist()))
        return out
