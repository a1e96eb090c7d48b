"""Model building blocks: attention, linear and MoE layers, norms, rotary embeddings."""

from __future__ import annotations

import torch
from torch import nn


def materialize(module: nn.Module, device: str | torch.device) -> nn.Module:
    """``module.to_empty(device=device)`` without its first-call cost: every parameter and buffer
    of a module built on the meta device allocated (uninitialized) on ``device``, same shapes,
    strides and dtypes. Returns ``module``.

    ``torch.empty_like`` of a meta tensor runs through torch's Python reference kernels, which
    import sympy (~1.2 s of CPU, once per process); ``torch.empty_strided`` does not.
    """
    return module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
