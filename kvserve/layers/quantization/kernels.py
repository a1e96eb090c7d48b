"""Weight quantization formats and their matmuls: INT4 group-wise, INT8 per-channel, FP8 per-channel.

The kernels are PyTorch's own (the ones torchao dispatches to): ``_weight_int4pack_mm_for_cpu``
(CPU) / ``_weight_int4pack_mm`` (CUDA "tinygemm"), ``_weight_int8pack_mm`` and
``torch._scaled_mm`` (FP8, row-wise scales). torchao 0.18's tensor-subclass wrappers cost
~10x the kernel time per call at our shapes (docs/benchmarks/weight-quant.md), so only the glue lives here.

Canonical INT4 form (llama.cpp's Q4_1, asymmetric): per group of ``group_size`` input
features, ``w = scale * q + min`` with ``q`` in ``[0, 15]``. The int4pack kernels compute
``w = (q - 8) * scale + zero``, so ``zero = min + 8 * scale`` (exact algebra; the one rounding
is of ``scale``/``zero`` to the activation dtype, the kernels' requirement).

On CUDA, INT4 runs the Triton W4A16 GEMM of ``triton_w4a16`` (dequantize + cuBLAS above its ``MAX_M``) or,
asked for, tinygemm (``_weight_int4pack_mm``, a batch-1 kernel: ``int4_kernel``,
``triton_w4a16.DEFAULT_INT4_KERNEL``, overridden by ``KVSERVE_INT4_KERNEL=w4a16|tinygemm``, read at load);
the Triton GEMV with ``KVSERVE_TRITON_GEMV``.
On CUDA, M <= ``triton_gemv.MAX_M`` (decode) runs the Triton weight-only GEMV of ``triton_gemv``
for the formats in ``KVSERVE_TRITON_GEMV`` (read at load; default FP8 and INT8, "1" adds INT4, "0"
restores the PyTorch kernels). FP8 and INT8 share their storage with the PyTorch path. INT4 with the
Triton GEMV is stored only in its packing (one copy: tinygemm's packing is as large); M > MAX_M then
dequantizes to the activation dtype and uses cuBLAS (a transient ``[N, K]`` copy; prefill-sized M is
compute-bound, so the dequantization pass is small). On the CPU with float32 activations INT4 is
nibble-packed and dequantized per call before a dense matmul (``cpu_int4``: the float32 int4pack kernel is
10-60x slower at M = 64); with bfloat16 / float16 activations it stays on int4pack (its fast CPU path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.layers.quantization import fp8_w8a8
from kvserve.layers.quantization.cpu_int4 import CpuInt4

FP8_MAX = 448.0  # float8_e4m3fn
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class Int4Weight:
    """Canonical group-wise INT4: ``q`` uint8 ``[N, K]`` in [0, 15], ``scale``/``min`` float32 ``[N, K // g]``."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]``."""
        g = self.group_size
        return self.q.float() * self.scale.repeat_interleave(g, 1) + self.min.repeat_interleave(g, 1)


@dataclass
class Fp8Weight:
    """Per-output-channel FP8 e4m3: ``q`` float8_e4m3fn ``[N, K]``, ``scale`` float32 ``[N]``; ``w = q * scale[:, None]``."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Asymmetric min/max INT4 per group of ``group_size`` columns (as llama.cpp's Q4_1 does).

    ``w``: ``[N, K]`` float, ``K % group_size == 0``. Raises ValueError otherwise.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: in_features {k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = ((g - lo[..., None]) * inv[..., None]).round().clamp_(0, 15).to(torch.uint8)
    return Int4Weight(q.reshape(n, k), scale, lo, group_size)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: ``w ≈ q * scale[:, None]``; q int8 ``[N, K]``, scale float32 ``[N]``."""
    w = w.float()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    q = (w / scale[:, None]).round().clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 e4m3: ``w ≈ q.float() * scale[:, None]``; scale float32 ``[N]``."""
    w = w.float()
    scale = w.abs().amax(1).clamp_min(1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


#: formats served by the Triton GEMV on CUDA by default (``KVSERVE_TRITON_GEMV``: "1" all, "0" none, or a list).
#: INT4 is opt-in: on the H100 its M=1 GEMV reaches ~1.1 TB/s vs tinygemm's 1.3-1.9 (W2 4.75 vs 3.22 ms/token),
#: though it wins from M=4 up (docs/benchmarks/weight-quant.md); one packing is kept, so the batch-1
#: winner is the default.
TRITON_GEMV_DEFAULT = "fp8,int8"


def _use_triton(device: torch.device, fmt: str) -> bool:
    """Triton GEMV for small M: CUDA only; ``KVSERVE_TRITON_GEMV`` (read at load) = 1 | 0 | "fp8,int4,..."."""
    v = os.environ.get("KVSERVE_TRITON_GEMV", TRITON_GEMV_DEFAULT)
    return device.type == "cuda" and (v == "1" or fmt in v.split(","))


def _gemv():
    from kvserve.layers.quantization import triton_gemv  # imported on first CUDA use (the CPU never needs it)

    return triton_gemv


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class PackedInt4:
    """INT4 weights in the int4pack kernel layout of ``device`` (CPU: N padded to 16; CUDA: tinygemm),
    or on CUDA (default) in the Triton GEMV layout (``triton_gemv.pack_int4``; module doc); on the CPU
    with float32 activations as ``cpu_int4.CpuInt4`` (``self.cpu``).

    ``dtype`` is the activation dtype (bfloat16 is the fast one for int4pack; CUDA requires it).
    """

    def __init__(self, w: Int4Weight, device: torch.device, dtype: torch.dtype,
                 in_features: int | None = None) -> None:
        n, k_q = w.q.shape
        k = in_features or k_q  # the logical K (w may be zero-padded past it to a group multiple)
        g = w.group_size
        if g not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {g}")
        self.n, self.k, self.group_size = n, k, g
        cuda = device.type == "cuda"
        self.cpu: CpuInt4 | None = None
        if cuda and dtype != torch.bfloat16:
            raise ValueError("int4 weights on CUDA need --dtype bfloat16 (the tinygemm kernel's type)")
        self.triton = _use_triton(device, "int4")
        self.w4a16 = cuda and not self.triton and int4_kernel() == "w4a16"
        if self.w4a16:  # triton_w4a16 layout, float minima (ZP_FLOAT); scales/minima [Kp / g, N]
            from kvserve.layers.quantization import triton_w4a16 as tw

            self.packed = tw.pack(w.q.to(device), 4)
            tw.workspace(device)  # split-K counters allocated now, not under CUDA-graph capture
            n_groups = -(-tw.padded_k(k_q, 4) // g)
            sdt = torch.float16 if all(torch.equal(t.half().float(), t.float()) for t in (w.scale, w.min)) else dtype
            pad = n_groups - w.scale.shape[1]
            self.scale_t = F.pad(w.scale.float(), (0, pad)).t().contiguous().to(device, sdt)
            self.min_t = F.pad(w.min.float(), (0, pad)).t().contiguous().to(device, sdt)
            self.k_pad = k_q
            return
        if self.triton:  # pack_int4 layout; scales / minima [K/g, N], float16 when exact (GGUF) else dtype
            self.packed = _gemv().pack_int4(w.q.to(device), g)
            sdt = torch.float16 if all(torch.equal(t.half().float(), t.float()) for t in (w.scale, w.min)) else dtype
            self.scale_t = w.scale.t().contiguous().to(device, sdt)
            self.min_t = w.min.t().contiguous().to(device, sdt)
            self.k_pad = k_q
            return
        if not cuda and dtype == torch.float32:  # int4pack has no fast float32 CPU path (cpu_int4)
            self.cpu = CpuInt4(w.q, w.scale, w.min, g, "affine", in_features=k, device=device)
            self.packed = self.cpu.packed
            return
        n_pad = _round_up(n, 8 if cuda else 16)
        k_pad = _round_up(k_q, max(128, g) if cuda else g)  # tinygemm: K a multiple of innerKTiles(8) * 16
        q = F.pad(w.q, (0, k_pad - k_q, 0, n_pad - n))
        scale = F.pad(w.scale, (0, (k_pad - k_q) // g, 0, n_pad - n))
        zero = F.pad(w.min, (0, (k_pad - k_q) // g, 0, n_pad - n)) + 8 * scale
        self.k_pad = k_pad
        self.scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(device, dtype)
        if cuda:
            q = q.to(device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` -> ``x @ W.T`` ``[M, N]`` in x's dtype."""
        if self.w4a16:
            from kvserve.layers.quantization import triton_w4a16 as tw

            if x.shape[0] <= tw.MAX_M:
                return tw.gemm(x, self.packed, self.scale_t, self.min_t, self.n, self.group_size, 4, tw.ZP_FLOAT)
            wd = tw.dequantize(self.packed, self.scale_t, self.min_t, self.n, self.k, self.group_size, 4,
                               tw.ZP_FLOAT, x.dtype)
            return F.linear(x, wd)
        if self.triton:
            tg = _gemv()
            if x.shape[0] <= tg.MAX_M:
                return tg.wgemv(x, tg.FMT_INT4, self.packed, self.scale_t, self.min_t, self.n, self.group_size)
            wd = tg.int4_dequantize(self.packed, self.scale_t, self.min_t, self.n, self.group_size, x.dtype)
            return F.linear(x, wd[:, : self.k])
        if self.cpu is not None:
            return self.cpu.matmul(x)
        if self.k_pad != self.k:
            x = F.pad(x, (0, self.k_pad - self.k))
        if x.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x.contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                           self.scales_and_zeros)
        return y[:, : self.n] if y.shape[1] != self.n else y

    def tensors(self) -> list[torch.Tensor]:
        if self.cpu is not None:
            return self.cpu.tensors()
        if self.triton or self.w4a16:
            return [self.packed, self.scale_t, self.min_t]
        return [self.packed, self.scales_and_zeros]


def int4_kernel() -> str:
    """The CUDA INT4 kernel: ``KVSERVE_INT4_KERNEL`` (``w4a16`` | ``tinygemm``, read at load), else the measured
    default (``triton_w4a16.default_int4_kernel``)."""
    env = os.environ.get("KVSERVE_INT4_KERNEL")
    if env:
        return env
    from kvserve.layers.quantization import triton_w4a16 as tw

    return tw.default_int4_kernel()


class PackedInt8:
    """Per-channel INT8 for ``_weight_int8pack_mm`` (K padded to 32: the CPU kernel's block)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        self.n, self.k = q.shape
        self.k_pad = _round_up(self.k, 32)
        self.q = F.pad(q, (0, self.k_pad - self.k)).contiguous().to(device)
        self.scale = scale.to(device, dtype)
        self.triton = _use_triton(device, "int8")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton and x.shape[0] <= _gemv().MAX_M:
            return _gemv().wgemv(x, _gemv().FMT_INT8, self.q, self.scale, None, self.n)
        if self.k_pad != self.k:
            x = F.pad(x, (0, self.k_pad - self.k))
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


class PackedFp8:
    """Per-channel FP8 weights; activations quantized per token at run time (dynamic), ``torch._scaled_mm``
    on CUDA (float32 emulation on the CPU; ``fp8_w8a8``), the weight-only GEMV for ``M <= W8A8_MIN_M``.

    ``_scaled_mm`` wants K and N multiples of 16: padded here.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        self.n, self.k = q.shape
        self.n_pad, self.k_pad = _round_up(self.n, 16), _round_up(self.k, 16)
        q = q.view(torch.uint8)  # F.pad has no float8 kernel on every device
        q = F.pad(q, (0, self.k_pad - self.k, 0, self.n_pad - self.n)).view(torch.float8_e4m3fn)
        self.qt = q.to(device).t()  # column-major [K, N]: what _scaled_mm wants for its second operand
        self.scale = F.pad(scale, (0, self.n_pad - self.n), value=1.0).reshape(1, -1).to(device, torch.float32)
        self.dtype = dtype
        self.triton = _use_triton(device, "fp8")
        if self.triton:  # the same bytes, row-major [N_pad, K_pad] as uint8, and the scale as [N_pad]
            self.w_rows, self.scale_rows = self.qt.t().view(torch.uint8), self.scale.reshape(-1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` in x's dtype: weight-only GEMV for small M on CUDA, else W8A8 (fp8_w8a8)."""
        if self.triton and x.shape[0] <= fp8_w8a8.W8A8_MIN_M:
            return _gemv().wgemv(x, _gemv().FMT_FP8, self.w_rows, self.scale_rows, None, self.n)
        if self.k_pad != self.k:
            x = F.pad(x, (0, self.k_pad - self.k))
        xq, xs = fp8_w8a8.quantize_act(x)
        return self._scaled_mm(xq, xs, x.dtype)

    def matmul_fp8(self, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Already-quantized activations (``fp8_w8a8.Fp8Act``): ``xq`` float8_e4m3fn ``[M, K]``, ``xs`` ``[M, 1]``."""
        if self.k_pad != self.k:
            xq = F.pad(xq.view(torch.uint8), (0, self.k_pad - self.k)).view(torch.float8_e4m3fn)
        return self._scaled_mm(xq, xs, out_dtype)

    def _scaled_mm(self, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if xq.is_cuda:
            y = torch._scaled_mm(xq, self.qt, scale_a=xs, scale_b=self.scale, out_dtype=out_dtype,
                                 use_fast_accum=True)
        else:  # no FP8 GEMM on the CPU: the same numerics in float32
            y = fp8_w8a8.matmul_emulated(xq, xs, self.qt.t(), self.scale, out_dtype)
        return y[:, : self.n] if self.n_pad != self.n else y

    def tensors(self) -> list[torch.Tensor]:
        return [self.qt, self.scale]
