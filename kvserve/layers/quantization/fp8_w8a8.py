"""FP8 W8A8: dynamic per-token activation quantization and the FP8 GEMMs behind ``--quantization fp8``.

Weights: FP8 e4m3 with a float32 scale per output channel (``PackedFp8``, kernels.py; per-tensor
checkpoints are expanded to it) or per 128 x 128 block (``PackedFp8Block``, DeepSeek-V3's
``weight_block_size: [128, 128]``). Activations: quantized at run time per token
(``scale = amax(row) / 448``) for channel-scaled weights, per token per 128 columns for block-scaled
ones (DeepSeek-V3, arXiv:2412.19437 §3.3), so both operands of the GEMM are FP8:

* CUDA, ``M > W8A8_MIN_M``: ``torch._scaled_mm`` with row-wise scales (``scale_a [M, 1]``,
  ``scale_b [1, N]`` float32, bf16 out; cuBLASLt / CUTLASS FP8 tensor cores), or the Triton
  block-scaled GEMM (``triton_fp8.block_gemm``). The activation quantization is one Triton kernel,
  or none where the ``RMSNorm`` or ``SiluAndMul`` right before the GEMM emits the FP8 input itself
  (``Fp8Act``; ``attach_fp8_norms``).
* CUDA, ``M <= W8A8_MIN_M`` (decode at small batch): the weight-only Triton GEMV of ``triton_gemv``
  (bf16 activations; reading the weight is the cost there, and it reads the same FP8 bytes).
* CPU: no FP8 GEMM worth running; ``matmul_emulated`` computes the same quantized numerics in float32
  (``(x_q * x_s) @ (w_q * w_s)^T``): the reference the tests check the CUDA kernels against.
  The engine refuses fp8 on the CPU unless ``KVSERVE_FP8_EMULATE=1`` (tests, numerics studies).

Error bound (W8A8 against the float product of the *dequantized weights* with unquantized
activations): e4m3 rounds to 3 mantissa bits, so each activation carries a relative error <= 2^-4
of itself, and ``|y - y_ref| <= 2^-4 * sum_k |x_k| |w_nk|`` per output (plus the output dtype's
rounding); for random-sign data the error is ~2^-4 / sqrt(3) ~ 4% of the row norm, ``rel_l2 < 0.05``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.layers.activation import SiluAndMul

FP8_MAX = 448.0
#: largest M served by the weight-only GEMV on CUDA; above it the W8A8 GEMM runs. H200 (benchmarks/gpu_fp8_gemm.py,
#: 8B projections): the GEMV wins at M = 16 (down_proj 27.6 vs 38.6 us), W8A8 from M = 64 (39.0 vs 60.8 us).
W8A8_MIN_M = 32
BLOCK = 128  # block-scaled checkpoints: 128 x 128 weight blocks, 1 x 128 activation groups
#: the documented relative L2 bound of W8A8 against the dequantized-weight float product (module doc)
W8A8_REL_BOUND = 0.05


def emulate_on_cpu() -> bool:
    """``KVSERVE_FP8_EMULATE=1``: let ``--quantization fp8`` run on the CPU with the float emulation."""
    return os.environ.get("KVSERVE_FP8_EMULATE", "0") == "1"


@dataclass
class Fp8Act:
    """Activations already quantized per token (what a fused ``RMSNorm`` hands to an FP8 linear).

    ``q`` float8_e4m3fn ``[M, K]``; ``scale`` float32 ``[M, 1]`` (``x ~ q * scale``); ``dtype``: the
    model dtype the GEMM writes.
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """``[M, K]`` in ``dtype``."""
        return (self.q.float() * self.scale).to(self.dtype)


@dataclass
class Fp8BlockWeight:
    """Block-scaled FP8 weight: ``q`` float8_e4m3fn ``[N, K]``, ``scale`` float32 ``[N, ceil(K / 128)]`` (a
    block checkpoint's grid expanded along N by ``expand_block_scale``); ``w = q * scale`` per 128 columns."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_act_ref(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the dynamic activation quantization: ``x [M, K]`` -> ``(q float8_e4m3fn [M, K],
    scale float32 [M, G])``, ``G = 1`` (``group`` None, per token) or ``ceil(K / group)``."""
    m, k = x.shape
    group = group or k
    xf = F.pad(x.float(), (0, (-k) % group)).reshape(m, -1, group)
    s = xf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, -1)[:, :k], s


def quantize_act(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act_ref``, as one Triton kernel on CUDA."""
    if x.is_cuda:
        from kvserve.layers.quantization import triton_fp8

        return triton_fp8.quant_fp8(x.contiguous(), group)
    return quantize_act_ref(x, group)


def _expand_cols(s: torch.Tensor, k: int) -> torch.Tensor:
    return s.repeat_interleave(BLOCK, 1)[:, :k] if s.shape[1] > 1 else s


def matmul_emulated(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Float32 reference of an FP8 GEMM: ``(xq * xs) @ (wq * ws)^T`` in ``out_dtype``.

    ``xq [M, K]``, ``wq [N, K]`` float8_e4m3fn; ``xs`` ``[M, 1]`` or ``[M, ceil(K/128)]``; ``ws``
    ``[N]`` / ``[N, 1]`` (per channel) or ``[N, ceil(K/128)]`` (128-column groups).
    """
    k = xq.shape[1]
    x = xq.float() * _expand_cols(xs.float(), k)
    w = wq.float() * _expand_cols(ws.float().reshape(wq.shape[0], -1), k)
    return (x @ w.T).to(out_dtype)


def expand_block_scale(scale_inv: torch.Tensor, n: int, k: int, block: tuple[int, int] = (BLOCK, BLOCK)
                       ) -> torch.Tensor:
    """A ``[ceil(N / bn), ceil(K / bk)]`` block scale grid -> per row per 128 columns ``[N, ceil(K / 128)]``.

    Raises ValueError when the grid does not cover an ``N x K`` weight, or ``bk`` is not 128.
    """
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)}, expected {want} for a {n}x{k} weight in "
                         f"{bn}x{bk} blocks")
    if bk != BLOCK:
        raise ValueError(f"weight_block_size [{bn}, {bk}]: the FP8 block GEMM needs 128-column blocks")
    return scale_inv.float().repeat_interleave(bn, 0)[:n].contiguous()


class PackedFp8Block:
    """FP8 e4m3 weights ``[N, K]`` with a float32 scale per row per 128 columns (``[N, ceil(K / 128)]``).

    CUDA: activations quantized per token per 128 columns, ``triton_fp8.block_gemm``; with
    ``KVSERVE_FP8_BLOCK=dequant`` (read at load) the weight is dequantized to the model dtype once at
    load and cuBLAS runs instead (twice the memory; the fallback the benchmark compares).
    CPU: ``matmul_emulated``.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        self.n, self.k = q.shape
        if scale.shape != (self.n, -(-self.k // BLOCK)):
            raise ValueError(f"block scale shape {tuple(scale.shape)}, expected {(self.n, -(-self.k // BLOCK))}")
        self.dtype = dtype
        self.dequant = device.type == "cuda" and os.environ.get("KVSERVE_FP8_BLOCK", "triton") == "dequant"
        if self.dequant:
            self.w = matmul_emulated_weight(q.to(device), scale.to(device), dtype)
            self.q = self.scale = None
        else:
            self.q = q.to(device).contiguous()
            self.scale = scale.to(device, torch.float32).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` (model dtype) -> ``[M, N]`` in x's dtype."""
        if self.dequant:
            return F.linear(x, self.w)
        xq, xs = quantize_act(x, BLOCK)
        if x.is_cuda:
            from kvserve.layers.quantization import triton_fp8

            return triton_fp8.block_gemm(xq, xs, self.q, self.scale, x.dtype)
        return matmul_emulated(xq, xs, self.q, self.scale, x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.w] if self.dequant else [self.q, self.scale]


def matmul_emulated_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize ``q [N, K]`` with per-row-per-128-column ``scale`` to ``dtype``."""
    return (q.float() * _expand_cols(scale.float(), q.shape[1])).to(dtype)


class SiluAndMulFp8(SiluAndMul):
    """``SiluAndMul`` that, for more than ``fp8_out_min_m`` rows, returns its output quantized per token
    (``Fp8Act``; one Triton kernel on CUDA) for the FP8 linear after it (``attach_fp8_norms``)."""

    fp8_out_min_m: int | None = None

    def forward(self, x: torch.Tensor):
        if self.fp8_out_min_m is None or x.dim() != 2 or x.shape[0] <= self.fp8_out_min_m:
            return super().forward(x)
        if x.is_cuda and x.stride(-1) == 1:
            from kvserve.layers.quantization import triton_fp8

            q, s = triton_fp8.silu_mul_quant_fp8(x)
        else:
            q, s = quantize_act_ref(super().forward(x))
        return Fp8Act(q, s, x.dtype)


def attach_fp8_norms(model: torch.nn.Module) -> int:
    """Fuse the per-token FP8 quantization into the module before channel-scaled FP8 linears.

    A decoder layer class opts in with ``fp8_input_producers``: the dotted path of a module whose output
    only linears read -> those linears' paths (Llama: ``input_layernorm`` -> ``self_attn.qkv_proj``,
    ``mlp.act`` -> ``mlp.down_proj``). An ``RMSNorm`` is switched in place (``fp8_out_min_m``); a plain
    ``SiluAndMul`` is replaced by ``SiluAndMulFp8``. Only when all the linears take ``Fp8Act`` input, for
    M above the row count where they use the weight-only GEMV. ``KVSERVE_FP8_NORM_QUANT=0`` turns it off.
    Returns the number of modules switched.
    """
    if os.environ.get("KVSERVE_FP8_NORM_QUANT", "1") == "0":
        return 0
    n = 0
    for layer in list(model.modules()):
        for src_path, paths in getattr(type(layer), "fp8_input_producers", {}).items():
            src = _get(layer, src_path)
            linears = [_get(layer, p) for p in paths]
            if src is None or not all(getattr(lin, "accepts_fp8_input", False) for lin in linears):
                continue
            if type(src) is SiluAndMul:
                parent, _, attr = src_path.rpartition(".")
                src = SiluAndMulFp8()
                setattr(_get(layer, parent) if parent else layer, attr, src)
            if not hasattr(src, "fp8_out_min_m"):
                continue
            src.fp8_out_min_m = W8A8_MIN_M if any(lin.packed.triton for lin in linears) else 0
            n += 1
    return n


def _get(module: torch.nn.Module, path: str):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
