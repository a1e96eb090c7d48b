"""CPU paged attention: decodes as a few batched matmuls over length-sorted chunks.

The decode rows of a step (query length 1, first in the batch) are sorted by length and
cut into chunks of about ``chunk_tokens`` padded KV rows. Per chunk and layer:

1. one ``index_select`` copies the chunk's whole K and V blocks (pages; quantized ones
   are dequantized from ``kv_quant.page_views``) into a reused buffer, K and V each
   ``[rows, L, Hkv * D]`` (``L``: the chunk's longest sequence, rounded up
   to a block);
2. scores ``[rows, H, L]`` come from ``baddbmm`` of block-diagonal queries against K:
   row ``h * G + g`` of a sequence's query matrix ``[H, Hkv * D]`` holds query head
   ``h * G + g`` in the columns of KV head ``h`` and zeros elsewhere, so one matmul
   serves every KV group without transposing K;
3. mask (padding, sliding window), softmax in float32, one ``bmm`` against V; the
   diagonal ``[Hkv, G, D]`` blocks of the ``[H, Hkv * D]`` product are the output.

With a sliding window, each row's gather starts at the block of its first visible key
(``seq_len - window``), so a window layer reads at most ``ceil(window / block_size) + 1``
blocks per row however long the sequence (blocks below it may be freed: null entries).

The block-diagonal form multiplies ``Hkv - 1`` zero blocks per row, so with many KV
heads (``_GROUPED_FROM_KV_HEADS``; float32 or exact scores) K/V are transposed to
``[rows, Hkv, L, D]`` instead and each group's ``G`` heads meet their own head only.

Numerics. Float32 queries use float32 throughout. With 16-bit queries the score GEMM
accumulates in float32 and rounds once to the query dtype, softmax runs in float32
(the CPU kernel upcasts and rounds its output once) and the probabilities meet V in
the query dtype: transformers' eager attention. ``torch_ref`` (SDPA) keeps the scores in
float32, so its outputs differ by up to ~2 ulps; on SmolLM2 in bfloat16, greedy text
stays as close to the float32 model as torch_ref's (24 HumanEval prompts x 96 tokens:
first divergence at 52.3 vs 53.7 tokens on average). ``exact_scores=True`` restores
float32 scores: a second ``baddbmm`` computes the rounding residual
(``scale * QK^T - s``, from the same accumulator), and ``s + residual`` is summed in
float32; it costs ~10% of a batch-64 decode step.

Cost model behind the design: on this kind of CPU a step's decode attention is bound by
reading K/V once from memory plus small-M GEMMs; sorting and chunking leave little
padding, and a chunk's K/V stay in the core's cache between the gather and the
matmuls. Gather indices, masks and every buffer view are made once per step (by the
first layer, cached in ``CpuAttentionMetadata.decode_plans``); buffers are reused across
layers and steps, because fresh multi-MB tensors cost page faults on every call.
Prefill rows run ``torch_ref.prefill_attention`` (a small share of decode-heavy work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import KVCacheFormat, KVCacheView
from kvserve.attention.kv_residual import store_residual
from kvserve.attention.metadata import AttentionMetadataBuilder
from kvserve.attention.torch_ref import prefill_attention, store_kv, substitute_exact_block, uses_residual

# Padded KV rows per chunk: a chunk's K and V (1.5 MB each at 3 KV heads x 64 dims in
# bfloat16) stay cached between the gather and the matmuls, and larger chunks mean fewer
# ops. 4096 was fastest at batch 64, context 200-700 (benchmarks/cpu_attention.py).
DEFAULT_CHUNK_TOKENS = 4096
# From this many KV heads the per-group form wins in float32 and with exact_scores (two
# score GEMMs): 874 vs 1048 ms per step at 8 KV heads in float32. With one bf16 score GEMM
# the block-diagonal form stays ahead (380 vs 428 ms at 8 KV heads); at 1-3 KV heads it
# always does (benchmarks/cpu_attention.py shapes, one thread).
_GROUPED_FROM_KV_HEADS = 4


@dataclass
class _Chunk:
    """Rows ``start:end`` of the length-sorted decodes, padded to ``num_blocks`` blocks."""

    start: int
    end: int
    num_blocks: int
    block_idx: torch.Tensor  # [rows * num_blocks] int64 block ids, row-major
    lens: torch.Tensor  # [rows, 1] int64 sequence lengths
    all_full: bool  # every row fills all num_blocks * block_size slots
    masks: dict = field(default_factory=dict)  # (window, shape, dtype) -> additive mask or None


class _ChunkViews(NamedTuple):
    """One chunk's views into the reused buffers (made by ``CpuBackend._views``)."""

    kvg: torch.Tensor  # [2, rows * blocks, block_size * Hkv * D]: gather target (cache dtype)
    kv_cast: Optional[torch.Tensor]  # as kvg in the query dtype, when the dtypes differ
    transposes: Optional[tuple]  # grouped form: (dst, src) copies to [rows, Hkv, L, D]
    q: torch.Tensor  # matmul lhs: [rows, H, Hkv * D] block-diagonal, or [rows * Hkv, G, D]
    kt: torch.Tensor  # matmul rhs: K transposed, [rows, Hkv * D, L] or [rows * Hkv, D, L]
    s: torch.Tensor  # scores, then probabilities: [rows, H, L] or [rows * Hkv, G, L]
    s_lo: Optional[torch.Tensor]  # exact_scores, 16-bit queries: the rounding residual, as s
    s32: Optional[torch.Tensor]  # exact_scores, 16-bit queries: float32 scores, as s
    v: torch.Tensor  # rhs of the V matmul: [rows, L, Hkv * D] or [rows * Hkv, L, D]
    pv: torch.Tensor  # its output: rows of [nd, H, Hkv * D], or of the sorted output


@dataclass
class _DecodePlan:
    order: torch.Tensor | None  # [nd] int64: sorted position -> batch row; None if identity
    chunks: list[_Chunk]
    rows: list[int]  # sorted position -> batch row
    first_pos: list[int]  # per sorted row: the position of its gathered slot 0
    views: dict = field(default_factory=dict)  # layout key -> (q input, sorted output, chunk views)


def _build_plan(meta: AttentionMetadata, block_size: int, chunk_tokens: int,
                window: int | None = None) -> _DecodePlan:
    nd = meta.num_decodes
    lens = meta.seq_lens_cpu[:nd]
    # With a sliding window a row starts at the block of its first visible key: blocks
    # below it are never gathered, and lengths / masks count from that block.
    lo = [max(n - window, 0) // block_size for n in lens] if window is not None else [0] * nd
    rel = [n - b * block_size for n, b in zip(lens, lo)]
    order_py = sorted(range(nd), key=lambda i: -rel[i])  # longest first: a chunk's first row sets L
    identity = order_py == list(range(nd))
    device = meta.block_tables.device
    order = None if identity else torch.tensor(order_py, dtype=torch.int64, device=device)
    bt = meta.block_tables[:nd] if identity else meta.block_tables.index_select(0, order)
    if any(lo):
        width = -(-rel[order_py[0]] // block_size)
        cols = torch.tensor([lo[i] for i in order_py], dtype=torch.int64, device=device).unsqueeze(1)
        cols = (cols + torch.arange(width, device=device)).clamp_(max=bt.shape[1] - 1)
        bt = bt.gather(1, cols)
    slens = [rel[i] for i in order_py]
    slens_t = torch.tensor(slens, dtype=torch.int64, device=device)
    chunks = []
    i = 0
    while i < nd:
        nb = -(-slens[i] // block_size)
        j = min(nd, i + max(1, chunk_tokens // (nb * block_size)))
        idx = bt[i:j, :nb].reshape(-1).to(torch.int64)
        chunks.append(_Chunk(i, j, nb, idx, slens_t[i:j, None], slens[j - 1] == nb * block_size))
        i = j
    return _DecodePlan(order, chunks, order_py, [lo[i] * block_size for i in order_py])


def _chunk_mask(ch: _Chunk, block_size: int, window: int | None, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor | None:
    """Additive ``dtype`` mask (0 or -inf) over the chunk's ``[rows, L]`` slots, expanded or
    copied to ``shape`` (``[rows, H, L]`` or ``[rows * Hkv, G, L]``); None if nothing is masked."""
    key = (window, shape, dtype)
    if key in ch.masks:
        return ch.masks[key]
    length = ch.num_blocks * block_size
    mask = None
    if not ch.all_full or (window is not None and window < length):
        pos = torch.arange(length, device=ch.lens.device).unsqueeze(0)
        valid = pos < ch.lens
        if window is not None:
            valid &= pos > ch.lens - 1 - window
        m = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))
        r = m.shape[0]
        mask = m.view(r, 1, length).expand(shape) if shape[0] == r else (
            m.view(r, 1, 1, length).expand(r, shape[0] // r, shape[1], length).reshape(shape))
    ch.masks[key] = mask
    return mask


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    """``AttentionMetadata`` plus the CPU backend's decode plans of the step, made by the first
    layer and reused by the others (keyed by block size, chunk size and window)."""

    decode_plans: dict = field(default_factory=dict, repr=False, compare=False)


class CpuMetadataBuilder(AttentionMetadataBuilder):
    metadata_cls = CpuAttentionMetadata


class CpuBackend(AttentionBackend):
    """Paged attention for the CPU (the module docstring describes the method).

    Args:
        chunk_tokens: padded KV rows per decode chunk (>= 1); bounds the gather buffers
            (a single longer sequence still forms a chunk of its own).
        block_diagonal: force the block-diagonal (True) or per-group (False) decode form;
            None picks by the number of KV heads.
        exact_scores: with 16-bit queries, keep the scores float32-exact as torch_ref does
            (one more GEMM per chunk) instead of rounding them to the query dtype.

    Raises ValueError for ``chunk_tokens < 1``. ``forward`` raises ValueError when the
    query heads are not a multiple of the cache's KV heads.
    """

    name = "cpu"
    supports_attention_sinks = True
    metadata_builder_cls = CpuMetadataBuilder

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, block_diagonal: bool | None = None,
                 exact_scores: bool = False) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.block_diagonal = block_diagonal
        self.exact_scores = exact_scores
        self._bufs: dict[tuple, torch.Tensor] = {}

    def _buf(self, key: tuple, numel: int, dtype: torch.dtype, device: torch.device,
             zero: bool = False) -> torch.Tensor:
        """A reused flat buffer of at least ``numel`` elements, grown (never shrunk) as needed."""
        key = (*key, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            n = max(numel, int(buf.numel() * 1.25) if buf is not None else 0)
            # A normal tensor even when made in inference mode, so that a later step
            # outside it (e.g. under torch.no_grad) can still write it.
            with torch.inference_mode(False):
                buf = self._bufs[key] = (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device)
        return buf

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv: KVCacheView,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.attend``; with an exact filling block as ``TorchRefBackend``
        (each decode row's own block is overwritten with its exact rows after the chunk's
        dequantization)."""
        kv_cache = kv.cache
        if query.shape[1] % kv_cache.shape[3]:
            raise ValueError(f"{query.shape[1]} query heads not a multiple of {kv_cache.shape[3]} KV heads")
        store_kv(key, value, kv, meta.slot_mapping)
        kv_residual = kv.residual if uses_residual(kv, meta) else None
        out = torch.empty_like(query)
        if meta.num_decodes > 0:
            block_size = kv_cache.shape[2]
            plan_key = (block_size, self.chunk_tokens, sliding_window)
            plans = meta.decode_plans if isinstance(meta, CpuAttentionMetadata) else {}
            plan = plans.get(plan_key)
            if plan is None:
                plan = plans[plan_key] = _build_plan(meta, block_size, self.chunk_tokens, sliding_window)
            exact = None
            if kv_residual is not None:
                slots = meta.residual.slots_cpu
                exact = (kv_residual, [slots[i] for i in plan.rows],
                         [meta.seq_lens_cpu[i] for i in plan.rows], key, value)
            self._decode(query, kv_cache, kv.format, plan, meta.num_decodes, scale, sliding_window, out, exact,
                         kv.sinks)
        prefill_attention(query, kv, meta, scale, sliding_window, out, key, value)
        if kv_residual is not None:
            store_residual(key, value, kv_residual, meta.residual.slot_mapping)
        return out

    def _views(self, plan: _DecodePlan, nd: int, query: torch.Tensor, kv_cache: torch.Tensor, bdiag: bool):
        """The per-layer query input, the sorted output and per-chunk buffer views for one
        layout; made once per step and reused by every layer."""
        _, _, bs, hkv, rw = kv_cache.shape
        h, d = query.shape[1], query.shape[2]
        g = h // hkv
        dtype, dev = query.dtype, query.device
        # index_select has no float8 kernel: gather 1-byte caches as bytes, then cast / dequantize.
        gdtype = torch.uint8 if kv_cache.element_size() == 1 else kv_cache.dtype
        cast, split = kv_cache.dtype != dtype, self.exact_scores and dtype != torch.float32
        row = bs * hkv * rw
        tok_max = max((c.end - c.start) * c.num_blocks * bs for c in plan.chunks)
        kvg_buf = self._buf(("kvg",), 2 * tok_max * hkv * rw, gdtype, dev)
        kvc_buf = self._buf(("kvc",), 2 * tok_max * hkv * d, dtype, dev) if cast else None
        s_bufs = [self._buf((n,), tok_max * h, t, dev) if split or n == "s" else None
                  for n, t in (("s", dtype), ("s_lo", dtype), ("s32", torch.float32))]
        if bdiag:
            # Zeroed once; only the diagonal blocks are ever written, so the rest stays 0.
            qin = self._buf(("qb", hkv, g, d), nd * h * hkv * d, dtype, dev, zero=True)
            qin = qin[: nd * h * hkv * d].view(nd, hkv, g, hkv, d)
            q_all = qin.view(nd, h, hkv * d)
            pv_all = self._buf(("pv",), nd * h * hkv * d, dtype, dev)[: nd * h * hkv * d].view(nd, h, hkv * d)
            # The output: the diagonal [Hkv, G, D] blocks of every row's product.
            o_sorted = pv_all.view(nd, hkv, g, hkv, d).diagonal(0, 1, 3).permute(0, 3, 1, 2)
        else:
            o_sorted = self._buf(("o",), nd * h * d, dtype, dev)[: nd * h * d].view(nd, hkv, g, d)
            qin = self._buf(("q",), nd * h * d, dtype, dev)[: nd * h * d].view(nd, h, d)
            q_all = qin.view(nd, hkv, g, d)
            t_buf = self._buf(("kvt",), 2 * tok_max * hkv * d, dtype, dev)
        per_chunk = []
        for c in plan.chunks:
            r, length = c.end - c.start, c.num_blocks * bs
            n = r * length * hkv * d
            kvg = kvg_buf[: 2 * r * length * hkv * rw].view(2, r * c.num_blocks, row)
            kv_cast = None if kvc_buf is None else kvc_buf[: 2 * n].view(2, r * c.num_blocks, bs * hkv * d)
            kv = kvg if kv_cast is None else kv_cast
            k, v = kv[0].view(r, length, hkv * d), kv[1].view(r, length, hkv * d)
            s_shape = (r, h, length) if bdiag else (r * hkv, g, length)
            s, s_lo, s32 = (None if b is None else b[: r * length * h].view(s_shape) for b in s_bufs)
            if bdiag:
                per_chunk.append(_ChunkViews(kvg, kv_cast, None, q_all[c.start : c.end], k.transpose(1, 2),
                                             s, s_lo, s32, v, pv_all[c.start : c.end]))
            else:
                kvt = t_buf[: 2 * n].view(2, r, hkv, length, d)
                transposes = ((kvt[0], k.view(r, length, hkv, d).transpose(1, 2)),
                              (kvt[1], v.view(r, length, hkv, d).transpose(1, 2)))
                per_chunk.append(_ChunkViews(
                    kvg, kv_cast, transposes, q_all[c.start : c.end].reshape(r * hkv, g, d),
                    kvt[0].view(r * hkv, length, d).transpose(1, 2), s, s_lo, s32,
                    kvt[1].view(r * hkv, length, d), o_sorted[c.start : c.end].reshape(r * hkv, g, d),
                ))
        return qin, o_sorted, per_chunk

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, fmt: KVCacheFormat, plan: _DecodePlan, nd: int,
                scale: float, window: int | None, out: torch.Tensor, exact: tuple | None = None,
                sinks: torch.Tensor | None = None) -> None:
        _, nblocks, bs, hkv, rw = kv_cache.shape
        h, d = query.shape[1], query.shape[2]
        g = h // hkv
        bdiag = self.block_diagonal
        if bdiag is None:
            one_gemm = query.dtype != torch.float32 and not self.exact_scores
            bdiag = hkv < _GROUPED_FROM_KV_HEADS or one_gemm
        vkey = (query.dtype, kv_cache.dtype, query.device, hkv, g, d, rw, bdiag)
        views = plan.views.get(vkey)
        if views is None:
            views = plan.views[vkey] = self._views(plan, nd, query, kv_cache, bdiag)
        qin, o_sorted, per_chunk = views
        cache = kv_cache.view(2, nblocks, bs * hkv * rw)
        if kv_cache.element_size() == 1:
            cache = cache.view(torch.uint8)
        q = query[:nd] if plan.order is None else query.index_select(0, plan.order)
        if bdiag:
            qin.diagonal(0, 1, 3).copy_(q.view(nd, hkv, g, d).permute(0, 2, 3, 1))
        else:
            qin.copy_(q)
        for c, cv in zip(plan.chunks, per_chunk):
            torch.index_select(cache, 1, c.block_idx, out=cv.kvg)  # K and V in one call
            if fmt.quantized:  # dequantize the chunk's pages into the compute-dtype buffer
                pages = cv.kvg.view(2, -1, bs, hkv, rw)
                cv.kv_cast.view(2, -1, bs, hkv, d).copy_(fmt.dequantize_pages(pages, query.dtype))
            elif cv.kv_cast is not None:
                cv.kv_cast.copy_(cv.kvg.view(kv_cache.dtype))
            if exact is not None:  # the rows' own blocks, exact (kv_residual)
                self._substitute(cv, c, plan, exact, hkv, d)
            if cv.transposes is not None:
                for dst, src in cv.transposes:
                    dst.copy_(src)
            s = cv.s
            torch.baddbmm(s, cv.q, cv.kt, beta=0.0, alpha=scale, out=s)
            # Masks are added on their own: baddbmm with a broadcast input is ~1.5x slower.
            mask = _chunk_mask(c, bs, window, tuple(s.shape), s.dtype if cv.s32 is None else torch.float32)
            s32 = s
            if cv.s32 is not None:
                # The residual of the 16-bit rounding, from the same float32 accumulator.
                torch.baddbmm(s, cv.q, cv.kt, beta=-1.0, alpha=scale, out=cv.s_lo)
                # Sums in float32 (a 16-bit s + s_lo would round the residual away again).
                s32 = cv.s32.copy_(s) if mask is None else torch.add(mask, s, out=cv.s32)
                s32.add_(cv.s_lo)
            elif mask is not None:
                s32.add_(mask)
            if sinks is not None:  # a sink adds exp(sink) to the denominator: p *= sigmoid(lse - sink)
                r = c.end - c.start
                sk = sinks.view(1, h, 1) if bdiag else sinks.view(1, hkv, g, 1).expand(r, hkv, g, 1).reshape(-1, g, 1)
                keep = torch.sigmoid(torch.logsumexp(s32.float(), -1, keepdim=True) - sk)
            torch.softmax(s32, -1, out=s32)  # in place: the kernel works row by row
            if sinks is not None:
                s32.mul_(keep.to(s32.dtype))
            if s32 is not s:
                s.copy_(s32)  # probabilities in the query dtype for the V matmul
            torch.bmm(s, cv.v, out=cv.pv)
        out_rows = out[:nd].view(o_sorted.shape)
        if plan.order is None:
            out_rows.copy_(o_sorted)
        else:
            out_rows.index_copy_(0, plan.order, o_sorted)

    @staticmethod
    def _substitute(cv: _ChunkViews, c: _Chunk, plan: _DecodePlan, exact: tuple, hkv: int, d: int) -> None:
        """Write each chunk row's exact own block (residual + new row) over its dequantized
        K / V in the chunk's compute-dtype buffer."""
        kv_residual, slots, lens, key, value = exact
        kv = cv.kv_cast if cv.kv_cast is not None else cv.kvg
        r = c.end - c.start
        k, v = kv[0].view(r, -1, hkv, d), kv[1].view(r, -1, hkv, d)
        rows = plan.rows[c.start:c.end]
        idx = torch.tensor(rows, device=key.device)
        substitute_exact_block(k, v, kv_residual, slots[c.start:c.end], lens[c.start:c.end],
                               plan.first_pos[c.start:c.end], key.index_select(0, idx),
                               value.index_select(0, idx))
