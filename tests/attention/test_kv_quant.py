"""Quantized KV formats: round-trip error bounds (known answers), the row and page layouts, and the
cpu backend against torch_ref (the oracle) on every format: GQA, ragged lengths across block
boundaries, mixed decode + prefill, prefix hits into quantized blocks, copy-on-write."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.attention.cpu_backend import CpuBackend
from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import kv_format_for, view_of
from kvserve.attention.kv_quant import (MIN_SCALE, aligned_for_vector_loads, copy_slots, dequantize,
                                        dequantize_pages, page_views, pages_to_rows, quantize, quantize_pages,
                                        rows_to_pages)
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.core.kv_cache_spec import KV_FORMATS, FullAttentionSpec, get_kv_format
from tests.attention.paged_ref import random_block_tables

QUANT = ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]
ALL = ["float32", "bfloat16", "float16"] + QUANT
# Worst-case |x - dq(q(x))| / max|x| per row: half a code step of the format
# (fp8: half an ulp at the top binade, relative 2^-4 (e4m3) / 2^-3 (e5m2); int8: 0.5/127;
# int4/int2: half of range/(2^b - 1), range <= 2 max|x|), plus fp16 scale rounding.
ROW_REL_BOUND = {"fp8_e4m3": 2 ** -4 + 1e-3, "fp8_e5m2": 2 ** -3 + 1e-3, "int8": 0.5 / 127 + 1e-3,
                 "int4": 1 / 15 + 2e-3, "int2": 1 / 3 + 2e-3}


@pytest.mark.parametrize("name", QUANT)
def test_round_trip_error_bound(name):
    fmt = get_kv_format(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen) * torch.rand(64, 3, 1, generator=gen) * 10
    rows = quantize(x, fmt)
    assert rows.shape == (64, 3, fmt.row_elems(64)) and rows.dtype == getattr(torch, fmt.torch_dtype)
    assert torch.equal(kv_format_for(name, 64).quantize(x).view(torch.uint8), rows.view(torch.uint8))
    y = dequantize(rows, 64, torch.float32, fmt)
    err = (x - y).abs().amax(-1) / x.abs().amax(-1)
    assert err.max() <= ROW_REL_BOUND[name]
    # not just bounded: a typical element's error is well under the worst case
    assert ((x - y).abs() / x.abs().amax(-1, keepdim=True)).mean() < ROW_REL_BOUND[name] / 2


def test_known_answers():
    x = torch.tensor([[0.0, 1.0, -2.0, 4.0] * 4])  # one row, D = 16, max |x| = 4
    # int8: scale 4/127, codes round(x * 127 / 4); stored scale is float16.
    r = quantize(x, KV_FORMATS["int8"])
    s = torch.tensor(4 / 127, dtype=torch.float16)
    assert r[0, :4].tolist() == [0, 32, -64, 127]  # 31.75 -> 32, -63.5 -> -64 (half up)
    assert r[0, 16:].contiguous().view(torch.uint8).view(torch.float16).item() == s.item()
    # int4: min -2, max 4, scale 6/15 = 0.4: codes (x + 2) / 0.4 = 5, 7.5 -> 8, 0, 15.
    r = quantize(x, KV_FORMATS["int4"])
    assert r.shape == (1, 8 + 4)
    assert r[0, :2].tolist() == [5 | (8 << 4), 0 | (15 << 4)]
    y = dequantize(r, 16, torch.float32, KV_FORMATS["int4"])
    assert torch.allclose(y[0, :4], torch.tensor([0.0, 1.2, -2.0, 4.0]), atol=2e-3)
    # int2: scale 2: codes 1, 1.5 -> 2, 0, 3 packed in one byte.
    r = quantize(x, KV_FORMATS["int2"])
    assert r[0, 0].item() == 1 | (2 << 2) | (0 << 4) | (3 << 6)
    # fp8: 4 -> 448 exactly at the top of e4m3; zeros stay zero.
    r = quantize(x, KV_FORMATS["fp8_e4m3"])
    assert r[0, :4].float().tolist() == [0.0, 112.0, -224.0, 448.0]
    # a constant row: the scale floors at MIN_SCALE, no NaN.
    z = dequantize(quantize(torch.full((1, 16), 3.0), KV_FORMATS["int2"]), 16, torch.float32, KV_FORMATS["int2"])
    assert torch.isfinite(z).all() and torch.allclose(z, torch.full((1, 16), 3.0), atol=MIN_SCALE * 3)


def test_page_size_and_capacity_exact():
    """Bytes per block (scales included) and the capacity ratios vs bfloat16 (SmolLM2: 3 KV
    heads x 64, block 16): the block count a budget buys scales as the spec says."""
    pages = {n: FullAttentionSpec(16, 3, 64, n, "bfloat16").page_size_bytes for n in ALL}
    assert pages == {"float32": 24576, "bfloat16": 12288, "float16": 12288, "fp8_e4m3": 6336, "fp8_e5m2": 6336,
                     "int8": 6336, "int4": 3456, "int2": 1920}
    budget = 30 * 12288 * 16  # bytes
    blocks = {n: budget // p for n, p in pages.items()}
    assert blocks["bfloat16"] == 480 and blocks["int8"] == 930 and blocks["int4"] == 1706 and blocks["int2"] == 3072
    assert blocks["int8"] / blocks["bfloat16"] >= 1.9
    assert blocks["int4"] / blocks["bfloat16"] >= 3.5
    assert blocks["int2"] / blocks["bfloat16"] >= 6
    assert get_kv_format("fp8") is KV_FORMATS["fp8_e4m3"]
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int3'.*fp8_e5m2.*int2"):
        get_kv_format("int3")


def _meta(reqs, block_size, bt):
    slots, qsl = [], [0]
    for i, (c, n) in enumerate(reqs):
        slots += [int(bt[i, p // block_size]) * block_size + p % block_size for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    qlens, slens = [n for _, n in reqs], [c + n for c, n in reqs]
    nd = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=bt.clone(),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(slens, dtype=torch.int32),
        query_lens_cpu=qlens, seq_lens_cpu=slens, max_query_len=max(qlens), max_seq_len=max(slens),
        num_decodes=nd)


def _quant_cache(num_blocks, bs, hkv, d, name, gen):
    fmt = get_kv_format(name)
    vals = torch.randn(2, num_blocks, bs, hkv, d, generator=gen)
    return quantize_pages(vals, fmt)


@pytest.mark.parametrize("name", QUANT)
def test_cpu_backend_matches_torch_ref(name):
    """Ragged decodes + chunked prefills over a quantized paged prefix, GQA 6:2, block 4."""
    gen = torch.Generator().manual_seed(1)
    bs, h, hkv, d = 4, 6, 2, 32
    reqs = [(13, 1), (4, 1), (0, 1), (7, 5), (0, 9)]  # (cached, new): decodes first
    bt, nbs, num_blocks = random_block_tables(reqs, bs, gen)
    meta = _meta(reqs, bs, bt)
    t = sum(n for _, n in reqs)
    for dtype in (torch.float32, torch.bfloat16):
        cache = _quant_cache(num_blocks, bs, hkv, d, name, gen)
        q = torch.randn(t, h, d, generator=gen).to(dtype) * 2
        k, v = torch.randn(t, hkv, d, generator=gen).to(dtype), torch.randn(t, hkv, d, generator=gen).to(dtype)
        c_ref, c_cpu = cache.clone(), cache.clone()
        ref = TorchRefBackend().forward(q, k, v, view_of(c_ref, name, d), dataclasses.replace(meta), d ** -0.5)
        out = CpuBackend().forward(q, k, v, view_of(c_cpu, name, d), dataclasses.replace(meta), d ** -0.5)
        assert torch.equal(c_cpu.view(torch.uint8), c_ref.view(torch.uint8))
        tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(out, ref, **tol)
        # The oracle itself: dense attention over dequantized K/V equals torch_ref.
        kd = dequantize_pages(c_ref[0], d, torch.float32, get_kv_format(name))
        vd = dequantize_pages(c_ref[1], d, torch.float32, get_kv_format(name))
        i, (cached, new) = 3, reqs[3]
        L = cached + new
        kk = kd[bt[i, :nbs[i]].long()].reshape(-1, hkv, d)[:L].transpose(0, 1).repeat_interleave(h // hkv, 0)
        vv = vd[bt[i, :nbs[i]].long()].reshape(-1, hkv, d)[:L].transpose(0, 1).repeat_interleave(h // hkv, 0)
        qq = q[meta.query_start_loc[i]:meta.query_start_loc[i + 1]].float().transpose(0, 1)
        mask = torch.arange(L)[None, :] <= torch.arange(cached, L)[:, None]
        dense = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=d ** -0.5)
        torch.testing.assert_close(ref[meta.query_start_loc[i]:meta.query_start_loc[i + 1]].float(),
                                   dense.transpose(0, 1), **tol)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_prefix_hit_and_copy_on_write_carry_scales(name):
    """A request reusing another's quantized blocks (prefix hit) and a copy-on-write copy of a
    partial block (bytes incl. scales) attend exactly as the original request does."""
    gen = torch.Generator().manual_seed(2)
    bs, h, hkv, d = 4, 4, 2, 16
    cache = _quant_cache(8, bs, hkv, d, name, gen)
    # Request A: 10 tokens in blocks 1, 2, 3 (last partial, 2 slots). Request B shares blocks 1, 2
    # and a copy of block 3's first 2 slots in block 5 (copy-on-write), then both decode 1 token.
    copy_slots(cache, d, torch.tensor([3 * bs, 3 * bs + 1]), torch.tensor([5 * bs, 5 * bs + 1]), get_kv_format(name))
    q = torch.randn(2, h, d, generator=gen)
    k = torch.randn(1, hkv, d, generator=gen).expand(2, hkv, d)
    v = torch.randn(1, hkv, d, generator=gen).expand(2, hkv, d)
    bt = torch.tensor([[1, 2, 3], [1, 2, 5]], dtype=torch.int32)
    meta = _meta([(10, 1), (10, 1)], bs, bt)
    for be in (TorchRefBackend(), CpuBackend()):
        meta_i = dataclasses.replace(meta)
        out = be.forward(torch.cat([q[:1], q[:1]]), k, v, view_of(cache.clone(), name, d), meta_i, 0.25)
        torch.testing.assert_close(out[0], out[1], atol=0, rtol=0)


@pytest.mark.parametrize("name", QUANT)
def test_page_layout_known_answers(name):
    """A hand-built page: byte k of the codes of slot t, KV head h sits at (t * Hkv + h) * C + k
    of its block's page; its float16 scale (and minimum) at block_size * Hkv * C + (h * block_size + t) * S
    (scales head-major, so one head's scales of consecutive slots are contiguous)."""
    fmt = get_kv_format(name)
    nb, bs, hkv, d = 3, 4, 3, 32
    c, s = d * fmt.bits // 8, fmt.scale_bytes_per_token_head // 2
    x = torch.randn(2, nb, bs, hkv, d, generator=torch.Generator().manual_seed(5)) * 3
    rows = quantize(x, fmt)
    pages = quantize_pages(x, fmt)
    assert pages.shape == rows.shape == (2, nb, bs, hkv, c + s) and pages.dtype == rows.dtype
    page = bs * hkv * (c + s)
    flat = pages.view(torch.uint8).reshape(2, nb, page)
    rb = rows.view(torch.uint8)
    for kv, blk, t, h in [(0, 0, 0, 0), (1, 2, 3, 2), (0, 1, 2, 1), (1, 0, 1, 0)]:
        r = (t * hkv + h)
        assert torch.equal(flat[kv, blk, r * c:(r + 1) * c], rb[kv, blk, t, h, :c])
        sc = bs * hkv * c + (h * bs + t) * s
        assert torch.equal(flat[kv, blk, sc:sc + s], rb[kv, blk, t, h, c:])
        want = rb[kv, blk, t, h, c:].contiguous().view(torch.float16)
        assert flat[kv, blk, sc:sc + 2].contiguous().view(torch.float16).item() == want[0].item()
    # every byte is accounted for: codes region then scales region, nothing else
    assert torch.equal(flat[..., :bs * hkv * c].reshape(2, nb, bs, hkv, c), rb[..., :c])
    assert torch.equal(flat[..., bs * hkv * c:].reshape(2, nb, hkv, bs, s), rb[..., c:].transpose(2, 3))
    codes, scales = page_views(pages, d, fmt)
    assert codes.shape == (2, nb, bs, hkv, c) and scales.shape == (2, nb, bs, hkv, s // 2)
    assert scales.dtype == torch.float16 and codes.data_ptr() == pages.data_ptr()
    assert torch.equal(pages_to_rows(pages, d, fmt).view(torch.uint8), rb)
    assert torch.equal(rows_to_pages(rows, d, fmt).view(torch.uint8), flat.view(pages.shape))
    assert torch.equal(dequantize_pages(pages, d, torch.float32, fmt), dequantize(rows, d, torch.float32, fmt))
    # the views write the page: a new scale lands in the scales region only
    scales[1, 2, 3, 2, 0] = 7.0
    sc = bs * hkv * c + (2 * bs + 3) * s
    assert flat[1, 2, sc:sc + 2].contiguous().view(torch.float16).item() == 7.0
    # gathered pages (e.g. a tier's copy of blocks 2, 0) convert the same way
    g = pages[0].view(torch.uint8).index_select(0, torch.tensor([2, 0])).view(pages.dtype)
    assert torch.equal(pages_to_rows(g, d, fmt).view(torch.uint8), rb[0, [2, 0]])


def test_copy_slots_carries_codes_and_scales():
    fmt = get_kv_format("int4")
    bs, hkv, d = 4, 2, 32
    pages = quantize_pages(torch.randn(2, 5, bs, hkv, d, generator=torch.Generator().manual_seed(6)), fmt)
    before = pages_to_rows(pages, d, fmt)
    copy_slots(pages, d, torch.tensor([4, 5, 6]), torch.tensor([12, 13, 14]), fmt)  # block 1 slots 0-2 -> block 3
    after = pages_to_rows(pages, d, fmt)
    want = before.clone()
    want[:, 3, :3] = before[:, 1, :3]
    assert torch.equal(after, want)


def test_vector_load_alignment_rule():
    """Codes start on 16-byte boundaries iff D * bits / 8 and the page are multiples of 16."""
    f = get_kv_format
    assert aligned_for_vector_loads(f("fp8_e4m3"), 128, 16, 8)
    assert aligned_for_vector_loads(f("int4"), 128, 16, 8)
    assert aligned_for_vector_loads(f("int2"), 64, 16, 1)
    assert not aligned_for_vector_loads(f("int2"), 32, 16, 8)  # 8 code bytes per row
    assert not aligned_for_vector_loads(f("int8"), 64, 4, 3)  # page 4 * 3 * 66 bytes
    assert aligned_for_vector_loads(f("bfloat16"), 16, 1, 1)
    # the page size (capacity) is the same as the per-row layout's
    spec = FullAttentionSpec(16, 8, 128, "fp8_e4m3", "bfloat16")
    assert spec.page_size_bytes == 2 * 16 * 8 * (128 + 2)
