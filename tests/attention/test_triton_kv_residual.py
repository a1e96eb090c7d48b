"""Triton kernels with the exact own-block residual (``kvserve/attention/kv_residual.py``),
TRITON_INTERPRET=1 on the CPU at tiny shapes, against TorchRefBackend given the same residual:
int4 / int2 (rotated in the kernels, with and without the value rotation folded into the
weights) and fp8 (not rotated), GQA, ragged lengths across block boundaries, decodes
(direct and split, the own block straddling splits), prefill chunks (ctx not a block multiple,
chunks over >= 3 blocks), a padding row, a sliding window; and the residual written after the step."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from kvserve.attention.forward_context import AttentionMetadata, ResidualMetadata
from kvserve.attention.kv_format import kv_format_for, view_of
from kvserve.attention.kv_quant import quantize_pages
from kvserve.attention.kv_residual import residual_shape, residual_slot_mapping, written_early
from kvserve.attention.kv_rotation import rotate, rotation_matrix
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.triton import TritonBackend, decode_attention, prefill_attention, store_kv
from kvserve.core.kv_cache_spec import get_kv_format
from tests.attention.paged_ref import random_block_tables
from tests.utils import gpu_only

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must enable the interpreter"

# (cached, new) per request, decodes first: decodes mid-block, at a block start (the own block
# is only the new row), in the first block (no cache keys) and at a block's last slot; then
# prefill chunks: from 0 over >= 3 blocks, ctx not a block multiple over >= 3 blocks, one
# inside a block.
MIXED = [(19, 1), (16, 1), (5, 1), (31, 1), (0, 13), (6, 11), (9, 2)]


def _batch(reqs, bs, hkv, d, name, gen, dtype=torch.float32, pad=0):
    """meta (with residual slots / mapping), a random quantized cache, a random residual; ``pad``
    extra token rows past the last request (slot -1, residual scratch slot)."""
    bt, _, num_blocks = random_block_tables(reqs, bs, gen)
    cache = quantize_pages(torch.randn(2, num_blocks, bs, hkv, d, generator=gen), get_kv_format(name))
    num_slots = len(reqs) + 1  # one slot no request uses
    rslots = torch.randperm(num_slots, generator=gen)[: len(reqs)]
    slots, qsl, pos, tok_len, tok_slot = [], [0], [], [], []
    for i, (c, n) in enumerate(reqs):
        slots += [int(bt[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
        pos += list(range(c, c + n))
        tok_len += [c + n] * n
        tok_slot += [int(rslots[i])] * n
    rmap = residual_slot_mapping(np.array(pos + [0] * pad), np.array(tok_len + [0] * pad),
                                 np.array(tok_slot + [0] * pad), bs, num_slots)
    rmap[len(pos):] = num_slots * 2 * bs  # padding rows: the scratch slot
    qlens, slens = [n for _, n in reqs], [c + n for c, n in reqs]
    nd = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64, device=DEV), block_tables=bt.to(DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=DEV),
        query_lens_cpu=qlens, seq_lens_cpu=slens, max_query_len=max(qlens), max_seq_len=max(slens),
        num_decodes=nd, residual=ResidualMetadata(rslots.to(torch.int32).to(DEV), torch.from_numpy(rmap).to(DEV),
                                                  rslots.tolist(), written_early(qlens, slens, bs)))
    res = torch.randn(residual_shape(num_slots, bs, hkv, d), generator=gen).to(dtype).to(DEV)
    return meta, cache.to(DEV), res


def _fresh(meta):
    return dataclasses.replace(meta)


def _view(cache, name, d, residual, rotation=None, values_rotated=False):
    """The layer view of ``cache`` (format ``name``) with its exact filling block."""
    view = view_of(cache, name, d, residual=residual)
    view.rotation, view.values_rotated = rotation, values_rotated
    return view


def _run(reqs, name, bs, h, hkv, d, splits, values_rotated, window=None, dtype=torch.float32, seed=0, pad=0):
    """Triton (rotating in its kernels when the format rotates) vs torch_ref on the float32-rotated
    inputs, same residual: outputs of the real rows, caches and residuals after the step."""
    gen = torch.Generator().manual_seed(seed)
    meta, cache, res = _batch(reqs, bs, hkv, d, name, gen, dtype, pad)
    t = sum(n for _, n in reqs)
    q, k, v = (torch.randn(t + pad, n, d, generator=gen).to(dtype).to(DEV) for n in (h, hkv, hkv))
    c_ref, res_ref = cache.clone(), res.float().clone()
    if get_kv_format(name).rotated:
        r = rotation_matrix(d, DEV)
        v_in = rotate(v, r) if values_rotated else v
        out = TritonBackend(splits).forward(q, k, v_in, _view(cache, name, d, res, r, values_rotated), _fresh(meta),
                                            d ** -0.5, window)
        rot = [q.float() @ r, k.float() @ r, v_in.float() if values_rotated else v.float() @ r]
        ref = TorchRefBackend().forward(*rot, _view(c_ref, name, d, res_ref), _fresh(meta), d ** -0.5, window)
        ref = ref if values_rotated else ref @ r.T
    else:
        out = TritonBackend(splits).forward(q, k, v, _view(cache, name, d, res), _fresh(meta), d ** -0.5, window)
        ref = TorchRefBackend().forward(q.float(), k.float(), v.float(), _view(c_ref, name, d, res_ref), _fresh(meta),
                                        d ** -0.5, window)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out[:t].float(), ref[:t].float(), **tol)
    torch.testing.assert_close(res.float(), res_ref, **tol)
    return out[:t], ref[:t]


@pytest.mark.parametrize("name,values_rotated,splits", [
    ("int4", False, 1), ("int4", True, 3), ("int2", False, 3), ("int2", True, 1)])
def test_mixed_batch_equals_torch_ref(name, values_rotated, splits):
    """Decodes + prefill chunks + a padding row, GQA 4/2, head dim 64 (the decode kernel's
    bit-lane path), block 8 (< the interpreter's BLOCK_N of 16)."""
    _run(MIXED, name, bs=8, h=4, hkv=2, d=64, splits=splits, values_rotated=values_rotated, pad=1)


@pytest.mark.parametrize("splits", [1, 2, gpu_only(5)])  # 5: the path of 2, slower in the interpreter
def test_decodes_own_block_straddles_splits(splits):
    """Block 32 > BLOCK_N: a decode's own block spans two key steps, and split boundaries
    (2 and 5 splits of BLOCK_N-aligned slices) fall inside it; int4, GQA 4/2."""
    reqs = [(50, 1), (33, 1), (31, 1), (64, 1), (12, 1)]
    _run(reqs, "int4", bs=32, h=4, hkv=2, d=16, splits=splits, values_rotated=False, seed=1)


def test_prefill_only_int2_block_32():
    """Prefill only, block 32 > BLOCK_N: own blocks span several key steps and query tiles."""
    _run([(0, 40), (37, 30)], "int2", bs=32, h=4, hkv=2, d=16, splits=1, values_rotated=True, seed=2)


@pytest.mark.parametrize("splits", [gpu_only(1), 3])  # 1: covered by 3's first split
def test_sliding_window(splits):
    """A window of 6 < the block (8): some own-block keys fall out of it (decodes and prefill rows)."""
    _run(MIXED, "int4", bs=8, h=4, hkv=2, d=16, splits=splits, values_rotated=False, window=6, seed=3)


def test_bfloat16_and_wide_groups():
    """bfloat16 activations and residual (the kernels' float32 widening in the interpreter),
    int4; 8 query heads per KV head."""
    _run(MIXED[:2] + MIXED[4:6], "int4", bs=8, h=8, hkv=1, d=32, splits=2, values_rotated=False,
         dtype=torch.bfloat16, seed=4)


def test_wide_group_rotated_around_the_kernels():
    """40 query heads per KV head (> 32: the backend rotates q, k, v in torch around the kernels,
    the new rows are then the torch-rotated ones), int2."""
    _run(MIXED[:1] + MIXED[5:], "int2", bs=8, h=40, hkv=1, d=16, splits=2, values_rotated=False, seed=8)


# The interpreter compiles nothing: one warm-up there; the outputs of both are checked above.
@pytest.mark.parametrize("values_rotated", [gpu_only(False), True])
def test_warmup_compiles_residual_variants(values_rotated):
    """``warmup`` of a view with an exact filling block runs every residual kernel variant (int4)
    and stores nothing."""
    cache = quantize_pages(torch.randn(2, 3, 8, 2, 16), get_kv_format("int4")).to(DEV)
    before = cache.clone()
    dt = torch.bfloat16 if CUDA else torch.float32
    view = _view(cache, "int4", 16, torch.zeros(residual_shape(2, 8, 2, 16), dtype=dt, device=DEV),
                 rotation_matrix(16, DEV), values_rotated)
    TritonBackend().warmup(view, 4, dt, {None, 5})
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_fp8_kernels_with_fast_codes(monkeypatch):
    """fp8 e4m3 (not rotated) at kernel level, with the integer-built codes (their /256 code scale
    must not touch the exact part): decode (1 and 3 splits) + prefill vs torch_ref."""
    from kvserve.attention.triton import kv_load

    monkeypatch.setitem(kv_load.CODE_PATHS, "fast_cvt", True)
    gen = torch.Generator().manual_seed(5)
    bs, h, hkv, d = 4, 4, 2, 16
    meta, cache, res = _batch(MIXED, bs, hkv, d, "fp8_e4m3", gen)
    t = sum(n for _, n in MIXED)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(DEV) for n in (h, hkv, hkv))
    fmt = kv_format_for("fp8_e4m3", d)
    ref = TorchRefBackend().forward(q, k, v, _view(cache.clone(), "fp8_e4m3", d, res.clone()), _fresh(meta), d ** -0.5)
    store_kv(k, v, cache, meta.slot_mapping, kv_format=fmt)
    kw = dict(kv_residual=res, residual_slots=meta.residual.slots, new_key=k, new_value=v, kv_format=fmt)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                         meta.max_seq_len, d ** -0.5, out=out, num_splits=splits, **kw)
        prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                          len(MIXED) - meta.num_decodes, meta.max_query_len, d ** -0.5, out=out, **kw)
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


def test_store_kernel_writes_rotated_rows():
    """``store_kv(key_out=, value_out=)``: the cache-basis rows (``k R``, ``v R``) for every token,
    unstored (slot -1) ones included; with ``rotate_value=False`` only ``k R``."""
    gen = torch.Generator().manual_seed(6)
    bs, d, hkv = 8, 32, 3
    meta, cache, _ = _batch([(0, 3)], bs, hkv, d, "int4", gen)
    k, v = (torch.randn(3, hkv, d, generator=gen).to(DEV) for _ in range(2))
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    r = rotation_matrix(d, DEV)
    ko, vo = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    fmt = kv_format_for("int4", d)
    store_kv(k, v, cache, slots, rotate=True, key_out=ko, value_out=vo, kv_format=fmt)
    torch.testing.assert_close(ko, k @ r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vo, v @ r, atol=1e-5, rtol=1e-5)
    ko = torch.full_like(k, float("nan"))
    store_kv(k, v, cache, slots, rotate=True, rotate_value=False, query=k, key_out=ko, kv_format=fmt)
    torch.testing.assert_close(ko, k @ r, atol=1e-5, rtol=1e-5)


def test_residual_is_read_and_own_block_pages_are_not():
    """Changing a residual row of an own-block position changes the outputs of the queries in
    that block; changing the cache page rows of own-block positions changes nothing."""
    gen = torch.Generator().manual_seed(7)
    bs, h, hkv, d = 8, 4, 2, 16
    reqs = [(19, 1), (6, 1), (4, 2)]  # decodes at 19 (own block 16..19) and 6; a chunk at 4..5 (block 0)
    meta, cache, res = _batch(reqs, bs, hkv, d, "int4", gen)
    q, k, v = (torch.randn(4, n, d, generator=gen).to(DEV) for n in (h, hkv, hkv))
    r = rotation_matrix(d, DEV)

    def run(c, x):
        return TritonBackend(2).forward(q, k, v, _view(c.clone(), "int4", d, x.clone(), r), _fresh(meta), d ** -0.5)

    base = run(cache, res)
    slots = meta.residual.slots_cpu
    res2 = res.clone()
    res2[0, slots[0], 0, 17 % bs] += 1.0  # request 0: key 17 (block 2, parity 0)
    res2[1, slots[2], 0, 2] += 1.0  # request 2: value 2 (block 0)
    out = run(cache, res2)
    assert (out[0] - base[0]).abs().max() > 1e-3 and (out[2:] - base[2:]).abs().max() > 1e-3
    torch.testing.assert_close(out[1], base[1])  # request 1 reads its own slot
    # page rows of the own blocks (block 2 of request 0, block 0 of requests 1 and 2): replaced
    c2 = cache.clone()
    for i, blk in ((0, 2), (1, 0), (2, 0)):
        c2[:, int(meta.block_tables[i, blk])] = cache[:, 0]  # the null block's random rows
    torch.testing.assert_close(run(c2, res), base, atol=0, rtol=0)
