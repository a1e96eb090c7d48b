"""The attention layer models call: q/k/v -> this layer's backend over this layer's paged cache.

Each layer owns its binding: ``bind_attention(model, backend)`` gives every ``Attention``
module of a model its backend implementation (right after the model is built), and
``bind_kv_cache(model, caches)`` its own KV cache tensor (once the cache is allocated). The
forward context carries only the step's metadata, so two models in one process (a target
and a draft) hold separate caches and may use different backends.

Rotated KV formats (int4 / int2, ``KVFormat.rotated``): ``bind_kv_cache`` also binds the
layer's rotation ``R`` (``kvserve/attention/kv_rotation.py``, QuaRot arXiv:2404.00456), and
``forward`` then hands the backend ``q R``, ``k R``, ``v R`` and returns its output times
``R^T`` -- the same for every backend and for bounded KV -- unless the backend rotates in its
own kernels (``AttentionBackend.fuses_kv_rotation``: Triton, no extra launches), which then
gets ``kv_rotation=R`` and the unrotated tensors. Where the layer's value and output
projections are dense, ``bind_kv_cache`` folds ``R`` into them (``bind_value_rotation``): v
then arrives as ``v R``, the output leaves in the rotated basis, and only q and k rotate at
run time (``values_rotated``). Other formats bind no matrix and run exactly as before.
int4 / int2 layers also hold ``kv_residual`` (bound by the model runner), each request's
filling block exact in the compute dtype, handed to the backend as ``kv_residual=``
(``kvserve/attention/kv_residual.py``); bounded KV does not use it. The
rotation runs after the piecewise CUDA graph split hook: while pieces are captured the hook
returns before it, and at replay ``layer.forward`` runs eagerly between the pieces, so it runs
exactly once per step (outside the graph pieces).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.forward_context import get_forward_context
from kvserve.attention.kv_rotation import bind_value_rotation, kv_rotation_for, rotate


class Attention(nn.Module):
    """Paged attention for one layer.

    Args:
        num_heads: query heads; num_kv_heads: KV heads (divides num_heads; GQA/MQA).
        head_size: per-head dim; scale: softmax scale.
        layer_idx: this layer's index among the model's attention layers.
        sliding_window: optional window in tokens (Gemma 3 local layers, Mistral).

    Attributes (bound by the model runner):
        impl: the attention backend implementation.
        kv_cache: this layer's paged KV tensor (layout from the backend).
        kv_cache_group_id: which KV cache group's metadata (block table) it reads.
        split_hook: while piecewise CUDA graphs are captured, called instead of attention
            (``hook(layer, q, k, v) -> o``) to end the current graph piece.
        kv_rotation: ``[head_size, head_size]`` float32 orthogonal matrix for a rotated KV
            format (int4 / int2), else None (bound by ``bind_kv_cache``).
        values_rotated_by: the rotation folded into this layer's value and output projections
            (``kv_rotation.bind_value_rotation``), else None: v then arrives as ``v R`` and
            the output is returned in the rotated basis (``o_proj`` takes it).
        kv_residual: for a format that keeps the filling block exact (``KVFormat.residual``),
            ``[2, slots + 1, 2, block_size, num_kv_heads, head_size]`` in the compute dtype
            (``kvserve/attention/kv_residual.py``), bound by the model runner; else None.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.impl: Optional[AttentionBackend] = None
        self.kv_cache: Optional[torch.Tensor] = None
        self.kv_cache_group_id = 0
        self.split_hook: Optional[Callable] = None
        self.kv_rotation: Optional[torch.Tensor] = None
        self.values_rotated_by: Optional[torch.Tensor] = None
        self.kv_residual: Optional[torch.Tensor] = None

    @property
    def values_rotated(self) -> bool:
        """Whether v arrives rotated and the output leaves rotated (weights folded)."""
        return self.values_rotated_by is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, num_heads * head_size]``, k/v ``[T, num_kv_heads * head_size]`` -> ``[T, num_heads * head_size]``."""
        if self.split_hook is not None:
            return self.split_hook(self, q, k, v)
        meta = get_forward_context().attn_metadata[self.kv_cache_group_id]
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        r = self.kv_rotation
        folded = self.values_rotated
        extra = {}
        if self.kv_residual is not None and meta.residual_slots is not None and meta.bounded is None:
            extra["kv_residual"] = self.kv_residual
        if r is not None and meta.bounded is None and self.impl.fuses_kv_rotation:  # rotated in its kernels
            out = self.impl.forward(q, k, v, self.kv_cache, meta, self.scale, self.sliding_window, kv_rotation=r,
                                    values_rotated=folded, **extra)
            return out.reshape(t, self.num_heads * self.head_size)
        if r is not None:  # rotated KV format: attend in the rotated basis (scores unchanged)
            q, k = rotate(q, r), rotate(k, r)
            v = v if folded else rotate(v, r)
        if meta.bounded is not None:  # bounded KV (StreamingLLM / H2O): kvserve.attention.bounded
            if r is None:
                out = self.impl.forward_bounded(q, k, v, self.kv_cache, meta, self.scale)
            else:
                out = self.impl.forward_bounded(q, k, v, self.kv_cache, meta, self.scale, kv_rotation=r)
        else:
            out = self.impl.forward(q, k, v, self.kv_cache, meta, self.scale, self.sliding_window, **extra)
        if r is not None and not folded:
            out = rotate(out, r.T)
        return out.reshape(t, self.num_heads * self.head_size)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's ``Attention`` modules, ordered by ``layer_idx``."""
    return sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)


def bind_attention(model: nn.Module, backend: AttentionBackend) -> None:
    """Give every attention layer of ``model`` the backend ``backend``."""
    for layer in attention_layers(model):
        layer.impl = backend


def bind_kv_cache(model: nn.Module, kv_caches: dict[int, torch.Tensor],
                  layer_group: Optional[dict[int, int]] = None) -> None:
    """Give each attention layer its KV tensor (``kv_caches[layer_idx]``), KV cache group and,
    for a rotated format (int4 / int2), its rotation matrix (``Attention.kv_rotation``), folded
    into the layer's value / output weights where they are dense (``bind_value_rotation``).

    Raises KeyError when a layer has no tensor, ValueError when a tensor matches no KV format.
    """
    for layer in attention_layers(model):
        layer.kv_cache = kv_caches[layer.layer_idx]
        layer.kv_cache_group_id = (layer_group or {}).get(layer.layer_idx, 0)
        layer.kv_rotation = kv_rotation_for(layer.kv_cache, layer.head_size)
    bind_value_rotation(model)
