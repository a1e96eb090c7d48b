"""The prefill kernel against the float reference (Triton interpreter on the CPU, tiny shapes):
key tiles spanning several pages, one page, or part of one; chunks over cached prefixes of several
pages; both the chunk-K/V path and the all-pages path; the FP8 Q K^T and P V dots and the
other ``PREFILL_PATHS`` switches; the tile config table (``PREFILL_CONFIGS``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.attention.kv_format import kv_format_for, view_of
from kvserve.attention.kv_quant import dequantize_pages
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.triton import prefill_attention, store_kv
from kvserve.attention.triton.prefill import PREFILL_CONFIGS, _config
from tests.attention.test_prefill_new_kv import _batch, _reference

# (cached, new): a whole prompt over two Q tiles, chunks over prefixes of several pages (mid-page ends)
REQS = [(0, 11), (37, 5), (50, 1)]


@pytest.mark.parametrize("name,q_dtype,bs,new_kv", [
    ("bfloat16", torch.bfloat16, 4, True),   # a 16-key tile spans 4 pages
    ("float32", torch.float32, 16, False),   # one page per tile, every key from the pages
    ("fp8_e4m3", torch.float32, 32, True),   # a tile is half a page
])
def test_key_tiles_across_pages_equal_reference(name, q_dtype, bs, new_kv):
    d, hkv, h = 16, 2, 4
    meta, cache, q, k, v, fmt = _batch(name, q_dtype, h, hkv, d, bs, seed=bs + len(name), reqs=REQS)
    kvf = kv_format_for(name, d) if fmt.quantized else None
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kvf)
    scale = d ** -0.5
    kw = dict(new_key=k, new_value=v) if new_kv else {}
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS), meta.max_query_len, scale)
    out = prefill_attention(*args, kv_format=kvf, **kw)
    if new_kv:  # the chunk's own keys as computed, the prefix as stored
        ref = _reference(q, k, v, cache, meta, name, d, scale)
    else:  # every key as stored
        no_store = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
        ref = TorchRefBackend().forward(q.float(), k.float(), v.float(), view_of(cache.float()), no_store, scale)
    tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_fp8_qk_dot_equals_quantized_query_reference():
    """e4m3 cache, every key from the pages, Q K^T as an FP8 dot: equal to float attention over
    the dequantized cache with each query row rounded to e4m3 as the kernel does (row / its
    largest magnitude * 448), so the path is really taken and its only error is that rounding."""
    d, hkv, h, bs = (32 if torch.cuda.is_available() else 16), 2, 4, 4  # Hopper's FP8 dot needs K >= 32
    meta, cache, q, k, v, fmt = _batch("fp8_e4m3", torch.float32, h, hkv, d, bs, seed=3, reqs=REQS)
    kvf = kv_format_for("fp8_e4m3", d)
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kvf)
    scale = d ** -0.5
    out = prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS),
                            meta.max_query_len, scale, kv_format=kvf, fp8_qk=True)
    qn = q.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    q8 = (q / qn * 448.0).to(torch.float8_e4m3fn).float() * (qn / 448.0)
    deq = dequantize_pages(cache, d, torch.float32, fmt)
    no_store = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
    ref = TorchRefBackend().forward(q8, k, v, view_of(deq), no_store, scale)
    exact_q = TorchRefBackend().forward(q, k, v, view_of(deq), no_store, scale)
    assert (ref - exact_q).abs().max() > 1e-3  # the rounding shows, so the check below sees the path
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


def test_config_table_and_shared_memory_fallback(monkeypatch):
    """The table's entry for bf16 at d 128; a GPU with less shared memory than the entry needs
    gets the two-stage config instead."""
    import kvserve.attention.triton.prefill as pf

    assert _config(128, torch.bfloat16, 4, False, 0) == PREFILL_CONFIGS[("16bit", "d<=128")]
    assert _config(128, torch.bfloat16, 4, False, 1) == PREFILL_CONFIGS[("fp8", "d<=128")]
    monkeypatch.setattr(pf, "_max_shared_bytes", lambda i: 166912)  # an A100's opt-in maximum
    assert _config(128, torch.bfloat16, 4, False, 0, 0) == (128, 64, 8, 2)
    monkeypatch.setattr(pf, "_max_shared_bytes", lambda i: 232448)  # an H100 / H200
    assert _config(128, torch.bfloat16, 4, False, 0, 0) == PREFILL_CONFIGS[("16bit", "d<=128")]


@pytest.mark.parametrize("new_kv,page_tiles", [(True, False), (False, True)])
def test_fp8_pv_dot_within_e4m3_bound(new_kv, page_tiles):
    """e4m3 cache, chunks over cached prefixes, GQA (3 query heads a KV head), P V as an FP8 dot
    (``fp8_pv``): each term ``p_j s_j`` is rounded to e4m3 after its row is spread over e4m3's
    range, at most 2^-4 relative error, so per output element ``|out - ref| <= 2^-4 (P |V|) / l``
    (``ref``: float attention over the cache as stored, the chunk's own keys as computed; ``P |V|
    / l`` the same attention over ``|V|``). The error must also show (the path is really taken)."""
    d, hkv, h, bs = 32, 2, 6, 4
    meta, cache, q, k, v, fmt = _batch("fp8_e4m3", torch.float32, h, hkv, d, bs, seed=11, reqs=REQS)
    kvf = kv_format_for("fp8_e4m3", d)
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kvf)
    scale = d ** -0.5
    kw = dict(new_key=k, new_value=v) if new_kv else {}
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS), meta.max_query_len, scale)
    bn = 32 if torch.cuda.is_available() else None  # the FP8 dot's K is the key tile: >= 32 on Hopper
    out = prefill_attention(*args, kv_format=kvf, fp8_pv=True, page_tiles=page_tiles, block_n=bn, **kw)
    base = prefill_attention(*args, kv_format=kvf, **kw)
    deq = dequantize_pages(cache, d, torch.float32, fmt)
    no_store = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
    if new_kv:
        ref = _reference(q, k, v, cache, meta, "fp8_e4m3", d, scale)
        flat = deq.flatten(1, 2)  # |V| bound over the same keys: the new slots as computed
        flat[:, meta.slot_mapping] = torch.stack([k, v])
    else:
        ref = TorchRefBackend().forward(q, k, v, view_of(deq), no_store, scale)
    deq[1] = deq[1].abs()
    bound = TorchRefBackend().forward(q, k, v.abs(), view_of(deq), no_store, scale) * 2.0 ** -4
    err = (out - ref).abs()
    assert (err <= bound + 1e-5).all(), (err - bound).max()
    assert (out - base).abs().max() > 1e-4  # the rounding shows: the FP8 path ran
    torch.testing.assert_close(base, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bs", [4, 32])
def test_page_tiles_and_prefix_stages_equal_default_path(bs):
    """``page_tiles`` reads the block table once per page of a key tile (a tile over 4 pages, or
    half a page) and ``prefix_stages`` only re-pipelines the prefix loop: the same keys at the same
    offsets, so the output equals the default path's."""
    d, hkv, h = 16, 2, 4
    meta, cache, q, k, v, _ = _batch("float32", torch.float32, h, hkv, d, bs, seed=bs, reqs=REQS)
    store_kv(k, v, cache, meta.slot_mapping)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS), meta.max_query_len,
            d ** -0.5)
    for kw in ({}, dict(new_key=k, new_value=v)):
        base = prefill_attention(*args, **kw)
        torch.testing.assert_close(prefill_attention(*args, page_tiles=True, **kw), base, atol=0, rtol=0)
        torch.testing.assert_close(prefill_attention(*args, prefix_stages=5, **kw), base, atol=0, rtol=0)


@pytest.mark.parametrize("name,q_dtype,bs", [
    ("bfloat16", torch.bfloat16, 4),    # a 16-key tile spans 4 pages
    ("fp8_e4m3", torch.float32, 8),     # 2 pages a tile; per-page scale words from the carried ids
])
def test_prefetch_ids_equals_default_path(name, q_dtype, bs):
    """``prefetch_ids``: the unmasked prefix loop loads the next tile's block-table ids a step ahead
    and carries them; the same keys at the same offsets, so the output equals the default path's
    bit for bit, with and without the chunk's own K/V rows, under a shuffled block table (a wrong
    tile's ids would read other keys), and the reference. bf16: the K tile loaded ``[keys, d]`` and
    transposed; e4m3: the scale words from the carried per-page ids. The prefix of 50 keys spans 3
    unmasked 16-key steps."""
    d, hkv, h = 16, 2, 4
    reqs = REQS[1:]
    meta, cache, q, k, v, fmt = _batch(name, q_dtype, h, hkv, d, bs, seed=5 + bs, reqs=reqs)
    kvf = kv_format_for(name, d) if fmt.quantized else None
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kvf)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(reqs), meta.max_query_len,
            d ** -0.5)
    for kw in ([dict(new_key=k, new_value=v)] if fmt.quantized else [{}, dict(new_key=k, new_value=v)]):
        base = prefill_attention(*args, kv_format=kvf, prefetch_ids=False, **kw)
        out = prefill_attention(*args, kv_format=kvf, prefetch_ids=True, **kw)
        torch.testing.assert_close(out, base, atol=0, rtol=0)
    if fmt.quantized:
        return
    ref = TorchRefBackend().forward(q, k, v, view_of(cache), dataclasses.replace(
        meta, slot_mapping=torch.full_like(meta.slot_mapping, -1)), d ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
