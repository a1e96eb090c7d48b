"""Random weights for benchmarking without a checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.norm import GemmaRMSNorm, RMSNorm


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter in place: norms get 1 (zero-centred Gemma norms 0), biases 0, the
    rest normal(0, ``std``).

    Runs on the parameters' own device (fast at 8B shapes on a GPU), seeded by ``seed``.
    """
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    gemma_norms = {id(m.weight) for m in model.modules() if isinstance(m, GemmaRMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if id(p) in norm_params:
            p.fill_(1.0)
        elif id(p) in gemma_norms:
            p.zero_()
        elif name.endswith(".bias"):
            p.zero_()
        else:
            g = generators.get(p.device)
            if g is None:
                g = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, std, generator=g)
