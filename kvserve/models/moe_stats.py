"""What a mixture-of-experts model holds and does: parameter counts and tokens routed per expert.

``parameter_counts`` gives the total parameters and the active ones per token (everything
except the routed experts a token does not select: ``(E - top_k)`` experts per MoE layer),
for the start-up log line. ``expert_token_counts`` sums the per-expert routed-token counters
the MoE blocks keep on the device (``SparseMoeBlock.expert_counts``) over the layers, for
``/metrics`` (``kvserve:moe_expert_tokens_total``) and the offline stats.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from kvserve.layers.moe import FusedMoE

logger = logging.getLogger("kvserve")


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(total, active per token)`` parameters of ``model`` (shared tensors counted once).

    Exact for a model built with one rank (e.g. on the meta device); under tensor or expert
    parallelism it counts this rank's share.
    """
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for m in model.modules():
        if isinstance(m, FusedMoE):
            per_expert = sum(t[0].numel() for t in (m.w13, m.w2, m.w13_bias, m.w2_bias) if t is not None)
            idle += (m.num_local_experts - min(m.top_k, m.num_local_experts)) * per_expert
    return total, total - idle


def describe_parameters(model: nn.Module) -> Optional[str]:
    """One line for the start-up log: total and active parameters per token, the experts per
    layer and top-k, for a model with MoE layers; None for a dense model."""
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not moes:
        return None
    total, active = parameter_counts(model)
    return (f"{type(model).__name__}: {_human(total)} parameters, {_human(active)} active per token "
            f"({len(moes)} MoE layers of {moes[0].num_experts} experts, top-{moes[0].top_k})")


def _human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def moe_blocks(model: nn.Module) -> list[Any]:
    """The modules that count routed tokens (an ``expert_counts`` buffer), in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, "expert_counts", None), torch.Tensor)]


def expert_token_counts(model: nn.Module) -> Optional[list[int]]:
    """Tokens routed to each expert since start, summed over the MoE layers (each token counts
    once per selected expert per layer), or None for a model without counters. One small
    device-to-host copy."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    sizes = {b.expert_counts.numel() for b in blocks}
    if len(sizes) != 1:
        return None
    return torch.stack([b.expert_counts for b in blocks]).sum(0).tolist()


class ExpertLoadReader:
    """Reads a model's routed-token counters for the step outputs, at most every ``interval_s``
    seconds (each read is one small device-to-host copy; on the CPU every step).

    Build with ``for_model`` (None for a model without MoE layers).
    """

    def __init__(self, model: nn.Module, interval_s: float) -> None:
        self.model, self.interval_s = model, interval_s
        self._last = float("-inf")

    @classmethod
    def for_model(cls, model: nn.Module) -> Optional["ExpertLoadReader"]:
        if not moe_blocks(model):
            return None
        on_cpu = next(model.parameters()).device.type == "cpu"
        return cls(model, 0.0 if on_cpu else 1.0)

    def maybe_read(self) -> Optional[list[int]]:
        """The cumulative per-expert counts when due, else None."""
        import time

        now = time.monotonic()
        if now - self._last < self.interval_s:
            return None
        self._last = now
        return expert_token_counts(self.model)
