"""Triton store / decode / prefill kernels on quantized KV caches (TRITON_INTERPRET=1 on the
CPU, tiny shapes), against torch_ref reading the same bytes: every quantized format, GQA,
ragged lengths across block boundaries, chunked prefill over a quantized prefix."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import kv_format_for, view_of
from kvserve.attention.kv_quant import aligned_for_vector_loads, dequantize, pages_to_rows, quantize_pages
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.attention.torch_ref import store_kv as ref_store_kv
from kvserve.attention.triton import TritonBackend, decode_attention, prefill_attention, store_kv
from kvserve.attention.triton.kv_load import _byte_codes
from kvserve.core.kv_cache_spec import get_kv_format
from tests.attention.paged_ref import random_block_tables
from tests.utils import cpu_subset

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must enable the interpreter"

QUANT = ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]
# Row max / one code step (fp8: an ulp at the top binade).
LEVELS = {"fp8_e4m3": 448 / 32, "fp8_e5m2": 57344 / 8192, "int8": 127, "int4": 7.5, "int2": 1.5}


def _triton_outputs(q, cache, meta, num_reqs, d, name):
    """The decode (1 and 2 KV splits) + prefill kernels' outputs over one batch, NaN-poisoned first."""
    outs = []
    fmt = kv_format_for(name, d)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                         meta.max_seq_len, d ** -0.5, out=out, num_splits=splits, kv_format=fmt)
        prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                          num_reqs - meta.num_decodes, meta.max_query_len, d ** -0.5, out=out, kv_format=fmt)
        outs.append(out)
    return outs


def _batch(reqs, bs, hkv, d, name, gen):
    """(cached, new) per request, decodes first; a quantized cache with random prefixes."""
    bt, nbs, num_blocks = random_block_tables(reqs, bs, gen)
    cache = quantize_pages(torch.randn(2, num_blocks, bs, hkv, d, generator=gen), get_kv_format(name))
    slots, qsl = [], [0]
    for i, (c, n) in enumerate(reqs):
        slots += [int(bt[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    qlens, slens = [n for _, n in reqs], [c + n for c, n in reqs]
    nd = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), block_tables=bt.to(DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=DEV),
        query_lens_cpu=qlens, seq_lens_cpu=slens, max_query_len=max(qlens), max_seq_len=max(slens),
        num_decodes=nd)
    return meta, cache.to(DEV)


@pytest.mark.parametrize("name", QUANT)
def test_store_quantizes_like_torch_ref(name):
    gen = torch.Generator().manual_seed(0)
    t, hkv, d = 6, 3, 32  # 3 heads: a padded head lane in the kernel
    meta, cache = _batch([(0, t)], 4, hkv, d, name, gen)
    k = (torch.randn(t, hkv, d, generator=gen) * 3).to(DEV)
    v = torch.randn(t, hkv, d, generator=gen).to(DEV)
    c_tri, c_ref = cache.clone(), cache.clone()
    store_kv(k, v, c_tri, meta.slot_mapping, kv_format=kv_format_for(name, d))
    ref_store_kv(k, v, view_of(c_ref, name, d), meta.slot_mapping)
    slots = meta.slot_mapping
    fmt = get_kv_format(name)
    rows_tri, rows_ref = pages_to_rows(c_tri, d, fmt), pages_to_rows(c_ref, d, fmt)  # the page layout as per-slot rows
    a = rows_tri.flatten(1, 2)[:, slots]
    b = rows_ref.flatten(1, 2)[:, slots]
    same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()
    assert same >= 0.98, same  # ties may round differently; nothing else
    x = torch.stack([k, v])
    da, db = dequantize(a, d, torch.float32, fmt), dequantize(b, d, torch.float32, fmt)
    step = x.abs().amax(-1, keepdim=True) / LEVELS[name]  # one code step (upper bound) per row
    assert ((da - db).abs() <= step * 1.01 + 1e-6).all()
    assert ((da - x).abs() <= step * 0.51 + 1e-3 * step + 1e-6).all() or name.startswith("fp8")
    # Slots not in slot_mapping are untouched.
    mask = torch.ones(c_tri.shape[1] * c_tri.shape[2], dtype=torch.bool, device=DEV)
    mask[slots] = False
    rows0 = pages_to_rows(cache, d, fmt)
    untouched = rows0.flatten(1, 2)[:, mask].view(torch.uint8)
    assert torch.equal(rows_tri.flatten(1, 2)[:, mask].view(torch.uint8), untouched)


@pytest.mark.parametrize("name,q_dtype", [(n, torch.float32) for n in QUANT] + [("int8", torch.bfloat16)])
def test_decode_and_prefill_read_quantized_cache(name, q_dtype):
    """Decodes (split and direct) and prefill chunks over quantized prefixes equal torch_ref
    reading the same bytes."""
    gen = torch.Generator().manual_seed(1)
    bs, h, hkv, d = 4, 4, 2, 16
    reqs = [(9, 1), (3, 1), (0, 1), (5, 6), (0, 7)]
    meta, cache = _batch(reqs, bs, hkv, d, name, gen)
    t = sum(n for _, n in reqs)
    q = torch.randn(t, h, d, generator=gen).to(q_dtype).to(DEV)
    k = torch.randn(t, hkv, d, generator=gen).to(q_dtype).to(DEV)
    v = torch.randn(t, hkv, d, generator=gen).to(q_dtype).to(DEV)
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kv_format_for(name, d))
    ref = TorchRefBackend().forward(q, k, v, view_of(cache.clone(), name, d), dataclasses.replace(meta), d ** -0.5)
    tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for out in _triton_outputs(q, cache, meta, len(reqs), d, name):
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_backend_forward_quantized_with_window():
    """The registered backend end to end (store + both kernels) with a sliding window."""
    gen = torch.Generator().manual_seed(2)
    meta, cache = _batch([(6, 1), (2, 5)], 4, 1, 16, "int4", gen)
    q = torch.randn(6, 2, 16, generator=gen).to(DEV)
    k, v = torch.randn(6, 1, 16, generator=gen).to(DEV), torch.randn(6, 1, 16, generator=gen).to(DEV)
    c_ref = cache.clone()
    out = TritonBackend().forward(q, k, v, view_of(cache, "int4", 16), meta, 0.25, 3)
    ref = TorchRefBackend().forward(q, k, v, view_of(c_ref, "int4", 16), dataclasses.replace(meta), 0.25, 3)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)  # int4 stores may differ at ties


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3", "int4"])
def test_warmup_takes_the_head_size_not_the_packed_row(name):
    """Start-up compiles every kernel variant from the layer's head size: a quantized cache's
    last dim is a packed row (codes + scales), never a head size (it broke fp8/int4 on CUDA)."""
    fmt = get_kv_format(name)
    d, hkv = 16, 2
    if fmt.quantized:
        cache = quantize_pages(torch.randn(2, 3, 4, hkv, d), fmt).to(DEV)
        assert cache.shape[-1] != d
    else:
        cache = torch.zeros(2, 3, 4, hkv, d, dtype=torch.bfloat16, device=DEV)
    before = cache.clone()
    TritonBackend().warmup(view_of(cache, name, d), 4, torch.bfloat16 if CUDA else torch.float32, {None})
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # warm-up stores nothing


@pytest.mark.parametrize("name,bs,hkv,d,h", [
    ("fp8_e4m3", 16, 2, 128, 4),  # head_dim 128, block 16: 16-byte aligned code rows and pages
    ("int4", 16, 2, 128, 4),
    ("int2", 16, 1, 64, 2),  # 16 code bytes per row: the smallest aligned int2 row
    ("int8", 4, 3, 16, 3),  # page of 4 * 3 * 18 bytes: not a multiple of 16 (narrow loads, still correct)
    ("int2", 8, 3, 32, 6),  # 8 code bytes per row: rows not 16-byte aligned
])
def test_page_layout_shapes(name, bs, hkv, d, h):
    """Store + decode (split and direct) + prefill at real head sizes and at shapes whose code
    rows / pages are not 16-byte aligned: the kernels equal torch_ref on the same pages."""
    fmt = get_kv_format(name)
    aligned = aligned_for_vector_loads(fmt, d, bs, hkv)
    assert aligned == (d * fmt.bits // 8 % 16 == 0 and bs * hkv * fmt.row_elems(d) % 16 == 0)
    gen = torch.Generator().manual_seed(3)
    reqs = [(bs + 3, 1), (5, 1), (2, 2 * bs - 1)]  # batch 2 decodes (one across a block edge) + a prefill
    meta, cache = _batch(reqs, bs, hkv, d, name, gen)
    t = sum(n for _, n in reqs)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(DEV) for n in (h, hkv, hkv))
    c_ref = cache.clone()
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kv_format_for(name, d))
    ref = TorchRefBackend().forward(q, k, v, view_of(c_ref, name, d), dataclasses.replace(meta), d ** -0.5)
    # the Triton store wrote the page layout: same bytes as torch_ref's store (up to rounding ties)
    same = (cache.view(torch.uint8) == c_ref.view(torch.uint8)).float().mean().item()
    assert same >= 0.98, same
    ref = TorchRefBackend().forward(q, k, v, view_of(cache.clone(), name, d), dataclasses.replace(
                                    meta, slot_mapping=torch.full_like(meta.slot_mapping, -1)), d ** -0.5)
    for out in _triton_outputs(q, cache, meta, len(reqs), d, name):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,bs,block_n,window", [
    ("fp8_e4m3", 32, 16, None),  # BLOCK_N < block_size: a tile's scales are one run of one page
    ("int4", 8, 32, None),  # BLOCK_N > block_size: one run of scales per page of the tile
    ("int2", 4, 16, 7),  # a window whose first key is not a multiple of BLOCK_N
])
def test_decode_scale_tiles(name, bs, block_n, window):
    """The decode kernel's per-page vector loads of head-major scales (``kv_scale_index``) for
    tiles smaller and larger than a block, with and without a sliding window, equal torch_ref;
    the scales region holds each head's slots contiguously (the store kernel wrote it so)."""
    from kvserve.attention.kv_quant import page_views

    fmt = get_kv_format(name)
    gen = torch.Generator().manual_seed(4)
    h, hkv, d = 4, 2, 64
    reqs = [(2 * bs + 5, 1), (bs - 1, 1), (40, 1)]
    meta, cache = _batch(reqs, bs, hkv, d, name, gen)
    t = len(reqs)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(DEV) for n in (h, hkv, hkv))
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kv_format_for(name, d))
    # head-major scales: the bytes after the codes are [Hkv, block_size, S] per page
    _, scales = page_views(cache, d, fmt)
    c = d * fmt.bits // 8
    tail = cache.view(torch.uint8).flatten(-3)[..., bs * hkv * c:]
    want = scales.transpose(-3, -2).contiguous().view(torch.uint8).flatten(-3)
    assert torch.equal(tail, want)
    ref = TorchRefBackend().forward(q, k, v, view_of(cache.clone(), name, d), dataclasses.replace(  # stored once
        meta, slot_mapping=torch.full_like(meta.slot_mapping, -1)), d ** -0.5, window)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, t, meta.max_seq_len,
                         d ** -0.5, window, out=out, num_splits=splits, block_n=block_n,
                         kv_format=kv_format_for(name, d))
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@triton.jit
def _convert_codes(src, dst, KV_FMT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(dst + offs, _byte_codes(tl.load(src + offs).to(tl.int32), KV_FMT, tl.float16, True))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_fast_byte_codes_every_code(name):
    """``FAST_CVT``'s integer-built float16 of each of the 256 8-bit codes equals the torch
    conversion (e4m3: / 256, subnormals included); non-finite fp8 codes are never stored."""
    from kvserve.attention.triton.kv_load import KV_FMT_CODES

    codes = torch.arange(256, dtype=torch.int32)
    out = torch.empty(256, dtype=torch.float16)
    _convert_codes[(1,)](codes.to(DEV), out := out.to(DEV), KV_FMT=KV_FMT_CODES[name])
    fmt = get_kv_format(name)
    want = codes.to(torch.uint8).view(getattr(torch, fmt.torch_dtype)).float()
    if name == "fp8_e4m3":
        want = want / 256
    finite = torch.isfinite(want)
    assert finite.sum() >= 248  # e5m2: 2 infinities, 6 NaNs
    assert torch.equal(out.cpu().float()[finite], want[finite])


# The interpreter runs every code path with float32 queries and one per KV dtype with bfloat16.
@pytest.mark.parametrize("name,fast_cvt,lane_split,q_dtype", cpu_subset(
    [(n, f, ls, q) for n, f, ls in [
        *((n, f, False) for n in ("fp8_e4m3", "fp8_e5m2", "int8") for f in (False, True)),
        *((n, f, ls) for n in ("int4", "int2") for f in (False, True) for ls in (False, True))]
     for q in (torch.float32, torch.bfloat16)],
    [(n, f, ls, q) for n, f, ls in [
        *((n, f, False) for n in ("fp8_e4m3", "fp8_e5m2", "int8") for f in (False, True)),
        *((n, f, ls) for n in ("int4", "int2") for f in (False, True) for ls in (False, True))]
     for q in (torch.float32,)]
    + [("fp8_e4m3", True, False, torch.bfloat16), ("fp8_e5m2", False, False, torch.bfloat16),
       ("int8", True, False, torch.bfloat16), ("int4", True, True, torch.bfloat16),
       ("int2", False, True, torch.bfloat16)]))
def test_decode_code_paths_agree(name, fast_cvt, lane_split, q_dtype):
    """Every quantized-code path of the decode kernel (conversion instructions or integer-built
    float16; 4-/2-bit codes interleaved or one dot per bit lane) equals torch_ref, head dim 64."""
    gen = torch.Generator().manual_seed(5)
    bs, h, hkv, d = 8, 4, 2, 64
    reqs = [(19, 1), (0, 1), (33, 1)]
    meta, cache = _batch(reqs, bs, hkv, d, name, gen)
    t = len(reqs)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(q_dtype).to(DEV) for n in (h, hkv, hkv))
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kv_format_for(name, d))
    ref = TorchRefBackend().forward(q, k, v, view_of(cache.clone(), name, d), dataclasses.replace(
        meta, slot_mapping=torch.full_like(meta.slot_mapping, -1)), d ** -0.5)
    tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, t, meta.max_seq_len,
                         d ** -0.5, out=out, num_splits=splits, block_n=32, fast_cvt=fast_cvt,
                         lane_split=lane_split, kv_format=kv_format_for(name, d))
        torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_decode_v_bytes_equals_the_word_path(name):
    """``v_bytes`` (8-bit V codes read as bytes into the operand layout, ``DecodeConfig.v_bytes``)
    computes the same values as the default 2-byte-word path, and torch_ref's."""
    gen = torch.Generator().manual_seed(9)
    bs, h, hkv, d = 8, 4, 2, 32
    reqs = [(21, 1), (40, 1)]
    meta, cache = _batch(reqs, bs, hkv, d, name, gen)
    q, k, v = (torch.randn(len(reqs), n, d, generator=gen).to(DEV) for n in (h, hkv, hkv))
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kv_format_for(name, d))
    ref = TorchRefBackend().forward(q, k, v, view_of(cache.clone(), name, d), dataclasses.replace(
        meta, slot_mapping=torch.full_like(meta.slot_mapping, -1)), d ** -0.5)
    outs = []
    for v_bytes in (False, True):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, len(reqs),
                         meta.max_seq_len, d ** -0.5, out=out, num_splits=2, block_n=16,
                         kv_format=kv_format_for(name, d), v_bytes=v_bytes)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outs[1], ref.float(), atol=1e-4, rtol=1e-4)


def _run_lane_asm(asm: str, word: int) -> list[int]:
    """Emulates the PTX of ``kv_load._lane_asm`` / ``_lane_asm_i8`` on one input register (4 packed bytes): the
    output registers as 32-bit words (each two float16)."""
    import re

    import numpy as np

    def f16x2(x):
        return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)

    def word_of(h):
        b = np.asarray(h, dtype=np.float16).view(np.uint16)
        return int(b[0]) | int(b[1]) << 16

    regs, outs = {}, {}
    # $n read: the input (the asm never reads its outputs)
    val = lambda a: int(a, 0) if a[0].isdigit() else (word if a.startswith("$") else regs[a])  # noqa: E731
    for line in asm.split("\n"):
        m = re.match(r"(\S+) (.*);$", line.strip())
        if not m or m[1] == ".reg":
            continue
        op, args = m[1], [a.strip() for a in m[2].split(",")]
        if op == "mov.b32":
            r = val(args[1])
        elif op == "prmt.b32":  # bytes of {b, a} picked by the selector's nibbles
            src = val(args[1]).to_bytes(4, "little") + val(args[2]).to_bytes(4, "little")
            r = int.from_bytes(bytes(src[(val(args[3]) >> 4 * i) & 7] for i in range(4)), "little")
        elif op == "and.b32":
            r = val(args[1]) & val(args[2])
        elif op == "shr.b32":
            r = val(args[1]) >> val(args[2])
        elif op == "lop3.b32":
            assert args[4] == "0xEA"  # (a & b) | c
            r = (val(args[1]) & val(args[2])) | val(args[3])
        elif op == "sub.f16x2":
            r = word_of(f16x2(val(args[1])) - f16x2(val(args[2])))
        elif op == "fma.rn.f16x2":  # exact here: every product and sum is a small integer
            a, b, c = (f16x2(val(x)).astype(np.float32) for x in args[1:4])
            r = word_of((a * b + c).astype(np.float16))
        else:
            raise AssertionError(op)
        (outs if args[0].startswith("$") else regs)[args[0]] = r
    return [outs[f"${i}"] for i in range(len(outs))]


@pytest.mark.parametrize("bits", [4, 2])
def test_lane_asm_i8_cuts_every_code(bits):
    """The int8-lane PTX (``asm_i8qk``'s K codes, emulated): each output register holds lane
    ``i`` of the four input bytes, as bytes, in element order."""
    from kvserve.attention.triton.kv_load import _lane_asm_i8

    asm = _lane_asm_i8(bits)
    for first in range(0, 256, 4):
        byts = [first, (first * 7 + 1) % 256, (first * 13 + 2) % 256, 255 - first]
        out = _run_lane_asm(asm, int.from_bytes(bytes(byts), "little"))
        for lane in range(8 // bits):
            want = [(b >> bits * lane) & ((1 << bits) - 1) for b in byts]
            assert list(out[lane].to_bytes(4, "little")) == want, (bits, lane, byts)


@pytest.mark.parametrize("bits", [4, 2])
def test_lane_asm_builds_every_code(bits):
    """The inline PTX of the "asm" unpack path (emulated) turns 4 packed bytes into each bit
    lane's codes as float16, in element order, for every byte value."""
    import numpy as np

    from kvserve.attention.triton.kv_load import _lane_asm

    asm = _lane_asm(bits)
    for first in range(0, 256, 4):
        byts = [first, (first * 7 + 1) % 256, (first * 13 + 2) % 256, 255 - first]
        out = _run_lane_asm(asm, int.from_bytes(bytes(byts), "little"))
        for lane in range(8 // bits):
            halves = np.array([out[2 * lane] & 0xFFFF, out[2 * lane] >> 16,
                               out[2 * lane + 1] & 0xFFFF, out[2 * lane + 1] >> 16], dtype=np.uint16)
            want = [(b >> bits * lane) & ((1 << bits) - 1) for b in byts]
            assert halves.view(np.float16).tolist() == want, (bits, lane, byts)


def test_unpack_path_choice():
    """asm unpacking only for 4-/2-bit codes, on CUDA, with float16 operands; an unknown name
    is a ValueError."""
    from kvserve.attention.triton.kv_load import KV_FMT_CODES, use_unpack

    int4, int2, fp8 = KV_FMT_CODES["int4"], KV_FMT_CODES["int2"], KV_FMT_CODES["fp8_e4m3"]
    assert use_unpack(int4, True, True, "asm") == use_unpack(int2, True, True, "asm") == 1
    assert use_unpack(fp8, True, True, "asm") == 0
    assert use_unpack(int4, False, True, "asm") == 0  # the interpreter runs no PTX
    assert use_unpack(int4, True, False, "asm") == 0  # float32 operands
    assert use_unpack(int4, True, True, "int32") == 0
    assert use_unpack(int2, True, True, "asm_i8qk") == 2
    with pytest.raises(ValueError, match="unpack must be one of"):
        use_unpack(int4, True, True, "uint4")


@pytest.mark.skipif(not CUDA, reason="inline PTX: CUDA only")
@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("block_n,num_warps", [(32, 4), (64, 2), (128, 4)])
def test_decode_unpack_asm_equals_int32(name, block_n, num_warps):
    """The decode kernel's "asm" bit lanes give the same codes as the integer path, so the
    outputs are bitwise equal, at several tile shapes (head dim 128, bf16 queries); "asm_i8qk"
    (int8 queries) stays close."""
    gen = torch.Generator().manual_seed(11)
    bs, h, hkv, d = 16, 16, 8, 128
    reqs = [(300, 1), (0, 1), (129, 1), (17, 1)]
    meta, cache = _batch(reqs, bs, hkv, d, name, gen)
    t = len(reqs)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(torch.bfloat16).to(DEV) for n in (h, hkv, hkv))
    store_kv(k, v, cache, meta.slot_mapping, kv_format=kv_format_for(name, d))
    outs = {}
    for unpack in ("int32", "asm", "asm_i8qk"):
        for splits in (1, 3):
            out = torch.full_like(q, float("nan"))
            decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, t,
                             meta.max_seq_len, d ** -0.5, out=out, num_splits=splits, block_n=block_n,
                             num_warps=num_warps, lane_split=True, unpack=unpack, kv_format=kv_format_for(name, d))
            outs[unpack, splits] = out
    for splits in (1, 3):
        assert not outs["asm", splits].isnan().any()
        assert torch.equal(outs["asm", splits], outs["int32", splits])
        # int8 queries: within a code step of the query's maximum / 127 of the float16 scores
        torch.testing.assert_close(outs["asm_i8qk", splits].float(), outs["int32", splits].float(),
                                   atol=2e-2, rtol=2e-2)


# The interpreter runs one case per path: int4 and int2, the fused path in both activation dtypes,
# more than 32 query heads per KV head (rotated around the kernels), two q chunks of 32 rows.
@pytest.mark.parametrize("name,h,hkv,q_dtype,values_rotated", cpu_subset(
    [(n, h, hkv, q, vr) for n, h, hkv in [("int4", 4, 2), ("int2", 4, 2), ("int4", 66, 1), ("int4", 40, 8)]
     for q in (torch.float32, torch.bfloat16) for vr in (False, True)],
    [("int4", 4, 2, q, vr) for q in (torch.float32, torch.bfloat16) for vr in (False, True)]
    + [("int2", 4, 2, torch.float32, False), ("int2", 4, 2, torch.bfloat16, True),
       ("int4", 66, 1, torch.float32, False), ("int4", 66, 1, torch.float32, True),
       ("int4", 40, 8, torch.float32, True)]))
def test_fused_rotation_equals_rotating_around_the_backend(name, h, hkv, q_dtype, values_rotated):
    """Triton with ``kv_rotation`` equals torch_ref given the float32-rotated q, k, v: the same
    outputs, and the same rotated rows in the cache.

    - ``values_rotated=False``: q, K, V rotated inside the store and decode kernels, the output
      rotated back (prefill rows, and groups of more than 32 query heads, rotated around the
      kernels);
    - ``values_rotated=True`` (the weights hold the value rotation): v arrives as ``v R``, the
      store kernel rotates K and q (40 heads: two q chunks of 32 rows), the output stays rotated.
    """
    from kvserve.attention.kv_rotation import rotate, rotation_matrix

    gen = torch.Generator().manual_seed(6)
    bs, d = 8, 64
    reqs = [(19, 1), (0, 1), (9, 6), (0, 5)]  # decodes, then prefill chunks (one over a cached prefix)
    meta, cache = _batch(reqs, bs, hkv, d, name, gen)
    t = sum(n for _, n in reqs)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(q_dtype).to(DEV) for n in (h, hkv, hkv))
    r = rotation_matrix(d, DEV)
    c_ref = cache.clone()
    v_in = rotate(v, r) if values_rotated else v
    view = view_of(cache, name, d, rotate=True)
    view.values_rotated = values_rotated
    out = TritonBackend().forward(q, k, v_in, view, meta, d ** -0.5)
    around = max(h // hkv, hkv) > 32  # rotated in torch, in the activations' dtype, around the kernels
    rot = [rotate(x, r).float() if around else x.float() @ r for x in (q, k)]
    rot.append(v_in.float() if values_rotated else rotate(v, r).float() if around else v.float() @ r)
    ref = TorchRefBackend().forward(*rot, view_of(c_ref, name, d), dataclasses.replace(meta), d ** -0.5)
    ref = ref if values_rotated else ref @ r.T
    tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    fmt = kv_format_for(name, d)
    torch.testing.assert_close(fmt.dequantize_pages(cache, torch.float32), fmt.dequantize_pages(c_ref, torch.float32),
                               atol=1e-3, rtol=1e-3)


def test_store_kernel_rotates_the_query():
    """``store_kv(..., query=q)`` returns ``q R`` for every row, padding slots included."""
    from kvserve.attention.kv_rotation import rotation_matrix

    gen = torch.Generator().manual_seed(2)
    bs, d, h, hkv = 8, 32, 9, 3
    meta, cache = _batch([(0, 3)], bs, hkv, d, "int4", gen)
    q, k, v = (torch.randn(3, n, d, generator=gen).to(DEV) for n in (h, hkv, hkv))
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    qr = store_kv(k, v, cache, slots, rotate=True, rotate_value=False, query=q, kv_format=kv_format_for("int4", d))
    torch.testing.assert_close(qr, q @ rotation_matrix(d, DEV), atol=1e-5, rtol=1e-5)
