"""Pipeline-parallel stages of a decoder model: which layers a stage holds, and the hook that
drops the rest before the weights are materialized.

Layers split as vLLM splits them (``get_pp_indices``): ``num_layers // P`` per stage, and the
remainder one each to the stages just before the last (the last stage also runs the final
norm, the LM head and sampling, so it gets fewer layers). ``KVSERVE_PP_LAYER_PARTITION``
("8,8,7,7": layers per stage, summing to the layer count) overrides the split, like vLLM's
``VLLM_PP_LAYER_PARTITION``. The first stage holds the embedding, the last the final norm and
the LM head (and the embedding too when the head is tied to it).

A model supports pipeline parallelism by setting ``supports_pipeline_parallel = True`` and
giving its inner decoder (``model.model``) ``embed_tokens``, ``layers`` (a ModuleList indexed
by layer number), ``norm``, ``start_layer`` / ``end_layer``, and a forward that takes
``intermediate=(hidden, residual)`` on stages after the first and returns that pair on stages
before the last (``kvserve.models.llama.LlamaModel``).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator

import torch
from torch import nn

PARTITION_ENV = "KVSERVE_PP_LAYER_PARTITION"


class PPMissingLayer(nn.Module):
    """Stands in for a layer another stage holds (no parameters; never called)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this layer belongs to another pipeline stage")


def pp_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layers per stage, ``[n_0, ..., n_{P-1}]`` summing to ``num_layers``.

    Raises ValueError when there are fewer layers than stages, or when
    ``KVSERVE_PP_LAYER_PARTITION`` does not list ``pp_size`` positive counts summing to ``num_layers``.
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    env = os.environ.get(PARTITION_ENV)
    if env:
        try:
            parts = [int(x) for x in env.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={env!r}: expected comma-separated integers") from None
        if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(f"{PARTITION_ENV}={env!r}: needs {pp_size} positive layer counts summing to "
                             f"the model's {num_layers} layers")
        return parts
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):  # remainder to the stages before the last
        parts[-i] += 1
    return parts


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the layers stage ``pp_rank`` holds."""
    parts = pp_partition(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def check_pipeline_parallel(cls: type, hf_config: Any, pp_size: int) -> None:
    """Raise ValueError when ``cls`` cannot be split into ``pp_size`` stages."""
    if pp_size == 1:
        return
    if not getattr(cls, "supports_pipeline_parallel", False):
        raise ValueError(f"{cls.__name__} does not support pipeline parallelism yet "
                         f"(pipeline_parallel_size {pp_size}); Llama-family models do")
    pp_partition(int(hf_config.num_hidden_layers), pp_size)


def apply_pipeline_stage(model: nn.Module, pp_rank: int, pp_size: int) -> None:
    """Keep only stage ``pp_rank``'s part of ``model`` (built on the meta device, before its
    parameters are allocated): layers outside its range become ``PPMissingLayer``; the
    embedding stays on the first stage (and the last when the LM head is tied to it), the
    final norm and the LM head on the last. Sets ``model.pp_dropped``: checkpoint-name
    prefixes the stage skips. Raises ValueError for a model without the hook."""
    check_pipeline_parallel(type(model), model.config, pp_size)
    inner = model.model
    n = len(inner.layers)
    start, end = pp_layer_range(n, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    dropped = []
    for i in range(n):
        if not start <= i < end:
            inner.layers[i] = PPMissingLayer()
            dropped.append(f"model.layers.{i}.")
    inner.start_layer, inner.end_layer = start, end
    tied = getattr(model, "lm_head", None) is None
    if not first and not (last and tied):
        inner.embed_tokens = None
        dropped.append("model.embed_tokens.")
        if tied:
            dropped.append("lm_head.")  # it would fill the embedding
    if not last:
        inner.norm = None
        dropped.append("model.norm.")
        if not tied:
            model.lm_head = None
            dropped.append("lm_head.")
    model.pp_dropped = tuple(dropped)


def skip_other_stages(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without the tensors of modules this stage dropped (all of them with one stage)."""
    dropped = getattr(model, "pp_dropped", ())
    for name, tensor in weights:
        if not dropped or not name.startswith(dropped):
            yield name, tensor
