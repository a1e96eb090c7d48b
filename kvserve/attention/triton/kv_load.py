"""Reading K/V tiles from the paged cache: the one place the Triton kernels touch its layout.

The decode and prefill kernels call these for every ``BLOCK_N`` keys: ``kv_row_offsets``
maps key positions through the block table to cache offsets, ``load_k_tile`` /
``load_v_tile`` load the tiles and convert them to the ``tl.dot`` operand dtype, and
``prepare_query`` / ``scaled_scores`` / ``pv_update`` do the two products. A new KV storage
format changes these functions (and ``cache_strides``), not the kernels.

Unquantized formats: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` elements of
the cache dtype (K and V halves passed as separate pointers, same strides), read and cast.
Quantized formats (``KV_FMT`` > 0; scheme and page layout in ``kvserve/attention/kv_quant.py``):
the cache is passed as bytes; each block's page holds the codes of its ``[block_size,
num_kv_heads]`` rows (``C = head_dim * bits / 8`` bytes each, contiguous), then their
float16 scales (and minima), head-major. ``cache_strides`` passes the page stride and the
*code* strides (``num_kv_heads * C`` per slot, ``C`` per head); Triton specializes int
arguments divisible by 16, so when ``C`` and the page size are multiples of 16 the compiler
can prove every code row 16-byte aligned and load it as 16-byte vectors (no hint that
could be false). V's codes are loaded as ``[BLOCK_N, C]`` and K's, transposed, as ``[C,
BLOCK_N]``: both contiguous along the channel axis; they are unpacked in registers and
converted to float16, which holds every code exactly; they are never multiplied by their
scales. 4-/2-bit codes are split into bit lanes (``code_lane``: lane ``i`` of a byte holds
element ``j * 8 / bits + i``) and made float16 from the bit pattern ``0x6400 | c`` (= 1024 + c)
with integer ops, no conversion instruction (in the decode kernel on CUDA, two codes per
instruction by inline PTX: ``code_lanes``); the decode kernel multiplies each lane by the
matching query columns (``split_lanes`` / ``merge_lanes``), the prefill kernel interleaves the
lanes into rows (``tl.join`` + ``tl.permute`` + ``tl.reshape``). ``CODE_PATHS`` picks the
paths (measured choices). The scales are folded
into the math instead (per key ``j`` with scale ``s_j`` and minimum ``m_j``, 0 for the
symmetric formats): ``q . k_j = s_j (q . c_j) + m_j sum(q)`` scales the columns of the
score tile, and ``sum_j p_j v_j = sum_j (p_j s_j) c_j + sum_j p_j m_j`` scales P before the
P V dot (``pv_update``). The query is divided by its row maximum before it becomes a
float16 operand (``prepare_query``), so any bfloat16 query fits. The scales of a tile of
keys are read as 4-byte words, one contiguous run per page (``kv_scale_index``: the page's
head-major scales region holds one head's slots consecutively); Triton turns those into
``cp.async`` copies pipelined with the codes. No dequantized copy of the cache exists.
(Compiled for sm_90: ``benchmarks/ptx_kv_loads.py`` shows the load widths.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.kv_format import KERNEL_CODES, KVCacheFormat

#: ``KV_FMT`` constexpr per ``--kv-cache-dtype`` (0: read and cast, no scales)
KV_FMT_CODES = KERNEL_CODES


def kernel_cache_args(kv_cache: torch.Tensor, kv_format: KVCacheFormat | None) -> tuple[torch.Tensor, int]:
    """The cache as the kernels take it (bytes for quantized formats) and its ``KV_FMT``
    (``KVCacheFormat.kernel_code``). ``kv_format`` None: a plain cache of its own float dtype.

    Raises ValueError for a one-byte cache without its format."""
    if kv_format is None:
        if kv_cache.element_size() == 1:
            raise ValueError("a one-byte KV cache is quantized: pass its kv_format")
        return kv_cache, 0
    code = kv_format.kernel_code
    return (kv_cache.view(torch.uint8) if code else kv_cache), code


def cache_strides(k_cache: torch.Tensor, head_size: int, kv_fmt: int) -> tuple[int, int, int, int]:
    """``(stride_cb, stride_co, stride_ch, stride_cd)`` of one half ``[num_blocks, block_size,
    num_kv_heads, row]`` of the cache as the kernels index it: element strides for unquantized
    formats; for quantized ones (bytes) the page stride and the strides of the codes region
    (``num_kv_heads * C`` per slot, ``C`` per head, 1 per byte)."""
    if not kv_fmt:
        return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3)
    _, bs, hkv, row = k_cache.shape
    c = head_size * _BITS[kv_fmt] // 8
    assert k_cache.stride()[1:] == (hkv * row, row, 1), "quantized pages must be contiguous"
    assert c % (row - c) == 0, "code bytes per row must be a multiple of the scale bytes"
    return k_cache.stride(0), hkv * c, c, 1


_BITS = {1: 8, 2: 8, 3: 8, 4: 4, 5: 2}

#: defaults of the quantized-code paths, read at each launch (``decode_attention``'s
#: ``fast_cvt`` / ``lane_split``; the prefill kernel's ``FAST_CVT``); a module dict so a
#: benchmark can switch them for a whole engine run. ``fast_cvt``: True, False or "packed"
#: (4-/2-bit codes only: on an H100, fp8's ``cvt.f16x2.e4m3x2`` beat the integer-built
#: float16 by 1.6x and int8 gained nothing, while int4 gained 7%; benchmarks/gpu_kv_quant.py --code-paths).
#: ``unpack`` (the decode kernel's bit lanes; CUDA and 16-bit queries only): "int32" cuts each
#: lane out of the code bytes with integer ops (the compiler keeps them packed 4 to a register
#: either way: widened or not, the PTX is the same), "asm" builds two float16 codes per
#: instruction from four packed bytes (``code_lanes``: ``prmt`` + ``lop3`` + ``f16x2``
#: arithmetic, as mixed-precision GEMMs do). On an H100 at batch 64 x 8k, default tiles, asm
#: took the kernel from 0.407 to 0.361 ms (int4) and 0.430 to 0.274 ms (int2), 21% fewer PTX
#: instructions (benchmarks/gpu_kv_quant.py --code-paths, benchmarks/ptx_kv_loads.py --ops).
#: "asm_i8qk" (opt-in): as "asm" for V; the query rounded to int8 per row (the row's maximum is
#: 127) and q . K an int8 tensor-core product on the codes, which then need only a shift and a
#: mask: 8-10% faster on an H100, at 3-4x the float16 paths' error (BENCHMARKS.md).
CODE_PATHS = {"fast_cvt": "packed", "lane_split": True, "unpack": "asm"}
_UNPACK_CODES = {"int32": 0, "asm": 1, "asm_i8qk": 2}


def use_fast_cvt(kv_fmt: int, override: bool | None = None) -> bool:
    """Whether format ``kv_fmt`` builds its float16 codes with integer ops (``CODE_PATHS``)."""
    v = CODE_PATHS["fast_cvt"] if override is None else override
    return kv_fmt >= 4 if v == "packed" else bool(v)


def use_lane_split(kv_fmt: int, head_size: int, override: bool | None = None) -> bool:
    """Whether the decode kernel multiplies 4-/2-bit codes one bit lane at a time: asked for
    (``CODE_PATHS``) and possible (a lane holds ``head_size * bits / 8`` >= 16 values per row,
    ``tl.dot``'s minimum K)."""
    v = CODE_PATHS["lane_split"] if override is None else override
    return bool(v) and kv_fmt >= 4 and head_size * _BITS[kv_fmt] // 8 >= 16


def use_unpack(kv_fmt: int, on_cuda: bool, fp16_codes: bool, override: str | None = None) -> int:
    """The decode kernel's ``UNPACK`` constexpr (``CODE_PATHS["unpack"]``): 1 for "asm", 2 for
    "asm_i8qk", with 4-/2-bit codes on CUDA and float16 code operands; else 0 (inline PTX has
    no interpreter). Raises ValueError for an unknown name."""
    v = CODE_PATHS["unpack"] if override is None else override
    if v not in _UNPACK_CODES:
        raise ValueError(f"unpack must be one of {sorted(_UNPACK_CODES)}, got {v!r}")
    return _UNPACK_CODES[v] if (kv_fmt >= 4 and on_cuda and fp16_codes) else 0


@triton.jit
def kv_row_offsets(bt_row, pos, n_mask, kv_head_off, stride_cb, stride_co,
                   BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Offsets ``[BLOCK_N]`` (int64) of keys ``pos`` of one request and KV head: the element
    offset of each row (quantized: the byte offset of its codes). ``bt_row`` points at the
    request's block-table row; ``n_mask`` (used when ``MASKED``) keeps positions past the
    valid range from reading the table (they read page 0).
    """
    if MASKED:
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
    return page * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head_off


@triton.jit
def kv_tile_offsets(bt_row, n0, kv_end, kv_head_off, stride_cb, stride_co, BLOCK_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """``kv_row_offsets`` of keys ``n0 .. n0 + BLOCK_N - 1`` with the block table read once per
    page, not once per key: ``NP = BLOCK_N / BLOCK_SIZE`` page ids (one when the tile fits in a
    page) broadcast over their slots. ``n0`` must be a multiple of ``min(BLOCK_N, BLOCK_SIZE)``
    (the decode loop starts at multiples of BLOCK_N). Pages at or past ``kv_end`` read page 0
    (their keys are masked by the caller). Returns ``[BLOCK_N]`` int64 offsets."""
    NP: tl.constexpr = BLOCK_N // BLOCK_SIZE if BLOCK_N > BLOCK_SIZE else 1
    SLOTS: tl.constexpr = BLOCK_N // NP
    pidx = n0 // BLOCK_SIZE + tl.arange(0, NP)
    page = tl.load(bt_row + pidx, mask=pidx * BLOCK_SIZE < kv_end, other=0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    if NP == 1:
        key_page = tl.sum(page, 0) + j * 0
        slot = n0 % BLOCK_SIZE + j
    else:  # each key's page picked from the NP ids by a select (no reshape: that stops the pipelining)
        key_page = tl.sum(tl.where((j // SLOTS)[:, None] == tl.arange(0, NP)[None, :], page[None, :], 0), 1)
        slot = j % SLOTS
    return key_page * stride_cb + slot.to(tl.int64) * stride_co + kv_head_off


@triton.jit
def kv_scale_index(bt_row, n0, kv_end, kv_head_off, stride_cb, stride_co, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr, MASKED: tl.constexpr):
    """Indices ``[NP, W]`` of the 4-byte words holding the scales of keys ``n0 .. n0 + BLOCK_N - 1``
    of one KV head (``NP`` pages, ``W`` words each; a word holds two float16 scales, or one
    scale + minimum), in words from the cache base. ``n0`` must be a multiple of ``BLOCK_N``
    (the kernels align their loops): then each page contributes consecutive words of its
    head-major scales region, which the compiler can prove contiguous and 4-byte aligned, so
    the load is an asynchronous copy pipelined with the codes (2-byte loads are not). Every
    index lies in a real page (pages at or past ``kv_end``, the end of the request's keys,
    read page 0): no load mask needed."""
    NP: tl.constexpr = BLOCK_N // BLOCK_SIZE if BLOCK_N > BLOCK_SIZE else 1
    pidx = n0 // BLOCK_SIZE + tl.arange(0, NP)
    if MASKED:
        page = tl.load(bt_row + pidx, mask=pidx * BLOCK_SIZE < kv_end, other=0)
    else:
        page = tl.load(bt_row + pidx)
    return kv_scale_words(page, n0, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, BLOCK_N, HEAD_DIM, KV_FMT)


@triton.jit
def kv_scale_words(page, n0, kv_head_off, stride_cb, stride_co, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr):
    """``kv_scale_index`` from the tile's page ids ``page [NP]`` (int32) already loaded."""
    BITS: tl.constexpr = 4 if KV_FMT == 4 else (2 if KV_FMT == 5 else 8)
    SB: tl.constexpr = 4 if KV_FMT >= 4 else 2  # scale bytes per row
    CB: tl.constexpr = HEAD_DIM * BITS // 8
    NP: tl.constexpr = BLOCK_N // BLOCK_SIZE if BLOCK_N > BLOCK_SIZE else 1
    SLOTS: tl.constexpr = BLOCK_N // NP
    kvh = kv_head_off // CB
    # the head's scales, page-relative, in words (page, codes region and rows are 4-byte multiples)
    base = (BLOCK_SIZE * stride_co) // 4 + kvh * (BLOCK_SIZE * SB // 4)
    if NP == 1:  # BLOCK_N <= BLOCK_SIZE: one page, keys from n0 % BLOCK_SIZE (a multiple of BLOCK_N)
        base += tl.multiple_of((n0 % BLOCK_SIZE) * SB // 4, BLOCK_N * SB // 4)
    return page.to(tl.int64)[:, None] * (stride_cb // 4) + base + tl.arange(0, SLOTS * SB // 4)[None, :]


@triton.jit
def load_scales(cache_ptr, sc_idx, n_mask, KV_FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per key ``[BLOCK_N]``: the float32 scale and minimum (0 for symmetric formats) from the
    words at ``sc_idx`` (``kv_scale_index``); masked keys get 0 for both."""
    w = tl.load(cache_ptr.to(tl.pointer_type(tl.int32)) + sc_idx)
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if KV_FMT >= 4:  # scale in the low half of a word, minimum in the high half
        s = tl.reshape(lo, [BLOCK_N])
        z = tl.where(n_mask, tl.reshape(hi, [BLOCK_N]), 0.0)
    else:  # two consecutive slots' scales, the first in the low half
        s = tl.reshape(tl.join(lo, hi), [BLOCK_N])
        z = s * 0.0
    return tl.where(n_mask, s, 0.0), z


@triton.jit
def _code_rows(cache_ptr, row_off, n_mask, HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr, MASKED: tl.constexpr,
               out_dtype: tl.constexpr, FAST_CVT: tl.constexpr = False, V_BYTES: tl.constexpr = False):
    """Codes ``[BLOCK_N, HEAD_DIM]`` as ``out_dtype`` values (the V tile, not scaled): each
    key's ``C`` contiguous bytes at ``row_off``, unpacked; masked keys are 0. ``V_BYTES`` (8-bit
    codes, no ``FAST_CVT``): loaded as bytes and converted element-wise, so the compiler reads them
    from shared memory straight into the dot operand's layout (byte-wide shared loads: the operand
    registers hold consecutive keys) and converts there, with no float16 copy through shared memory."""
    BITS: tl.constexpr = 4 if KV_FMT == 4 else (2 if KV_FMT == 5 else 8)
    CB: tl.constexpr = HEAD_DIM * BITS // 8
    if KV_FMT <= 3 and V_BYTES and not FAST_CVT:
        x = _byte_codes(load_code_bytes(cache_ptr, row_off, n_mask, CB, MASKED, True), KV_FMT, out_dtype, False)
    elif KV_FMT <= 3:
        # 8-bit codes read as 2-byte words and split in registers (join + reshape): converted
        # in the load's layout, the tile reaches the dot operand as 16-bit values (transposing
        # loads); converted in the operand layout, it would take byte-wide shared loads.
        offs_w = tl.arange(0, CB // 2)
        ptrs = (cache_ptr + row_off[:, None]).to(tl.pointer_type(tl.int16)) + offs_w[None, :]
        if MASKED:
            w = tl.load(ptrs, mask=n_mask[:, None], other=0)
        else:
            w = tl.load(ptrs)
        w = w.to(tl.int32)
        if FAST_CVT:  # each byte converted where it is, then the halves interleaved
            x = tl.reshape(tl.join(_byte_codes(w & 0xFF, KV_FMT, out_dtype, True),
                                   _byte_codes((w >> 8) & 0xFF, KV_FMT, out_dtype, True)),
                           [row_off.shape[0], HEAD_DIM])
        else:
            raw = tl.reshape(tl.join(w & 0xFF, (w >> 8) & 0xFF), [row_off.shape[0], HEAD_DIM])
            x = _byte_codes(raw, KV_FMT, out_dtype, False)
    else:
        r = load_code_bytes(cache_ptr, row_off, n_mask, CB, MASKED)
        if KV_FMT == 4:  # element 2j in the low nibble of byte j, 2j + 1 in the high one
            x = tl.reshape(tl.join(code_lane(r, 0, 4, out_dtype, FAST_CVT), code_lane(r, 1, 4, out_dtype, FAST_CVT)),
                           [row_off.shape[0], HEAD_DIM])
        else:  # element 4j + i in bits 2i of byte j: [.., CB, 2 (i // 2), 2 (i % 2)]
            x = tl.reshape(tl.join(tl.join(code_lane(r, 0, 2, out_dtype, FAST_CVT),
                                           code_lane(r, 2, 2, out_dtype, FAST_CVT)),
                                   tl.join(code_lane(r, 1, 2, out_dtype, FAST_CVT),
                                           code_lane(r, 3, 2, out_dtype, FAST_CVT))),
                           [row_off.shape[0], HEAD_DIM])
    return x


@triton.jit
def _f16_bits(bits):
    """int32 values holding float16 bit patterns in their low 16 bits -> float16."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _byte_codes(b, KV_FMT: tl.constexpr, out_dtype: tl.constexpr, FAST_CVT: tl.constexpr = False):
    """8-bit codes (``b``: the bytes, uint8 or zero-extended int32) as ``out_dtype``; exact in
    float16. ``FAST_CVT``: built as float16 bit patterns with integer ops, no conversion
    instruction (int-to-float converts run at a quarter of the FMA rate on sm_90): int8 ``x``
    is ``(1152 + x) - 1152`` with ``1152 + x`` = bits ``0x6400 | (x ^ 0x80)``; e5m2 is the
    upper byte of a float16; e4m3 moved into float16's fields is the value / 256 (the
    exponent biases differ by 8; subnormals map to subnormals), which the caller undoes
    (``CODE_SCALE``). Else: fp8 bit patterns converted with ``cvt``, int8 with ``I2F``."""
    if FAST_CVT:
        bi = b.to(tl.int32)
        if KV_FMT == 1:
            x = _f16_bits(((bi & 0x80) << 8) | ((bi & 0x7F) << 7))
        elif KV_FMT == 2:
            x = _f16_bits(bi << 8)
        else:
            x = _f16_bits((bi ^ 0x80) | 0x6400) - 1152.0
        x = x.to(out_dtype)
    else:
        raw = b.to(tl.uint8)
        if KV_FMT == 1:
            x = raw.to(tl.float8e4nv, bitcast=True).to(out_dtype)
        elif KV_FMT == 2:
            x = raw.to(tl.float8e5, bitcast=True).to(out_dtype)
        else:
            x = raw.to(tl.int8, bitcast=True).to(out_dtype)
    return x


@triton.jit
def load_code_bytes(cache_ptr, row_off, n_mask, CB: tl.constexpr, MASKED: tl.constexpr,
                    NARROW: tl.constexpr = False):
    """The ``CB`` code bytes of each key at ``row_off [BLOCK_N]``: ``[BLOCK_N, CB]`` int32
    (zero-extended; ``NARROW``: uint8 as stored; masked keys 0)."""
    offs_c = tl.arange(0, CB)
    ptrs = cache_ptr + row_off[:, None] + offs_c[None, :]
    if MASKED:
        raw = tl.load(ptrs, mask=n_mask[:, None], other=0)
    else:
        raw = tl.load(ptrs)
    if not NARROW:
        raw = raw.to(tl.int32)
    return raw


@triton.jit
def load_code_bytes_t(cache_ptr, row_off, n_mask, CB: tl.constexpr, MASKED: tl.constexpr,
                      NARROW: tl.constexpr = False):
    """``load_code_bytes`` transposed, ``[CB, BLOCK_N]`` (the K operand's layout)."""
    offs_c = tl.arange(0, CB)
    ptrs = cache_ptr + row_off[None, :] + offs_c[:, None]
    if MASKED:
        raw = tl.load(ptrs, mask=n_mask[None, :], other=0)
    else:
        raw = tl.load(ptrs)
    if not NARROW:
        raw = raw.to(tl.int32)
    return raw


@triton.jit
def code_lane(r, LANE: tl.constexpr, BITS: tl.constexpr, out_dtype: tl.constexpr, FAST_CVT: tl.constexpr = False):
    """Lane ``LANE`` of packed 4-/2-bit codes (bytes ``r``, int32): the codes in bits
    ``LANE * BITS`` up of each byte (elements ``j * 8 / BITS + LANE`` of row ``j``'s bytes),
    same shape as ``r``, as ``out_dtype``. ``FAST_CVT``: ``(1024 + c) - 1024`` from the
    float16 bits ``0x6400 | c``, no int-to-float conversion."""
    c = (r >> (LANE * BITS)) & ((1 << BITS) - 1)
    if FAST_CVT:
        x = (_f16_bits(c | 0x6400) - 1024.0).to(out_dtype)
    else:
        x = c.to(out_dtype)
    return x


# prmt picks bytes (b0, b1) / (b2, b3) of four packed codes into the low bytes of two 16-bit
# halves; lop3 (a & mask) | 0x6400 (immLut 0xEA) makes each half the float16 1024 + c * 2^s,
# and one f16x2 sub or fma takes 1024 off (and the 2^s shift out), exactly. The same trick
# dequantizes int4 weights in mixed-precision GEMMs (Marlin, Frantar et al., arXiv:2408.11743).
_ASM_PAIRS = """
prmt.b32 t0, $X, 0, 0x4140;
prmt.b32 t1, $X, 0, 0x4342;
"""


def _lane_asm(bits: int) -> str:
    lanes = 8 // bits
    x = 2 * lanes  # the input register follows the 2 x lanes output registers
    body = ["{", ".reg .b32 t0, t1, v, b, s, m;", _ASM_PAIRS.replace("$X", f"${x}").strip(),
            "mov.b32 b, 0x64006400;"]
    # float16 bits of 2^-(bits * i) and of -1024 * 2^-(bits * i), lane i's shift undone
    scale = {0: None, 2: (0x3400, 0xDC00), 4: (0x2C00, 0xD400), 6: (0x2400, 0xCC00)}
    for i in range(lanes):
        mask = ((1 << bits) - 1) << (bits * i)
        mask2 = mask | (mask << 16)
        for half, t in ((0, "t0"), (1, "t1")):
            out = f"${2 * i + half}"
            body.append(f"lop3.b32 v, {t}, {mask2:#010x}, 0x64006400, 0xEA;")
            sm = scale[bits * i]
            if sm is None:
                body.append(f"sub.f16x2 {out}, v, b;")
            else:
                body.append(f"mov.b32 s, {sm[0] * 0x10001:#010x};")
                body.append(f"mov.b32 m, {sm[1] * 0x10001:#010x};")
                body.append(f"fma.rn.f16x2 {out}, v, s, m;")
    body.append("}")
    return "\n".join(body)


_LANE_ASM_4 = tl.constexpr(_lane_asm(4))
_LANE_ASM_2 = tl.constexpr(_lane_asm(2))


def _lane_asm_i8(bits: int) -> str:
    """Each bit lane of 4 packed bytes as 4 int8 codes in one register: a shift and a mask."""
    lanes, mask = 8 // bits, (1 << bits) - 1
    body = ["{", ".reg .b32 t;"]
    for i in range(lanes):
        if i == 0:
            body.append(f"and.b32 ${i}, ${lanes}, {mask * 0x01010101:#010x};")
        else:
            body.append(f"shr.b32 t, ${lanes}, {bits * i};")
            body.append(f"and.b32 ${i}, t, {mask * 0x01010101:#010x};")
    body.append("}")
    return "\n".join(body)


_LANE_ASM_I8_4 = tl.constexpr(_lane_asm_i8(4))
_LANE_ASM_I8_2 = tl.constexpr(_lane_asm_i8(2))


@triton.jit
def code_lanes_i8(r, BITS: tl.constexpr):
    """Every bit lane of packed codes ``r`` (uint8, CUDA) as int8 codes (``tl.dot`` int8
    operands), four per instruction pair; 4-bit codes: the last two repeat the first two."""
    if BITS == 4:
        l0, l1 = tl.inline_asm_elementwise(_LANE_ASM_I8_4, "=r,=r,r", [r], dtype=(tl.int8, tl.int8),
                                           is_pure=True, pack=4)
        return l0, l1, l0, l1
    else:
        l0, l1, l2, l3 = tl.inline_asm_elementwise(_LANE_ASM_I8_2, "=r,=r,=r,=r,r", [r],
                                                   dtype=(tl.int8, tl.int8, tl.int8, tl.int8),
                                                   is_pure=True, pack=4)
        return l0, l1, l2, l3


@triton.jit
def code_lanes(r, BITS: tl.constexpr, out_dtype: tl.constexpr, FAST_CVT: tl.constexpr, UNPACK: tl.constexpr):
    """Every bit lane of packed codes ``r`` (``code_lane`` 0 .. 8 / BITS - 1; with 4-bit codes
    the last two repeat the first two, unused). ``UNPACK`` 1 (``r`` uint8, float16 out, CUDA):
    one inline-PTX block per four bytes builds all lanes, two codes per instruction."""
    if UNPACK >= 1:
        if BITS == 4:
            l0, l1 = tl.inline_asm_elementwise(_LANE_ASM_4, "=r,=r,=r,=r,r", [r],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            return l0, l1, l0, l1
        else:
            l0, l1, l2, l3 = tl.inline_asm_elementwise(_LANE_ASM_2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [r],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=4)
            return l0, l1, l2, l3
    else:
        l0 = code_lane(r, 0, BITS, out_dtype, FAST_CVT)
        l1 = code_lane(r, 1, BITS, out_dtype, FAST_CVT)
        if BITS == 4:
            return l0, l1, l0, l1
        else:
            return l0, l1, code_lane(r, 2, BITS, out_dtype, FAST_CVT), code_lane(r, 3, BITS, out_dtype, FAST_CVT)


@triton.jit
def load_k_tile(k_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, in_dtype: tl.constexpr, KV_FMT: tl.constexpr = 0,
                FAST_CVT: tl.constexpr = False):
    """K transposed, ``[HEAD_DIM, BLOCK_N]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys
    are 0. Quantized formats: the *codes* (exact in float16; e4m3 with ``FAST_CVT``: / 256),
    not scaled: the caller folds each key's scale (and minimum) into its score."""
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_FMT > 0 and KV_FMT <= 3:  # 8-bit codes: loaded as [HEAD_DIM, BLOCK_N], contiguous along the channel axis
        ptrs = k_cache_ptr + row_off[None, :] + offs_d[:, None]
        if MASKED:
            raw = tl.load(ptrs, mask=n_mask[None, :], other=0)
        else:
            raw = tl.load(ptrs)
        k = _byte_codes(raw, KV_FMT, in_dtype, FAST_CVT)
    elif KV_FMT > 0:  # packed codes: [C, BLOCK_N] bytes, contiguous along the channel axis, unpacked along it
        BITS: tl.constexpr = 4 if KV_FMT == 4 else 2
        r = load_code_bytes_t(k_cache_ptr, row_off, n_mask, HEAD_DIM * BITS // 8, MASKED)
        if KV_FMT == 4:
            k = tl.join(code_lane(r, 0, 4, in_dtype, FAST_CVT), code_lane(r, 1, 4, in_dtype, FAST_CVT))
            k = tl.reshape(tl.permute(k, (0, 2, 1)), [HEAD_DIM, row_off.shape[0]])  # [C, 2, N]: element 2c + i
        else:  # [C, N, 2 (i // 2), 2 (i % 2)]
            k = tl.join(tl.join(code_lane(r, 0, 2, in_dtype, FAST_CVT), code_lane(r, 2, 2, in_dtype, FAST_CVT)),
                        tl.join(code_lane(r, 1, 2, in_dtype, FAST_CVT), code_lane(r, 3, 2, in_dtype, FAST_CVT)))
            k = tl.reshape(tl.permute(k, (0, 2, 3, 1)), [HEAD_DIM, row_off.shape[0]])
    else:
        ptrs = k_cache_ptr + row_off[None, :] + offs_d[:, None] * stride_cd
        if MASKED:
            k = tl.load(ptrs, mask=n_mask[None, :], other=0.0).to(in_dtype)
        else:
            k = tl.load(ptrs).to(in_dtype)
    if WIDEN:  # interpreter only: its numpy dot cannot multiply bf16
        k = k.to(tl.float32)
    return k


@triton.jit
def load_v_tile(v_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, in_dtype: tl.constexpr, KV_FMT: tl.constexpr = 0,
                FAST_CVT: tl.constexpr = False, V_BYTES: tl.constexpr = False):
    """V, ``[BLOCK_N, HEAD_DIM]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys are 0.
    Quantized formats: the codes, not scaled (the caller folds the scales into P); ``V_BYTES``:
    ``_code_rows``'."""
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_FMT > 0:
        v = _code_rows(v_cache_ptr, row_off, n_mask, HEAD_DIM, KV_FMT, MASKED, in_dtype, FAST_CVT, V_BYTES)
    else:
        ptrs = v_cache_ptr + row_off[:, None] + offs_d[None, :] * stride_cd
        if MASKED:
            v = tl.load(ptrs, mask=n_mask[:, None], other=0.0).to(in_dtype)
        else:
            v = tl.load(ptrs).to(in_dtype)
    if WIDEN:
        v = v.to(tl.float32)
    return v


@triton.jit
def scaled_scores(q, k, q_scale, q_sum, ks, kz, DOT_PREC: tl.constexpr, KV_FMT: tl.constexpr):
    """Scores ``[M, BLOCK_N]`` (fp32) of query rows ``q [M, D]`` against the K tile ``k [D, BLOCK_N]``
    (``load_k_tile``). Quantized: ``q . (s_j c_j + m_j) = s_j (q . c_j) + m_j sum(q)``, so the dot
    runs on the codes and each key's scale ``ks`` (and minimum ``kz``) multiplies its column;
    ``q_scale [M]`` is the row's overall factor (the softmax scale, divided out of ``q`` by the
    caller's normalisation) and ``q_sum [M]`` its (scaled) channel sum. Else: ``q_scale`` is
    multiplied in (a scalar or ``[M]``)."""
    qk = tl.dot(q, k, input_precision=DOT_PREC)
    if KV_FMT > 0:
        qk = qk * q_scale[:, None] * ks[None, :]
        if KV_FMT >= 4:
            qk += q_sum[:, None] * kz[None, :]
    else:
        qk = qk * q_scale
    return qk


@triton.jit
def online_softmax(qk, m_i, l_i):
    """One online-softmax step (FlashAttention-2, arXiv:2307.08691) over scores ``qk [M, N]``
    (float32, log2 units, masked entries ``-inf``) with running max ``m_i [M]`` and sum ``l_i [M]``.
    Rows masked so far keep a 0 shift (no NaN). Returns ``(p [M, N], alpha [M], m_new, l_new)``:
    the caller rescales its accumulator by ``alpha`` and adds ``p V``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def pv_update(acc, p, v, vs, vz, DOT_PREC: tl.constexpr, KV_FMT: tl.constexpr, in_dtype: tl.constexpr):
    """``acc + P V`` for probabilities ``p [M, BLOCK_N]`` (fp32) and the V tile ``v [BLOCK_N, D]``
    (``load_v_tile``). Quantized: ``sum_j p_j (s_j c_j + m_j) = (sum_j p_j s_j c_j) + sum_j p_j m_j``:
    the scales go into P (``p_j s_j`` <= ``s_j``: float16 holds it; no per-tile maximum, whose
    cross-thread reduction would cost a barrier per step)."""
    if KV_FMT > 0:
        pv = p * vs[None, :]
        acc += tl.dot(pv.to(in_dtype).to(v.dtype), v, input_precision=DOT_PREC)
        if KV_FMT >= 4:
            acc += tl.sum(p * vz[None, :], 1)[:, None]
    else:
        acc += tl.dot(p.to(in_dtype).to(v.dtype), v, input_precision=DOT_PREC)
    return acc


@triton.jit
def prepare_query(q, qk_scale, KV_FMT: tl.constexpr, in_dtype: tl.constexpr):
    """``(q_dot, q_scale, q_sum)`` for ``scaled_scores`` from query rows ``q [M, D]``. Quantized:
    each row divided by its largest magnitude (so a bfloat16 query fits the float16 dot operand
    whatever its range), that magnitude times ``qk_scale`` as ``q_scale [M]``, and the row's
    channel sum times ``qk_scale`` (fp32) as ``q_sum``. Else: ``(q, qk_scale, qk_scale)``."""
    if KV_FMT > 0:
        qf = q.to(tl.float32)
        qn = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30)
        return (qf / qn[:, None]).to(in_dtype), qn * qk_scale, tl.sum(qf, 1) * qk_scale
    else:
        return q, qk_scale, qk_scale


@triton.jit
def split_lanes(x, LANES: tl.constexpr):
    """Columns of ``x [M, D]`` by lane: four tensors ``[M, D // LANES]``, lane ``i`` = columns
    ``i, i + LANES, ...`` (``LANES`` 2: the last two repeat the first two, unused)."""
    e, o = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    if LANES == 2:
        return e, o, e, o
    else:
        ee, eo = tl.split(tl.reshape(e, [x.shape[0], x.shape[1] // 4, 2]))  # columns 4c, 4c + 2
        oe, oo = tl.split(tl.reshape(o, [x.shape[0], x.shape[1] // 4, 2]))  # 4c + 1, 4c + 3
        return ee, oe, eo, oo


@triton.jit
def merge_lanes(a0, a1, a2, a3, LANES: tl.constexpr):
    """The inverse of ``split_lanes``: ``[M, C]`` lanes -> ``[M, C * LANES]``."""
    if LANES == 2:
        return tl.reshape(tl.join(a0, a1), [a0.shape[0], a0.shape[1] * 2])
    else:  # [M, C, 2 (i // 2), 2 (i % 2)]
        return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [a0.shape[0], a0.shape[1] * 4])


@triton.jit
def hadamard_rotate(x, D: tl.constexpr, DOT_PREC: tl.constexpr, op_dtype: tl.constexpr,
                    SPLIT: tl.constexpr = False):
    """``x [M, D] @ R`` in float32, ``R = H_D / sqrt(D)`` the rotation of the int4/int2 KV
    formats (``kvserve/attention/kv_rotation.py``, QuaRot arXiv:2404.00456; symmetric, so it
    also rotates back). ``H_D[i, j] = (-1)^popcount(i & j)`` (Sylvester) is built in registers:
    no matrix in memory, no extra launch (built in 32-row slabs, q/K/V loaded and the output
    stored slab by slab, it was slower on an H100: its H100 results are in git history).
    ``M >= 16`` (``tl.dot``); the operands are ``op_dtype``, where +-1 is exact, so with a
    bfloat16 ``x`` every product is exact.
    ``SPLIT`` (float32 ``x``, 16-bit ``op_dtype``): ``x = hi + lo`` in two 16-bit parts, two
    dots (about 16 mantissa bits; no tf32)."""
    idx = tl.arange(0, D)
    b = idx[:, None] & idx[None, :]
    b = b ^ (b >> 8)
    b = b ^ (b >> 4)
    b = b ^ (b >> 2)
    b = b ^ (b >> 1)  # bit 0: the parity of i & j (D <= 65536)
    h = tl.where((b & 1) == 0, 1.0, -1.0).to(op_dtype)
    if SPLIT:
        hi = x.to(op_dtype)
        lo = (x - hi.to(tl.float32)).to(op_dtype)
        y = tl.dot(lo, h, tl.dot(hi, h))
    else:
        y = tl.dot(x.to(op_dtype), h, input_precision=DOT_PREC)
    return y * (1.0 / tl.sqrt(D * 1.0))
