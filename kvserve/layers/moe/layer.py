"""The mixture-of-experts layer: routed experts with their weights stacked, one call per step.

``FusedMoE`` holds every local expert's gate/up projection stacked as ``w13 [E_local, 2 * I_local,
H]`` (gate rows first, then up) and its down projection as ``w2 [E_local, H, I_local]``, plus
optional biases (gpt-oss). ``forward(hidden, router_logits)`` selects experts
(``routing.select_experts``), runs them and returns the weighted sum over each token's experts.

Parallelism (one all-reduce at the end, like a row-parallel linear):
- tensor parallel (default): every rank holds every expert, the intermediate dimension split
  (Megatron-LM's split inside each expert);
- expert parallel (``--enable-expert-parallel``, vLLM's flag): the experts split across the
  ranks in contiguous ranges, each whole; every rank routes all tokens, runs only its own
  experts, and the partial sums are all-reduced. Attention stays tensor parallel.

Compute: on CUDA the Triton fused kernels of ``triton_moe`` (tokens sorted and padded by expert,
one grouped GEMM per projection); on the CPU ``fused_experts_torch`` (a loop over the experts hit).
``KVSERVE_MOE_TRITON`` (read at import; tests set ``FORCE_TRITON``): ``1`` the Triton path
everywhere (the CPU runs it under ``TRITON_INTERPRET=1``), ``0`` the torch loop everywhere.

Quantized experts (``--quantization fp8 | int8``, ``quantize_experts``): weight-only FP8 e4m3 /
INT8 with float32 per-expert per-output-channel scales (``w13_scale [E_local, 2I]``,
``w2_scale [E_local, H]``), dequantized in the kernel's K loop. GPTQ / AWQ checkpoints
(``set_group_quant_experts``): 4/8-bit group-quantized experts kept packed
(``group_quant_experts.GroupQuantExperts``), run by the fused W4A16 MoE kernel on CUDA.

Activations: ``silu`` (SwiGLU, ``silu(gate) * up``) and ``swigluoai`` (gpt-oss's clamped
SwiGLU: ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``, ``(up + 1) * gate *
sigmoid(alpha * gate)``).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from kvserve.distributed import get_ep_size, get_tp_rank, get_tp_size, tp_all_reduce
from kvserve.layers.moe.routing import select_experts

ACTIVATIONS = ("silu", "swigluoai")
#: expert weight formats ``quantize_experts`` produces (``--quantization``); others leave the experts dense
EXPERT_QUANT_METHODS = ("fp8", "int8")
_ENV = os.environ.get("KVSERVE_MOE_TRITON", "")
#: run the Triton kernels on any device (tests: the CPU under the Triton interpreter)
FORCE_TRITON = _ENV == "1"
#: never run them (the torch loop on CUDA too)
DISABLE_TRITON = _ENV == "0"


def moe_activation(gate_up: torch.Tensor, activation: str, alpha: float = 1.702,
                   limit: Optional[float] = 7.0) -> torch.Tensor:
    """``gate_up [..., 2 * I]`` (gate half first) -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, activation: str = "silu",
                        w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                        expert_start: int = 0, swiglu_alpha: float = 1.702,
                        swiglu_limit: Optional[float] = 7.0, w13_scale: Optional[torch.Tensor] = None,
                        w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference (and CPU) expert computation: a loop over the experts that received tokens.

    hidden ``[T, H]``; w13 ``[E_local, 2I, H]``; w2 ``[E_local, H, I]``; topk ``[T, k]`` (ids are
    global; experts outside ``[expert_start, expert_start + E_local)`` contribute nothing).
    Quantized experts (FP8 / INT8 ``w13`` / ``w2``) come with float32 per-output-channel scales
    ``w13_scale [E_local, 2I]`` / ``w2_scale [E_local, H]``; each expert used is dequantized to
    ``hidden``'s dtype. Returns ``[T, H]`` in ``hidden``'s dtype (accumulated in float32).
    """
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    local = topk_ids.long() - expert_start
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, slot = (local == e).nonzero(as_tuple=True)
        x = hidden[tok]
        h = x @ _expert_weight(w13, w13_scale, e, hidden.dtype).t()
        if w13_bias is not None:
            h = h + w13_bias[e]
        h = moe_activation(h, activation, swiglu_alpha, swiglu_limit)
        y = h @ _expert_weight(w2, w2_scale, e, hidden.dtype).t()
        if w2_bias is not None:
            y = y + w2_bias[e]
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].unsqueeze(-1))
    return out.to(hidden.dtype)


def _expert_weight(w: torch.Tensor, scale: Optional[torch.Tensor], e: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e]
    return (w[e].float() * scale[e].float()[:, None]).to(dtype)


def quantize_expert_weights(w: torch.Tensor, method: str, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> (``q [E, N, K]`` float8_e4m3fn or int8, ``scale [E, N]`` float32), per-expert
    per-output-channel symmetric (``kernels.quantize_fp8`` / ``quantize_int8``), ``chunk`` experts at a
    time (bounds the float32 transient). Raises ValueError for another method."""
    from kvserve.layers.quantization.kernels import quantize_fp8, quantize_int8

    if method not in EXPERT_QUANT_METHODS:
        raise ValueError(f"expert quantization must be one of {EXPERT_QUANT_METHODS}, got {method!r}")
    e, n, k = w.shape
    fn = quantize_fp8 if method == "fp8" else quantize_int8
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn if method == "fp8" else torch.int8, device=w.device)
    scale = torch.empty(e, n, dtype=torch.float32, device=w.device)
    for s in range(0, e, chunk):
        qs, ss = fn(w[s:s + chunk].reshape(-1, k))
        q[s:s + chunk] = qs.view(-1, n, k)
        scale[s:s + chunk] = ss.view(-1, n)
    return q, scale


class FusedMoE(nn.Module):
    """Routed experts of one MoE layer.

    Args:
        num_experts: routed experts in the model (E).
        top_k: experts per token.
        hidden_size: H; intermediate_size: each expert's intermediate size I (whole).
        dtype: parameter dtype.
        renormalize, scoring_func, num_expert_group, topk_group, routed_scaling_factor:
            routing (``routing.select_experts``); ``e_score_correction_bias`` is a parameter
            when ``use_correction_bias``.
        activation: ``silu`` or ``swigluoai``; swiglu_alpha / swiglu_limit for the latter.
        has_bias: experts carry biases (``w13_bias [E_local, 2I_local]``, ``w2_bias [E_local, H]``).
        reduce_results: all-reduce the output over the ranks (False when the caller sums
            this output with another partial sum first, e.g. shared experts).

    Raises ValueError: ``top_k`` above the experts, an unknown activation, experts not divisible
    by the expert-parallel size, an intermediate size not divisible by the tensor-parallel size.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 dtype: torch.dtype, renormalize: bool = True, scoring_func: str = "softmax",
                 use_correction_bias: bool = False, num_expert_group: Optional[int] = None,
                 topk_group: Optional[int] = None, routed_scaling_factor: float = 1.0,
                 activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: Optional[float] = 7.0,
                 has_bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts "
                             f"({num_experts})")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {activation!r}; supported: {ACTIVATIONS}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize, self.scoring_func = renormalize, scoring_func
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        self.reduce_results = reduce_results
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.ep_size = get_ep_size()
        if self.ep_size > 1:  # experts split whole across the ranks; no intermediate split
            if num_experts % self.ep_size:
                raise ValueError(f"the {num_experts} experts are not divisible by the expert-parallel size "
                                 f"{self.ep_size}")
            self.num_local_experts = num_experts // self.ep_size
            self.expert_start = self.tp_rank * self.num_local_experts
            self.intermediate_local = intermediate_size
        else:
            if intermediate_size % self.tp_size:
                raise ValueError(f"tensor_parallel_size {self.tp_size} must divide the expert intermediate size "
                                 f"({intermediate_size})")
            self.num_local_experts, self.expert_start = num_experts, 0
            self.intermediate_local = intermediate_size // self.tp_size
        e, i, h = self.num_local_experts, self.intermediate_local, hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        if has_bias:
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)
        else:
            self.w13_bias = self.w2_bias = None
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if use_correction_bias else None)
        self.quant_method: Optional[str] = None  # set by quantize_experts / set_group_quant_experts
        self.w13_quant = self.w2_quant = None  # GroupQuantExperts (set_group_quant_experts)
        self.register_buffer("w13_scale", None, persistent=False)
        self.register_buffer("w2_scale", None, persistent=False)

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds."""
        return range(self.expert_start, self.expert_start + self.num_local_experts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> bool:
        """Copy one expert's checkpoint tensor into this rank's slice of ``param``.

        ``shard_id``: ``w1`` (gate, ``[I, H]``), ``w3`` (up, ``[I, H]``), ``w2`` (down, ``[H, I]``);
        biases ``[I]`` / ``[H]`` with the same ids. Returns False (nothing copied) for an expert
        another rank holds. Raises ValueError naming the expected shape on a mismatch.
        """
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            if not 0 <= expert_id < self.num_experts:
                raise ValueError(f"expert {expert_id} out of range (the model has {self.num_experts})")
            return False
        i, full_i = self.intermediate_local, self.intermediate_size
        start = 0 if self.ep_size > 1 else self.tp_rank * i
        is_bias = param.dim() == 2
        dst = param[local]
        if shard_id in ("w1", "w3"):
            want = (full_i,) if is_bias else (full_i, self.hidden_size)
            src = loaded.narrow(0, start, i) if tuple(loaded.shape) == want else None
            dst = dst.narrow(0, 0 if shard_id == "w1" else i, i)
        elif shard_id == "w2":
            want = (self.hidden_size,) if is_bias else (self.hidden_size, full_i)
            if tuple(loaded.shape) != want:
                src = None
            elif is_bias:  # added once after the sum: only rank 0 of a tensor-parallel split keeps it
                src = loaded if (self.ep_size > 1 or self.tp_rank == 0) else torch.zeros_like(loaded)
            else:
                src = loaded.narrow(1, start, i)
        else:
            raise ValueError(f"unknown expert shard {shard_id!r} (w1, w2 or w3)")
        if src is None:
            raise ValueError(f"expert {expert_id} {shard_id}: checkpoint shape {tuple(loaded.shape)}, expected {want}")
        dst.copy_(src)
        return True

    def select(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits ``[T, E]`` -> (weights ``[T, k]`` float32, ids ``[T, k]`` int32)."""
        return select_experts(router_logits, self.top_k, renormalize=self.renormalize,
                              scoring_func=self.scoring_func, e_score_correction_bias=self.e_score_correction_bias,
                              num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                              routed_scaling_factor=self.routed_scaling_factor)

    def _plain_softmax_routing(self) -> bool:
        return (self.scoring_func == "softmax" and self.e_score_correction_bias is None
                and not (self.num_expert_group and self.num_expert_group > 1))

    @torch.no_grad()
    def quantize_experts(self, method: str) -> bool:
        """Quantize ``w13`` / ``w2`` in place (after loading) to ``method`` (``fp8`` | ``int8``, weight-only,
        per-expert per-output-channel scales in ``w13_scale`` / ``w2_scale``). Returns False (the experts
        stay dense) for any other method."""
        if method not in EXPERT_QUANT_METHODS or self.quant_method is not None:
            return False
        for name in ("w13", "w2"):
            q, scale = quantize_expert_weights(getattr(self, name).data, method)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", scale)
        self.quant_method = method
        return True

    @torch.no_grad()
    def set_group_quant_experts(self, method: str, w13, w2) -> None:
        """Keep GPTQ / AWQ experts packed: ``w13`` / ``w2`` are ``GroupQuantExperts`` of shapes
        ``(E_local, 2I_local, H)`` / ``(E_local, H, I_local)``; the dense ``w13`` / ``w2`` are freed.
        Raises ValueError for another method or shape."""
        from kvserve.layers.moe.group_quant_experts import GROUP_QUANT_METHODS

        if method not in GROUP_QUANT_METHODS:
            raise ValueError(f"group-quantized experts must be one of {GROUP_QUANT_METHODS}, got {method!r}")
        e, i, h = self.num_local_experts, self.intermediate_local, self.hidden_size
        for name, q, want in (("w13", w13, (e, 2 * i, h)), ("w2", w2, (e, h, i))):
            if tuple(q.shape) != want:
                raise ValueError(f"{name}: group-quantized experts of shape {tuple(q.shape)}, expected {want}")
        dtype, dev = self.w13.dtype, self.w13.device
        self.w13 = nn.Parameter(torch.empty(0, 2 * i, h, dtype=dtype, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, h, i, dtype=dtype, device=dev), requires_grad=False)
        self.w13_quant, self.w2_quant = w13, w2
        self.quant_method = method

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, H]``, router_logits ``[T, E]`` -> ``[T, H]`` (summed over the ranks when
        ``reduce_results``)."""
        triton_path = (hidden.is_cuda or FORCE_TRITON) and not DISABLE_TRITON and hidden.shape[0] > 0
        if triton_path and self._plain_softmax_routing():
            from kvserve.layers.moe.triton_moe import topk_softmax  # one launch instead of ~6 torch ops

            weights, ids = topk_softmax(router_logits, self.top_k, self.renormalize)
            if self.routed_scaling_factor != 1.0:
                weights = weights * self.routed_scaling_factor
        else:
            weights, ids = self.select(router_logits)
        kw = dict(activation=self.activation, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                  expert_start=self.expert_start, swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit,
                  w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        if self.w13_quant is not None:
            kw.pop("w13_scale"), kw.pop("w2_scale")
            if triton_path:
                from kvserve.layers.moe.group_quant_experts import fused_experts_w4a16

                out = fused_experts_w4a16(hidden, self.w13_quant, self.w2_quant, weights, ids, **kw)
            else:  # the torch loop dequantizes each expert hit (GroupQuantExperts[e])
                out = fused_experts_torch(hidden, self.w13_quant, self.w2_quant, weights, ids, **kw)
        elif triton_path:
            from kvserve.layers.moe.triton_moe import fused_experts_triton  # triton imported on first use

            out = fused_experts_triton(hidden, self.w13, self.w2, weights, ids, **kw)
        else:
            out = fused_experts_torch(hidden, self.w13, self.w2, weights, ids, **kw)
        if self.reduce_results and (self.tp_size > 1):
            out = tp_all_reduce(out)
        return out
