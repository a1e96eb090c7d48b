"""Triton W4A16 (and W8A16) GEMM for 1 <= M <= 256: group-quantized weights streamed once, dequantized in registers.

``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)``, activations bf16/fp16 (fp32 under the interpreter), weights
``BITS`` = 4 or 8 bits per value with one scale per group of ``GROUP`` input features and a zero point in
one of three conventions (``ZP``):

* ``ZP_SYM``   — ``w = (q - 2^(BITS-1)) * s`` (GPTQ/AWQ symmetric);
* ``ZP_INT``   — ``w = (q - z) * s``, integer ``z`` per group (GPTQ asymmetric, AWQ);
* ``ZP_FLOAT`` — ``w = q * s + m``, float ``m`` per group (kvserve's ``--quantization int4``, GGUF Q4_1).

The design follows Marlin (Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on
Large Language Models", arXiv:2408.11743): every weight byte is read from HBM exactly once with wide
coalesced loads, dequantization costs next to nothing beside the load, K is split across programs when N
alone cannot fill the GPU, and tensor cores do the products from M = 16.

Layout (``pack``), N-major and tiled: ``PACK = 32 / BITS`` values per int32 word, blocks of ``KB = 16 * PACK``
input features (128 for 4 bits). In row ``n``, block ``b``, word ``r`` (0..15) holds in its field ``j`` (bits
``BITS * j ...``) ``q[n, KB * b + 16 * j + r]``. Words are stored by 16-row strips: strip ``n // 16``, then
block ``b``, then row ``n % 16``, then ``r`` (int32 ``[Np, Kp / PACK]``; ``Np``, ``Kp``: N and K rounded up to
16 and ``KB``), so a block of a strip is 1 KiB contiguous: a ``[BLOCK_N, 16]`` tile is ``BLOCK_N / 16``
contiguous KiB, loaded as 128-bit vectors. Field ``j`` of the tile is the ``[BLOCK_N, 16]`` weight slice of
the 16 *contiguous* input features ``KB * b + 16 * j + (0..15)`` (a "plane"): no shuffles, one ``tl.dot``
K-step or one FMA tile, and always inside one group (``GROUP`` is a multiple of 16). Scales
``[Kp / GROUP, N]`` (float16 when exact, as GPTQ/AWQ store them, else the activation dtype; N contiguous, so a
tile's scales are one coalesced row), integer zeros uint8 ``[Kp / GROUP, N]``, float minima
``[Kp / GROUP, N]``. Loaders repack into this layout (``pack``).

Arithmetic. ``_field`` turns a field into the float32 ``2^BITS + q`` with a shift and one LOP3 (no
int-to-float conversion). M = 1 (FMA tiles): the scale and zero are applied once per group, not per weight,
``sum_k x_k (q_k - z) s = s * (sum_k x_k q_k) - z s * (sum_k x_k)``: per weight a shift, a LOP3 and one FMA.
M >= 16 (tensor cores): ``y^T = W x^T``, so the weight tile is the MMA's A operand (from registers) and M the
small side, padded to 16; each weight is dequantized to the activation dtype (one FMA and half a convert),
as Marlin does, and the 16-feature planes are the MMA's K steps.

Parallelism: one program per ``BLOCK_N`` outputs x ``BLOCK_M`` rows x K split. Every weight is read by one
program when M <= BLOCK_M. The K loop is software-pipelined (``tl.range(num_stages=)``): weight tiles stream
into shared memory by cp.async ``stages - 1`` steps ahead. Split K: float32 partials ``[S, M, N]``; the last program of a tile to finish
(an atomic counter per tile) sums them in split order, adds the bias and writes ``y`` (deterministic: the
order is fixed; the counters reset themselves, so the kernel is CUDA-graph safe; ``REDUCE = 1`` uses a
separate reduce kernel instead). Above ``MAX_M`` callers dequantize (``dequantize``) and use cuBLAS.

Tuning: ``gemm_config`` looks ``(M bucket, N, K)`` up in ``TUNED`` (filled from the GPU sweep of
``benchmarks/gpu_w4a16.py``) and falls back to a heuristic.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

ZP_SYM, ZP_INT, ZP_FLOAT = 0, 1, 2
#: largest M the GEMM serves; above it callers dequantize and use cuBLAS
MAX_M = 64  # H200: at M = 256 dequantize + cuBLAS is 2x this GEMM; at 64 this GEMM wins 3 of 4 shapes
_SMS = 132  # H100/H200 SMs: programs wanted in flight (K is split below a few per SM)
#: M buckets of the config table (an M uses the first bucket >= M)
M_BUCKETS = (1, 16, 32, 64, 128, 256)


class Config(NamedTuple):
    """One launch configuration. ``block_m`` 1: the FMA path (M = 1); 16..128: ``tl.dot``. ``nb``: 16-word
    blocks loaded per loop step per row (bytes in flight); ``split``: K splits (1: none); ``warps``:
    Triton's ``num_warps``; ``stages``: the K loop's software-pipeline depth (``tl.range(num_stages=)``: the
    weight tiles stream through shared memory with cp.async; 1: plain loads); ``reduce``: 0 in-kernel
    split-K reduce, 1 a separate reduce kernel."""

    block_m: int
    block_n: int
    nb: int = 1
    split: int = 1
    warps: int = 4
    stages: int = 2
    reduce: int = 0


#: The CUDA kernel of ``--quantization int4`` and of 4-bit GPTQ/AWQ in bf16 (``KVSERVE_INT4_KERNEL=w4a16|tinygemm``
#: overrides). tinygemm (``_weight_int4pack_mm``) is ~10-30% faster at M = 1 on the small projections, but
#: 2x slower at M = 16 and 20x at M = 256 (gate_up 2,059 vs 94 us bf16, H200), and its packing offers no
#: dequantize + cuBLAS path for large M: on tinygemm, the 8B shape's offline ISL/OSL 1000/1000 with 256
#: requests ran at 982 output tok/s (H200, docs/benchmarks/weight-quant.md). This GEMM covers M <= ``MAX_M``
#: and dequantizes for cuBLAS above, so it is the default at every batch size.
DEFAULT_INT4_KERNEL = "w4a16"


def default_int4_kernel() -> str:
    """The default CUDA INT4 kernel: ``"w4a16"`` (this GEMM) or ``"tinygemm"`` (``DEFAULT_INT4_KERNEL``)."""
    return DEFAULT_INT4_KERNEL


#: ``(M bucket, N, K) -> Config`` measured on an H200: ``benchmarks/gpu_w4a16.py --sweep`` (run.sh part
#: ``int4-gemm``) prints the best per shape as ``TUNED (b, n, k): Config(...),`` lines (and records them in
#: its JSON, ``part: tuned``) to paste here without the ``TUNED`` word. Shapes missing here use ``_heuristic``.
TUNED: dict[tuple[int, int, int], Config] = {  # H200, 2026-11-28 (int4-gemm: docs/benchmarks/weight-quant.md)
    (1, 6144, 4096): Config(1, 128, 2, 8, 4, 1, 0),
    (1, 4096, 4096): Config(1, 128, 2, 16, 4, 1, 0),
    (1, 28672, 4096): Config(1, 128, 2, 6, 4, 1, 0),
    (1, 4096, 14336): Config(1, 128, 1, 17, 4, 3, 0),
    (16, 6144, 4096): Config(16, 64, 2, 12, 4, 2, 0),
    (16, 4096, 4096): Config(16, 64, 1, 9, 4, 2, 0),
    (16, 28672, 4096): Config(16, 64, 1, 2, 4, 2, 0),
    (16, 4096, 14336): Config(16, 64, 1, 9, 4, 2, 0),
    (64, 6144, 4096): Config(64, 64, 1, 4, 4, 2, 0),
    (64, 4096, 4096): Config(64, 64, 1, 4, 4, 2, 0),
    (64, 28672, 4096): Config(64, 64, 1, 2, 4, 2, 0),
    (64, 4096, 14336): Config(64, 64, 1, 9, 4, 2, 0),
}


@triton.jit
def _to_f32(q):
    """int32 in [0, 2^23) -> float32 exactly (OR into 2^23's mantissa, subtract): two full-rate ops."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _field(raw, j: tl.constexpr, BITS: tl.constexpr, exp):
    """Field ``j`` of each int32 word -> float32 ``2^BITS + q``, exactly: the field is shifted into the top
    mantissa bits of ``2^BITS`` and that exponent (``exp`` = ``(127 + BITS) << 23``) ORed in: a shift and one
    LOP3, no int-to-float conversion and no subtraction (callers take ``2^BITS * sum(x)`` off once per group).
    ``exp`` is a kernel argument, not a literal, so it sits in a register and the mask and the OR fuse into one
    LOP3 (it takes one immediate)."""
    POS: tl.constexpr = 23 - BITS
    SH: tl.constexpr = POS - BITS * j
    if SH >= 0:
        v = raw << SH
    else:
        v = raw >> (-SH)
    return ((v & (((1 << BITS) - 1) << POS)) | exp).to(tl.float32, bitcast=True)


@triton.jit
def _tile_offsets(offs_n, offs_r, KW):
    """Word offsets of block 0 of rows ``offs_n``, words ``offs_r`` (``[BLOCK_N, 16]``) in the tiled layout:
    16 rows x 16 words (1 KiB) contiguous per block, blocks of a 16-row strip one after the other."""
    return ((offs_n // 16) * (KW * 16) + (offs_n % 16) * 16)[:, None] + offs_r[None, :]


@triton.jit
def _group_params(s_ptr, z_ptr, offs, mask, ZP: tl.constexpr, SYM_Z: tl.constexpr, CB: tl.constexpr):
    """A group's scale ``s`` and zero term ``zs`` (float32, ``offs``' shape): ``w = (q + CB) * s + zs``."""
    sc = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.float32)
    if ZP == 0:
        zs = -SYM_Z * sc
    elif ZP == 1:
        zs = -tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32) * sc
    else:
        zs = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32)
    return sc, zs - CB * sc  # sum_k x_k (q_k + CB) s = s * t: CB * s * sum(x) comes off with the zero term


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, p_ptr, lock_ptr, M, N, K, KW, stride_xm, stride_ym,
                  n_blocks, blocks_per_split, n_split, exp,
                  BITS: tl.constexpr, GROUP: tl.constexpr, PPG: tl.constexpr, GPB: tl.constexpr,
                  ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                  SPLIT: tl.constexpr, REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  WIDEN: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr = "tf32"):
    # PPG: planes (16-feature K-slices) per group within a block; GPB: groups per block (PPG * GPB = PACK).
    # KW: int32 words per weight row (Kp / PACK; a 16-row strip is 16 * KW words); exp: (127 + BITS) << 23.
    # Accumulators are transposed, [BLOCK_N, BLOCK_M] (y^T = W x^T).
    PACK: tl.constexpr = 32 // BITS
    KB: tl.constexpr = 16 * PACK
    SYM_Z: tl.constexpr = 1 << (BITS - 1)
    C: tl.constexpr = 1 << BITS  # the offset _field leaves in every value
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, 16)
    n_mask = offs_n < N
    m_mask = offs_m < M
    in_dtype = x_ptr.dtype.element_ty
    dot_dtype = tl.float32 if WIDEN else in_dtype  # WIDEN: interpreter only (its numpy dot has no bf16)
    b0 = pid_k * blocks_per_split
    b1 = tl.minimum(b0 + blocks_per_split, n_blocks)
    k_lim = tl.minimum(K, b1 * KB)  # x past the split (NB > 1 steps) or past K reads as 0
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # tl.dot path
    acc1 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # M = 1: scaled partial products, reduced at the end
    w_tile = w_ptr + _tile_offsets(offs_n, offs_r, KW)
    for b in tl.range(b0, b1, NB, num_stages=STAGES):
        for nb in tl.static_range(NB):
            blk = b + nb
            if NB == 1:  # blk < b1 always
                g_mask = n_mask
            else:
                g_mask = n_mask & (blk < b1)
            raw = tl.load(w_tile + blk * 256, mask=g_mask[:, None], other=0)
            for gi in tl.static_range(GPB):
                grp = (blk * KB + gi * PPG * 16) // GROUP
                sc, zs = _group_params(s_ptr, z_ptr, grp * N + offs_n, g_mask, ZP, SYM_Z, C)
                sc = sc[:, None]
                zs = zs[:, None]
                if BLOCK_M == 1:
                    t = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
                    xv = tl.zeros([16], dtype=tl.float32)  # the group's x summed plane-wise (no shuffles)
                    for j in tl.static_range(gi * PPG, gi * PPG + PPG):  # this group's planes (j: a constexpr)
                        offs_k = blk * KB + j * 16 + offs_r
                        if EVEN_K and NB == 1:  # no mask: the row offsets fold into the loads' immediates
                            x = tl.load(x_ptr + offs_k).to(tl.float32)
                        else:
                            x = tl.load(x_ptr + offs_k, mask=offs_k < k_lim, other=0).to(tl.float32)
                        t += _field(raw, j, BITS, exp) * x[None, :]
                        xv += x
                    acc1 += t * sc + zs * xv[None, :]
                else:
                    for j in tl.static_range(gi * PPG, gi * PPG + PPG):
                        offs_k = blk * KB + j * 16 + offs_r
                        xp = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T plane [16, BLOCK_M]
                        if EVEN_K and NB == 1:
                            xt = tl.load(xp, mask=m_mask[None, :], other=0)
                        else:
                            xt = tl.load(xp, mask=m_mask[None, :] & (offs_k < k_lim)[:, None], other=0)
                        # dequantized operand (rounded to the activation dtype, as a dense weight would be)
                        wq = (_field(raw, j, BITS, exp) * sc + zs).to(in_dtype)
                        acc = tl.dot(wq.to(dot_dtype), xt.to(dot_dtype), acc, input_precision=PREC)
    if BLOCK_M == 1:
        acc += tl.sum(acc1, axis=1)[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT:
        p_ptrs = p_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(p_ptrs + pid_k * M * N, acc, mask=mask)
        if REDUCE == 0:
            # The tile's last program to finish sums the partials in split order (deterministic) and resets
            # the tile's counter. The barrier orders all threads' partial stores before the release.
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(0) + pid_n
            done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == n_split - 1:
                tl.debug_barrier()
                tot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in range(n_split):
                    tot += tl.load(p_ptrs + s * M * N, mask=mask, other=0, cache_modifier=".cg")
                if HAS_BIAS:
                    tot += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
                tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tile, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, KW, BITS: tl.constexpr, GROUP: tl.constexpr,
                    ZP: tl.constexpr, BLOCK_N: tl.constexpr):
    """One ``[BLOCK_N, KB]`` block of the packed weight -> ``out`` ``[N, K]`` (the large-M path)."""
    PACK: tl.constexpr = 32 // BITS
    KB: tl.constexpr = 16 * PACK
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    offs_r = tl.arange(0, 16)
    n_mask = offs_n < N
    raw = tl.load(w_ptr + _tile_offsets(offs_n, offs_r, KW) + b * 256, mask=n_mask[:, None], other=0)
    for j in tl.static_range(PACK):
        offs_k = b * KB + j * 16 + offs_r
        grp = (b * KB + j * 16) // GROUP
        sc = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
        q = _to_f32((raw >> (BITS * j)) & MASK)
        if ZP == 0:
            w = (q - (1 << (BITS - 1))) * sc
        elif ZP == 1:
            w = (q - tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]) * sc
        else:
            w = q * sc + tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (offs_k < K)[None, :])


def block_rows(bits: int) -> int:
    """K features per packed block (``KB``): 128 for 4 bits, 64 for 8 bits (K is padded to a multiple)."""
    return 16 * (32 // bits)


def padded_k(k: int, bits: int) -> int:
    """``Kp``: ``k`` rounded up to ``block_rows(bits)``."""
    kb = block_rows(bits)
    return -(-k // kb) * kb


def padded_n(n: int) -> int:
    """``Np``: ``n`` rounded up to the 16-row strips of the layout."""
    return -(-n // 16) * 16


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` uint8 ``[N, K]`` (values < 2^bits) -> int32 ``[Np, Kp / (32 / bits)]`` in the layout of the module
    doc (element order tiled: 16 rows x 16 words contiguous per block).

    K is zero-padded to ``padded_k``, N to ``padded_n``. Raises ValueError for bits other than 4 / 8 or a q
    that is not 2-D.
    """
    if bits not in (4, 8):
        raise ValueError(f"w4a16 pack: bits must be 4 or 8, got {bits}")
    if q.dim() != 2:
        raise ValueError(f"w4a16 pack: q must be [N, K], got shape {tuple(q.shape)}")
    n, k = q.shape
    per, kb = 32 // bits, block_rows(bits)
    kp, np_ = padded_k(k, bits), padded_n(n)
    qp = torch.nn.functional.pad(q.to(torch.int64), (0, kp - k, 0, np_ - n))
    # [N, blocks, field j, word r] -> [N, blocks, r, j]
    v = qp.reshape(np_, kp // kb, per, 16).permute(0, 1, 3, 2)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    words = (v << shifts).sum(-1)  # [Np, blocks, r]; fields do not overlap: the sum is the OR
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    # tiled: [strip, row in strip, block, r] -> [strip, block, row in strip, r]
    words = words.reshape(np_ // 16, 16, kp // kb, 16).permute(0, 2, 1, 3)
    return words.reshape(np_, kp // per).to(torch.int32).contiguous()


def unpack(w: torch.Tensor, bits: int, k: int, n: int | None = None) -> torch.Tensor:
    """Inverse of ``pack``: int32 ``[Np, Kp / (32 / bits)]`` -> uint8 ``[n, k]`` (``n`` default: ``Np``)."""
    per, kb = 32 // bits, block_rows(bits)
    np_ = w.shape[0]
    kp = w.shape[1] * per
    words = w.reshape(np_ // 16, kp // kb, 16, 16).permute(0, 2, 1, 3).reshape(np_, kp // kb, 16)
    shifts = torch.arange(per, dtype=torch.int32, device=w.device) * bits
    v = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [Np, blocks, r, j]
    return v.permute(0, 1, 3, 2).reshape(np_, kp)[: np_ if n is None else n, :k].to(torch.uint8)


def m_bucket(m: int) -> int:
    """The ``M_BUCKETS`` entry an M is tuned under (the first >= m)."""
    return next(b for b in M_BUCKETS if b >= m)


def auto_split(m: int, n: int, k: int, bits: int, cfg: Config) -> int:
    """K splits for ``cfg``'s tile: up to ~4 programs per SM, each split >= 2 loop steps, and the float32
    partials' traffic (8 * M * N bytes per split) below the weight bytes (K * N * bits / 8)."""
    n_blocks = triton.cdiv(k, block_rows(bits))
    programs = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, max(cfg.block_m, 1))
    target = 4 * _SMS
    if programs >= target:
        return 1
    cap = max(1, k * bits // (64 * m))
    return max(1, min(triton.cdiv(target, programs), n_blocks // (2 * cfg.nb), cap))


def _heuristic(m: int, n: int, k: int, bits: int) -> Config:
    """Untuned default: M = 1 FMA tiles of 128 rows, 3-stage pipelined loads; tl.dot tiles above; ``auto_split``."""
    if m == 1:
        cfg = Config(1, 128, 1, 1, 4, 3)
    elif m <= 16:
        cfg = Config(16, 64, 1, 1, 4, 2)
    elif m <= 32:
        cfg = Config(32, 64, 1, 1, 4, 2)
    elif m <= 64:
        cfg = Config(64, 64, 1, 1, 4, 2)
    else:
        cfg = Config(64, 128, 1, 1, 8, 2)
    return cfg._replace(split=auto_split(m, n, k, bits, cfg))


@functools.lru_cache(maxsize=None)
def gemm_config(m: int, n: int, k: int, bits: int = 4) -> Config:
    """The ``Config`` for one shape: ``TUNED[(m_bucket(m), n, k)]`` (4 bits) when measured, else ``_heuristic``."""
    if bits == 4:
        cfg = TUNED.get((m_bucket(m), n, k))
        if cfg is not None and (cfg.block_m > 1 or m == 1):  # M = 1 may also run the tl.dot tiles (padded)
            return cfg
    return _heuristic(m, n, k, bits)


_LOCKS: dict[torch.device, torch.Tensor] = {}  # split-K tile counters per device


def workspace(device: torch.device, tiles: int = 1 << 16) -> torch.Tensor:
    """The split-K tile counters of ``device`` (int32, zero between calls: the kernel resets them). Call once
    outside CUDA-graph capture (layers do at load) so capture never allocates them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one workspace
        device = torch.device("cuda", torch.cuda.current_device())
    t = _LOCKS.get(device)
    if t is None or t.numel() < tiles:
        t = _LOCKS[device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
    return t


def _reduce():
    from kvserve.layers.quantization import triton_gemv  # its deterministic split-K reduce kernel

    return triton_gemv._splitk_reduce_kernel


def gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, n: int,
         group_size: int, bits: int = 4, zp: int = ZP_INT, bias: torch.Tensor | None = None,
         config: tuple | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (1 <= M <= MAX_M; bf16/fp16, or fp32) -> ``x @ W.T (+ bias)`` ``[M, n]`` in x's dtype.

    ``w`` int32 ``[Np, Kp / (32 / bits)]`` from ``pack``; ``scales`` ``[Kp / group_size, n]``; ``zeros``: None
    (``ZP_SYM``), uint8 (``ZP_INT``) or float minima (``ZP_FLOAT``) ``[Kp / group_size, n]``; ``group_size`` a
    multiple of 16 (the per-channel case passes ``Kp``). ``config``: a ``Config`` (or a tuple of its fields)
    overriding ``gemm_config``. Raises ValueError for M outside [1, MAX_M], a group size that is not a
    multiple of 16, or a ``w`` whose shape is not ``[Np, Kp / (32 / bits)]``.
    """
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"w4a16 gemm serves 1 <= M <= {MAX_M}, got {m}")
    if group_size % 16:
        raise ValueError(f"w4a16 gemm: group size {group_size} must be a multiple of 16")
    kw = padded_k(k, bits) // (32 // bits)
    if w.dim() != 2 or w.shape[0] != padded_n(n) or w.shape[1] < kw or w.shape[1] % 16:
        raise ValueError(f"w4a16 gemm: qweight must be int32 [{padded_n(n)}, {kw}] (Np, Kp / {32 // bits}; wider "
                         f"if packed from a K padded further), got {tuple(w.shape)}")
    kw = w.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = Config(*config) if config is not None else gemm_config(m, n, k, bits)
    if cfg.block_m == 1 and m > 1 or 1 < cfg.block_m < 16:
        raise ValueError(f"w4a16 gemm: block_m is 1 (M = 1 only) or >= 16, got {cfg.block_m} for M = {m}")
    n_blocks = triton.cdiv(k, block_rows(bits))
    bps = triton.cdiv(triton.cdiv(n_blocks, cfg.split), cfg.nb) * cfg.nb  # whole NB steps per split
    split = triton.cdiv(n_blocks, bps)  # no empty splits
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    locks = workspace(x.device, grid[0] * grid[1]) if split > 1 and cfg.reduce == 0 else y
    widen = x.device.type != "cuda" and x.dtype != torch.float32
    per = 32 // bits
    ppg = min(per, group_size // 16)
    _w4a16_kernel[grid](
        x, w, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y, parts, locks,
        m, n, k, kw, x.stride(0), y.stride(0), n_blocks, bps, split, (127 + bits) << 23,
        BITS=bits, GROUP=group_size, PPG=ppg, GPB=per // ppg, ZP=zp, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        NB=cfg.nb, SPLIT=split > 1, REDUCE=cfg.reduce, HAS_BIAS=bias is not None, WIDEN=widen,
        EVEN_K=k % block_rows(bits) == 0, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        STAGES=cfg.stages, num_warps=cfg.warps, num_stages=cfg.stages)  # float32: no TF32 rounding
    if split > 1 and cfg.reduce == 1:
        block = 1024
        _reduce()[(triton.cdiv(m * n, block),)](parts, bias if bias is not None else parts, y, m * n, n, split,
                                                HAS_BIAS=bias is not None, BLOCK=block)
    return y


def dequantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, n: int, k: int,
               group_size: int, bits: int = 4, zp: int = ZP_INT, dtype: torch.dtype = torch.bfloat16
               ) -> torch.Tensor:
    """Packed weight -> dense ``[n, k]`` in ``dtype`` (the M > MAX_M path, then cuBLAS)."""
    out = torch.empty(n, k, device=w.device, dtype=dtype)
    n_blocks = triton.cdiv(k, block_rows(bits))
    _dequant_kernel[(triton.cdiv(n, 64), n_blocks)](w, scales, zeros if zeros is not None else scales, out, n, k,
                                                    w.shape[1], BITS=bits, GROUP=group_size, ZP=zp, BLOCK_N=64)
    return out
