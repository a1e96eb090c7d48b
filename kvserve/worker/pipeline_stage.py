"""One pipeline stage's forward: receive the previous stage's hidden states, run this stage's
layers, hand the result to the next stage (``torch.distributed`` point-to-point send/recv
between the same tensor-parallel rank of neighbouring stages; gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.attention.forward_context import forward_context
from kvserve.distributed import get_pp_rank, get_pp_size, pp_recv, pp_send


def stage_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, metas,
                  dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Run this stage on a step of ``T`` tokens (``input_ids`` / ``positions``: ``[T]`` int64).

    A stage after the first receives ``(hidden, residual)``, each ``[T, hidden_size]`` in
    ``dtype``; a stage before the last sends that pair on and returns None; the last stage
    returns the final-normed hidden ``[T, hidden_size]`` (to sample from). Every stage builds
    the same ``T`` from the same ``SchedulerOutput``, so no shapes travel.
    """
    rank, size = get_pp_rank(), get_pp_size()
    intermediate = None
    if rank > 0:
        shape = (input_ids.shape[0], int(model.config.hidden_size))
        intermediate = tuple(pp_recv([shape, shape], dtype, input_ids.device))
    with forward_context(metas):
        out = model(input_ids, positions, intermediate)
    if rank < size - 1:
        pp_send([t.to(dtype) for t in out])  # the receiver allocates ``dtype``
        return None
    return out
