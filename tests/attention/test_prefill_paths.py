"""The prefill kernel against the float reference (Triton interpreter on the CPU, tiny shapes):
key tiles spanning several pages, one page, or part of one; chunks over cached prefixes of several
pages; both the chunk-K/V path and the all-pages path; the FP8 Q K^T dot (``PREFILL_PATHS``'s
``fp8_qk``); the tile config table (``PREFILL_CONFIGS``)."""

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
