"""The prefill kernel's tree-mask path (tree verification of speculative drafts): each query row
of a tree request sees the cached prefix and its own ancestors only, checked against an explicit
dense mask built from parent indices, for every KV dtype the prefill reads (Triton interpreter on
the CPU, tiny shapes), in a batch beside a plain causal chunk; the torch reference agrees."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.attention.kv_format import kv_format_for, view_of
from kvserve.attention.kv_quant import dequantize_pages
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.triton import prefill_attention, store_kv
from kvserve.core.kv_cache_spec import get_kv_format
from kvserve.spec_decode.tree import tree_ancestor_bits
from tests.attention.test_prefill_new_kv import DEV, _batch

# (cached, new): a tree of 7 rows (root + 6 nodes), a plain causal chunk, a tree of 10 rows past
# one Q tile (8 tokens with GQA 2 in the interpreter's 16-row tile)
REQS = [(9, 7), (0, 6), (21, 10)]
PARENTS = {0: [-1, -1, 0, 0, 1, 3], 2: [-1, -1, -1, 0, 0, 1, 2, 3, 6]}
# request 2's tree starts LEAD keys into its cached prefix (as an EAGLE head's draft levels do):
# row t sees cached key c - LEAD + j iff (t + j) is even
LEAD = 3


def _tree_meta(meta):
    bits = torch.full((sum(n for _, n in REQS),), -1, dtype=torch.int64)
    start = torch.tensor([c + n for c, n in REQS], dtype=torch.int32)  # plain rows: no tree keys
    r0 = 0
    for i, (c, n) in enumerate(REQS):
        if i in PARENTS:
            bits[r0:r0 + n] = torch.from_numpy(tree_ancestor_bits(PARENTS[i]))
            start[i] = c
            if i == 2:
                lead = torch.tensor([sum(1 << j for j in range(LEAD) if (t + j) % 2 == 0) for t in range(n)])
                bits[r0:r0 + n] = (bits[r0:r0 + n] << LEAD) | lead
                start[i] = c - LEAD
        r0 += n
    return dataclasses.replace(meta, tree_mask=bits.to(DEV), tree_start=start.to(DEV))


def _explicit(q, k, v, cache, meta, name, d, scale):
    """Dense float32 attention per request with the mask from the parent lists."""
    fmt = get_kv_format(name)
    ref = (dequantize_pages(cache, d, torch.float32, fmt) if fmt.quantized else cache.float()).clone()
    flat = ref.flatten(1, 2)
    flat[:, meta.slot_mapping] = torch.stack([k.float(), v.float()])
    out = torch.empty(q.shape, dtype=torch.float32)
    bs, hkv = cache.shape[2], cache.shape[3]
    g = q.shape[1] // hkv
    r0 = 0
    for i, (c, n) in enumerate(REQS):
        L = c + n
        slots = [int(meta.block_tables[i, p // bs]) * bs + p % bs for p in range(L)]
        kk, vv = flat[0, slots].cpu(), flat[1, slots].cpu()  # [L, hkv, d]
        mask = torch.zeros(n, L, dtype=torch.bool)
        for t in range(n):
            mask[t, :c] = True
            if i == 2:
                for j in range(LEAD):
                    mask[t, c - LEAD + j] = (t + j) % 2 == 0
            if i in PARENTS:
                a = t
                while a >= 0:
                    mask[t, c + a] = True
                    a = PARENTS[i][a - 1] + 1 if a > 0 else -1
            else:
                mask[t, :c + t + 1] = True
        qq = q[r0:r0 + n].float().cpu()  # [n, h, d]
        s = torch.einsum("nhd,lhd->hnl", qq, kk.repeat_interleave(g, 1)) * scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        out[r0:r0 + n] = torch.einsum("hnl,lhd->nhd", p, vv.repeat_interleave(g, 1))
        r0 += n
    return out


# The tree mask applies to the scores after any format's loads and scales: float, bf16 (widened in
# the interpreter) and 8-bit codes keep the CI time down; float16 / int8 / int4 / int2 pass too
# (add them here to run them).
@pytest.mark.parametrize("name,q_dtype", [
    ("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp8_e4m3", torch.float32),
])
def test_tree_mask_prefill_equals_explicit_mask(name, q_dtype):
    d, hkv, h, bs = 16, 1, 2, 4
    meta, cache, q, k, v, fmt = _batch(name, q_dtype, h, hkv, d, bs, seed=3 + len(name), reqs=REQS)
    meta = _tree_meta(meta)
    kvf = kv_format_for(name, d) if fmt.quantized else None
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kvf)
    scale = d ** -0.5
    ref = _explicit(q, k, v, cache, meta, name, d, scale)
    tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    out = prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS),
                            meta.max_query_len, scale, kv_format=kvf, new_key=k, new_value=v,
                            tree_mask=meta.tree_mask, tree_start=meta.tree_start)
    torch.testing.assert_close(out.float().cpu(), ref, **tol)
    if name == "float32":  # every key from the pages; and the torch reference backend
        out = prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS),
                                meta.max_query_len, scale, tree_mask=meta.tree_mask, tree_start=meta.tree_start)
        torch.testing.assert_close(out.float().cpu(), ref, **tol)
        no_store = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
        out = TorchRefBackend().forward(q, k, v, view_of(cache), no_store, scale)
        torch.testing.assert_close(out.float().cpu(), ref, **tol)


def test_tree_mask_with_sliding_window_refused():
    meta, cache, q, k, v, _ = _batch("float32", torch.float32, 4, 2, 16, 4, seed=0, reqs=REQS)
    meta = _tree_meta(meta)
    with pytest.raises(ValueError, match="tree_mask"):
        prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, len(REQS),
                          meta.max_query_len, 0.25, sliding_window=8, tree_mask=meta.tree_mask,
                          tree_start=meta.tree_start)
