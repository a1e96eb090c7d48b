"""Triton W4A16 (and W8A16) GEMM for 1 <= M <= 256: group-quantized weights dequantized in registers.

``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)``, activations bf16/fp16 (fp32 under the interpreter), weights
``BITS`` = 4 or 8 bits per value with one scale per group of ``GROUP`` input features and a zero point in
one of three conventions (``ZP``):

* ``ZP_SYM``   — ``w = (q - 2^(BITS-1)) * s`` (GPTQ/AWQ symmetric);
* ``ZP_INT``   — ``w = (q - z) * s``, integer ``z`` per group (GPTQ asymmetric, AWQ);
* ``ZP_FLOAT`` — ``w = q * s + m``, float ``m`` per group (kvserve's ``--quantization int4``, GGUF Q4_1).

Layout (``pack``): ``PACK = 32 / BITS`` values per int32 word and blocks of ``KB = 16 * PACK`` input rows
(128 for 4 bits). ``qweight`` is int32 ``[Kp / PACK, N]`` (``Kp`` = K rounded up to ``KB``); word row
``16 * b + r`` holds, in its field ``j`` (bits ``BITS * j ...``), ``q[k = KB * b + 16 * j + r, n]``. So one
coalesced ``[16, BLOCK_N]`` int32 tile (N contiguous) unpacks, field by field, into ``PACK`` *contiguous*
``[16, BLOCK_N]`` K-slices: no shuffles, each slice is one ``tl.dot`` K-step (16) or one FMA tile. Scales
``[Kp / GROUP, N]`` (float16 when exact, as GPTQ/AWQ store them, else the activation dtype), integer zeros
uint8 ``[Kp / GROUP, N]``, float mins ``[Kp / GROUP, N]``. ``GROUP`` is a multiple of 16 (32/64/128, or
``Kp`` for per-channel), so each 16-row slice lies in one group. One kernel and one layout serve GPTQ,
AWQ and ``int4``; loaders repack into it (``pack``).

Arithmetic: the scale and zero are applied once per group, not per weight (Marlin's observation that the
dequantization must cost ~nothing next to the load; Frantar et al., arXiv:2408.11743):
``sum_k x_k (q_k - z) s = s * (sum_k x_k q_k) - z s * (sum_k x_k)``. Per weight the kernel does a shift
and one LOP3 that turn the field into the float ``2^BITS + q`` (``_field``; the ``2^BITS`` goes into the
zero term) and one FMA (M = 1) or a cast into a ``tl.dot`` operand (M > 1: tensor cores, M padded to
16/32/64).

Parallelism: one program per ``BLOCK_N`` outputs x ``BLOCK_M`` rows x K split. Every weight is read by
exactly one program when M <= BLOCK_M. Small M leaves too few programs to reach HBM bandwidth, so K is
split (float32 partials ``[S, M, N]`` summed by ``triton_gemv``'s reduce kernel, deterministic). Above
``MAX_M`` the caller dequantizes (``dequantize``) and uses cuBLAS: prefill is compute-bound.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ZP_SYM, ZP_INT, ZP_FLOAT = 0, 1, 2
#: largest M the GEMM serves; above it callers dequantize and use cuBLAS
MAX_M = 256
_SMS = 132  # H100/H200 SMs: programs wanted in flight (K is split below a few per SM)


@triton.jit
def _to_f32(q):
    """int32 in [0, 2^23) -> float32 exactly (OR into 2^23's mantissa, subtract): two full-rate ops."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _field(raw, j: tl.constexpr, BITS: tl.constexpr):
    """Field ``j`` of each int32 word -> float32 ``2^BITS + q``, exactly: the field is shifted into the top
    mantissa bits of ``2^BITS`` and that exponent ORed in (a shift and one LOP3, no int-to-float conversion
    and no subtraction; callers take ``2^BITS * sum(x)`` off once per group)."""
    POS: tl.constexpr = 23 - BITS
    SH: tl.constexpr = POS - BITS * j
    if SH >= 0:
        v = raw << SH
    else:
        v = raw >> (-SH)
    return ((v & (((1 << BITS) - 1) << POS)) | ((127 + BITS) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, n_blocks,
                  blocks_per_split,
                  BITS: tl.constexpr, GROUP: tl.constexpr, PPG: tl.constexpr, GPB: tl.constexpr,
                  ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr = "tf32"):
    # PPG: planes (16-row K-slices) per group within a block; GPB: groups per block (PPG * GPB = PACK).
    PACK: tl.constexpr = 32 // BITS
    KB: tl.constexpr = 16 * PACK
    SYM_Z: tl.constexpr = 1 << (BITS - 1)
    C: tl.constexpr = 1 << BITS  # the offset _field leaves in every value
    # The tl.dot operand must hold q + C exactly in 16 bits: 4-bit [16, 31] does, 8-bit [256, 511] does not.
    CB: tl.constexpr = 0 if (BLOCK_M > 1 and BITS == 8) else C
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # tl.dot path (and the M = 1 result)
    acc1 = tl.zeros([16, BLOCK_N], dtype=tl.float32)  # M = 1: scaled partial products, reduced at the end
    accz = tl.zeros([BLOCK_N], dtype=tl.float32)  # M = 1: zero-point term
    w_tile = w_ptr + offs_r[:, None] * N + offs_n[None, :]
    nxt = tl.load(w_tile + b0 * 16 * N, mask=n_mask[None, :] & (b0 < b1), other=0)
    for b in range(b0, b1):
        raw = nxt  # prefetch the next block's tile while this one is unpacked (two loads in flight)
        nxt = tl.load(w_tile + (b + 1) * 16 * N, mask=n_mask[None, :] & (b + 1 < b1), other=0)
        for gi in tl.static_range(GPB):
            grp = (b * KB + gi * PPG * 16) // GROUP
            sc = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)
            if ZP == 0:
                zs = -SYM_Z * sc
            elif ZP == 1:
                zs = -tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32) * sc
            else:
                zs = tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)
            zs = zs - CB * sc  # sum_k x_k (q_k + CB) s = s * t, so take CB * s * sum(x) off with the zero term
            if BLOCK_M == 1:
                t = tl.zeros([16, BLOCK_N], dtype=tl.float32)
                xs = 0.0
                for j in tl.static_range(gi * PPG, gi * PPG + PPG):  # this group's planes (j: a constexpr)
                    offs_k = b * KB + j * 16 + offs_r
                    if EVEN_K:  # K % KB == 0: no mask, so the row offsets fold into the loads' immediates
                        x = tl.load(x_ptr + offs_k).to(tl.float32)
                    else:
                        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0).to(tl.float32)
                    t += _field(raw, j, BITS) * x[:, None]
                    xs += tl.sum(x, axis=0)
                acc1 += t * sc[None, :]
                accz += zs * xs
            else:
                t = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                xs = tl.zeros([BLOCK_M], dtype=tl.float32)
                for j in tl.static_range(gi * PPG, gi * PPG + PPG):  # this group's planes (j: a constexpr)
                    offs_k = b * KB + j * 16 + offs_r
                    if EVEN_K:
                        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None],
                                    other=0)
                    else:
                        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0)
                    q = _field(raw, j, BITS)
                    if CB == 0:
                        q = q - C
                    q = q.to(in_dtype)  # exact (see CB)
                    t += tl.dot(x.to(dot_dtype), q.to(dot_dtype), input_precision=PREC)
                    xs += tl.sum(x.to(tl.float32), axis=1)
                acc += t * sc[None, :] + xs[:, None] * zs[None, :]
    if BLOCK_M == 1:
        acc += (tl.sum(acc1, axis=0) + accz)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(y_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                    ZP: tl.constexpr, BLOCK_N: tl.constexpr):
    """One ``[KB, BLOCK_N]`` block of the packed weight -> ``out`` ``[N, K]`` rows (the large-M path)."""
    PACK: tl.constexpr = 32 // BITS
    KB: tl.constexpr = 16 * PACK
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    offs_r = tl.arange(0, 16)
    n_mask = offs_n < N
    raw = tl.load(w_ptr + (b * 16 + offs_r)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    for j in tl.static_range(PACK):
        offs_k = b * KB + j * 16 + offs_r
        grp = (b * KB + j * 16) // GROUP
        sc = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
        q = _to_f32((raw >> (BITS * j)) & MASK)
        if ZP == 0:
            w = (q - (1 << (BITS - 1))) * sc
        elif ZP == 1:
            w = (q - tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]) * sc
        else:
            w = q * sc + tl.load(z_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_n[None, :] * K + offs_k[:, None], w.to(out_ptr.dtype.element_ty),
                 mask=n_mask[None, :] & (offs_k < K)[:, None])


def block_rows(bits: int) -> int:
    """K rows per packed block (``KB``): 128 for 4 bits, 64 for 8 bits."""
    return 16 * (32 // bits)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` uint8 ``[N, K]`` (values < 2^bits) -> int32 ``[Kp / (32 / bits), N]`` in the layout of the module doc.

    K is zero-padded to a multiple of ``block_rows(bits)``. Raises ValueError for bits other than 4 / 8.
    """
    if bits not in (4, 8):
        raise ValueError(f"w4a16 pack: bits must be 4 or 8, got {bits}")
    n, k = q.shape
    per, kb = 32 // bits, block_rows(bits)
    kp = -(-k // kb) * kb
    qp = torch.nn.functional.pad(q.to(torch.int64), (0, kp - k))
    # [N, blocks, field j, row r] -> [blocks, r, N, j]
    v = qp.reshape(n, kp // kb, per, 16).permute(1, 3, 0, 2)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    words = (v << shifts).sum(-1)  # fields do not overlap: the sum is the OR
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.reshape(kp // per, n).to(torch.int32).contiguous()


def unpack(w: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of ``pack``: int32 ``[Kp / (32 / bits), N]`` -> uint8 ``[N, k]``."""
    per, kb = 32 // bits, block_rows(bits)
    n = w.shape[1]
    kp = w.shape[0] * per
    shifts = torch.arange(per, dtype=torch.int32, device=w.device) * bits
    v = (w.reshape(kp // kb, 16, n)[..., None] >> shifts) & ((1 << bits) - 1)  # [blocks, r, N, j]
    return v.permute(2, 0, 3, 1).reshape(n, kp)[:, :k].to(torch.uint8)


@functools.lru_cache(maxsize=None)
def gemm_config(m: int, n: int, k: int, bits: int = 4) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, split, num_warps)`` for one shape (a static table; H100/H200-minded).

    M = 1: FMA tiles ``[16, BLOCK_N]``; M > 1: ``tl.dot`` with BLOCK_M 16/32/64.
    K is split until there are ~4 programs per SM, keeping >= 2 blocks of K per split and the split-K
    partials' traffic below the weight bytes.
    """
    if m == 1:
        block_m, block_n, warps = 1, 128, 4
    elif m <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif m <= 32:
        block_m, block_n, warps = 32, 64, 4
    elif m <= 64:
        block_m, block_n, warps = 64, 64, 4
    else:  # weights re-read per 64-row M block come from L2; more programs than BLOCK_M = 128 gives
        block_m, block_n, warps = 64, 128, 8
    n_blocks = triton.cdiv(k, block_rows(bits))
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    target = 4 * _SMS
    split = 1
    if programs < target:
        # float32 partials (written + read: 8 * M * N bytes per split) stay below the weight bytes (K * N * bits / 8)
        cap = max(1, k * bits // (64 * m))
        split = max(1, min(triton.cdiv(target, programs), n_blocks // 2, cap))
    return block_m, block_n, split, warps


def _reduce():
    from kvserve.layers.quantization import triton_gemv  # its deterministic split-K reduce kernel

    return triton_gemv._splitk_reduce_kernel


def gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, n: int,
         group_size: int, bits: int = 4, zp: int = ZP_INT, bias: torch.Tensor | None = None,
         config: tuple | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (1 <= M <= MAX_M; bf16/fp16, or fp32) -> ``x @ W.T (+ bias)`` ``[M, n]`` in x's dtype.

    ``w`` int32 from ``pack``; ``scales`` ``[Kp / group_size, n]``; ``zeros``: None (``ZP_SYM``), uint8
    (``ZP_INT``) or float mins (``ZP_FLOAT``) ``[Kp / group_size, n]``; ``group_size`` a multiple of 16 (the
    per-channel case passes ``Kp``). ``config`` = ``(BLOCK_M, BLOCK_N, split, num_warps)`` overrides
    ``gemm_config``. Raises ValueError for M outside [1, MAX_M] or a group size that is not a multiple of 16.
    """
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"w4a16 gemm serves 1 <= M <= {MAX_M}, got {m}")
    if group_size % 16:
        raise ValueError(f"w4a16 gemm: group size {group_size} must be a multiple of 16")
    if x.stride(-1) != 1:
        x = x.contiguous()
    bm, bn, split, warps = config or gemm_config(m, n, k, bits)
    n_blocks = triton.cdiv(k, block_rows(bits))
    bps = triton.cdiv(n_blocks, split)
    split = triton.cdiv(n_blocks, bps)  # no empty splits
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    widen = x.device.type != "cuda" and x.dtype != torch.float32
    per = 32 // bits
    ppg = min(per, group_size // 16)
    _w4a16_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        x, w, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
        m, n, k, x.stride(0), y.stride(0), n_blocks, bps,
        BITS=bits, GROUP=group_size, PPG=ppg, GPB=per // ppg, ZP=zp, BLOCK_M=bm, BLOCK_N=bn, SPLIT=split > 1,
        HAS_BIAS=bias is not None, WIDEN=widen, EVEN_K=k % block_rows(bits) == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps)  # float32: no TF32 rounding
    if split > 1:
        block = 1024
        _reduce()[(triton.cdiv(m * n, block),)](out, bias if bias is not None else out, y, m * n, n, split,
                                                HAS_BIAS=bias is not None, BLOCK=block)
    return y


def dequantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, n: int, k: int,
               group_size: int, bits: int = 4, zp: int = ZP_INT, dtype: torch.dtype = torch.bfloat16
               ) -> torch.Tensor:
    """Packed weight -> dense ``[n, k]`` in ``dtype`` (the M > MAX_M path, then cuBLAS)."""
    out = torch.empty(n, k, device=w.device, dtype=dtype)
    n_blocks = triton.cdiv(k, block_rows(bits))
    _dequant_kernel[(triton.cdiv(n, 64), n_blocks)](w, scales, zeros if zeros is not None else scales, out, n, k,
                                                    BITS=bits, GROUP=group_size, ZP=zp, BLOCK_N=64)
    return out
