"""The prefill kernel reading the chunk's own K/V from its contiguous rows (``new_key`` /
``new_value``) and only the cached prefix from the pages, for every KV dtype (Triton
interpreter on the CPU, tiny shapes): causal, ragged batches, chunks over cached prefixes.

Reference: float attention over the cache as the kernel should see it: the prefix as stored
(dequantized for the quantized formats) and the chunk's own keys exactly as computed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import kv_format_for, view_of
from kvserve.attention.kv_quant import dequantize_pages, quantize_pages
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.triton import TritonBackend, prefill_attention, store_kv
from kvserve.core.kv_cache_spec import get_kv_format
from tests.attention.paged_ref import random_block_tables

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must enable the interpreter"

# (cached, new) per request: a whole prompt over several Q tiles and key steps, a chunk over a
# prefix that ends mid key step, a short chunk and a one-token one
REQS = [(0, 19), (21, 10), (5, 3), (7, 1)]


def _batch(name, q_dtype, h, hkv, d, bs, seed, reqs=REQS, num_decodes=0):
    gen = torch.Generator().manual_seed(seed)
    bt, _, num_blocks = random_block_tables(reqs, bs, gen)
    fmt = get_kv_format(name)
    x = torch.randn(2, num_blocks, bs, hkv, d, generator=gen)
    cache = quantize_pages(x, fmt) if fmt.quantized else x.to(getattr(torch, name))
    slots, qsl = [], [0]
    for i, (c, n) in enumerate(reqs):
        slots += [int(bt[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    qlens, slens = [n for _, n in reqs], [c + n for c, n in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), block_tables=bt.to(DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=DEV),
        query_lens_cpu=qlens, seq_lens_cpu=slens, max_query_len=max(qlens), max_seq_len=max(slens),
        num_decodes=num_decodes)
    t = sum(qlens)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(q_dtype).to(DEV) for n in (h, hkv, hkv))
    if not fmt.quantized and not CUDA:  # the interpreter truncates fp32 -> bf16: keep K/V exact in the cache dtype
        k, v = (t.to(getattr(torch, name)).to(q_dtype) for t in (k, v))
    return meta, cache.to(DEV), q, k, v, fmt


def _reference(q, k, v, cache, meta, name, d, scale):
    """torch_ref over a float32 copy of the cache whose new slots of the prefill requests (after
    the ``meta.num_decodes`` decodes, which read their own key from the cache) hold the chunk's
    K/V as computed."""
    fmt = get_kv_format(name)
    ref = dequantize_pages(cache, d, torch.float32, fmt) if fmt.quantized else cache.float()
    ref = ref.clone()
    flat = ref.flatten(1, 2)
    r0 = int(meta.query_start_loc[meta.num_decodes])
    flat[:, meta.slot_mapping[r0:]] = torch.stack([k[r0:].float(), v[r0:].float()])
    no_store = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
    return TorchRefBackend().forward(q.float(), k.float(), v.float(), view_of(ref), no_store, scale)


@pytest.mark.parametrize("name,q_dtype,h", [
    ("float32", torch.float32, 4), ("bfloat16", torch.bfloat16, 6), ("float16", torch.float16, 4),
    ("fp8_e4m3", torch.float32, 4), ("fp8_e4m3", torch.bfloat16, 4), ("int8", torch.float32, 4),
    ("int4", torch.float32, 4), ("int2", torch.float32, 4),
])
def test_prefill_reads_new_kv_from_the_chunk(name, q_dtype, h):
    d, hkv, bs = 16, 2, 4
    meta, cache, q, k, v, fmt = _batch(name, q_dtype, h, hkv, d, bs, seed=len(name) + h)
    kvf = kv_format_for(name, d) if fmt.quantized else None
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kvf)
    scale = d ** -0.5
    ref = _reference(q, k, v, cache, meta, name, d, scale)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS),
                      meta.max_query_len, scale, out=out, kv_format=kvf, new_key=k, new_value=v)
    assert not out.isnan().any()
    tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    if not fmt.quantized:  # the same keys either way: equal to the all-pages path
        old = prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS),
                                meta.max_query_len, scale)
        torch.testing.assert_close(out.float(), old.float(), **tol)


def test_prefill_new_kv_bad_shape_raises():
    meta, cache, q, k, v, _ = _batch("float32", torch.float32, 4, 2, 16, 4, seed=0)
    with pytest.raises(ValueError, match="new_value"):
        prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS),
                          meta.max_query_len, 0.25, new_key=k, new_value=v[:, :1])


def test_backend_fp8_prefill_uses_the_chunk_kv():
    """TritonBackend on an fp8 cache, decodes then prefill chunks in one batch: the prefill rows
    equal the chunk-exact reference, the decode rows read the cache (and the cache holds the
    quantized new rows, as the store kernel writes them)."""
    d = 16
    meta, cache, q, k, v, fmt = _batch("fp8_e4m3", torch.float32, 4, 2, d, 4, seed=5,
                                       reqs=[(9, 1), (3, 1), (0, 19), (21, 10)], num_decodes=2)
    c_ref = cache.clone()
    out = TritonBackend().forward(q, k, v, view_of(cache, "fp8_e4m3", d), meta, d ** -0.5)
    store_kv(k, v, c_ref, meta.slot_mapping, kv_format=kv_format_for("fp8_e4m3", d))
    assert torch.equal(cache.view(torch.uint8), c_ref.view(torch.uint8))
    ref = _reference(q, k, v, cache, meta, "fp8_e4m3", d, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
