"""The attention layer models call: q/k/v -> this layer's backend over this layer's paged cache.

Each layer owns its binding: ``bind_attention(model, backend)`` gives every ``Attention``
module of a model its backend implementation (right after the model is built), and
``bind_kv_cache(model, caches, ...)`` its own ``KVCacheView`` (``kvserve/attention/kv_format.py``:
the cache tensor, its format object, the format's rotation and, bound later by the metadata
builder, the exact filling block) once the cache is allocated. The forward context carries
only the step's metadata, so two models in one process (a target and a draft) hold separate
caches and may use different backends.

``forward`` has one path: it hands the backend q/k/v, the layer's view and its group's
metadata; the backend's format-, rotation- and feature-specific work keys off the view and
the metadata (``AttentionBackend.forward``). Rotated formats (int4 / int2, QuaRot
arXiv:2404.00456): where the layer's value and output projections are dense,
``bind_kv_cache`` folds ``R`` into them (``kv_rotation.bind_value_rotation``): v then arrives
as ``v R``, the output leaves in the rotated basis, and only q and k rotate at run time
(``KVCacheView.values_rotated``). The piecewise CUDA graph split hook returns before the
backend runs while pieces are captured, and at replay ``layer.forward`` runs eagerly between
the pieces, so attention (and any rotation) runs exactly once per step, outside the pieces.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.forward_context import get_forward_context
from kvserve.attention.kv_format import KVCacheView, format_of_spec, plain_format
from kvserve.attention.kv_rotation import bind_value_rotation
from kvserve.core.kv_cache_spec import BoundedKVSpec, KVCacheSpec


class Attention(nn.Module):
    """Paged attention for one layer.

    Args:
        num_heads: query heads; num_kv_heads: KV heads (divides num_heads; GQA/MQA).
        head_size: per-head dim; scale: softmax scale.
        layer_idx: this layer's index among the model's attention layers.
        sliding_window: optional window in tokens (Gemma 3 local layers, Mistral).
        has_sinks: the layer has learned attention sinks (gpt-oss): ``sinks [num_heads]``
            float32, one logit per query head added to the softmax denominator with no value
            (not StreamingLLM's sink tokens, ``--attention-sinks``). The backend reads them
            from the ``KVCacheView`` (``kv.sinks``); a backend without
            ``supports_attention_sinks`` or a bounded KV cache is refused when binding.

    Attributes (bound by the model runner):
        impl: the attention backend implementation.
        kv: this layer's ``KVCacheView`` (cache tensor, format, rotation, exact filling block).
        kv_cache_group_id: which KV cache group's metadata (block table) it reads.
        split_hook: while piecewise CUDA graphs are captured, called instead of attention
            (``hook(layer, q, k, v) -> o``) to end the current graph piece.
        values_rotated_by: the rotation folded into this layer's value and output projections
            (``kv_rotation.bind_value_rotation``), else None: v then arrives as ``v R`` and
            the output is returned in the rotated basis (``o_proj`` takes it).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        sliding_window: int | None = None,
        has_sinks: bool = False,
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
        # float32 whatever the model dtype: the kernels add it to float32 running maxima
        self.sinks = (nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
                      if has_sinks else None)
        self.impl: Optional[AttentionBackend] = None
        self.kv_cache_group_id = 0
        self.split_hook: Optional[Callable] = None
        self._kv: Optional[KVCacheView] = None
        self._values_rotated_by: Optional[torch.Tensor] = None

    @property
    def kv(self) -> Optional[KVCacheView]:
        return self._kv

    @kv.setter
    def kv(self, view: Optional[KVCacheView]) -> None:
        self._kv = view
        if view is not None:
            view.values_rotated = self._values_rotated_by is not None
            view.sinks = self.sinks

    @property
    def kv_cache(self) -> Optional[torch.Tensor]:
        """This layer's paged KV tensor (``kv.cache``)."""
        return None if self._kv is None else self._kv.cache

    @property
    def kv_rotation(self) -> Optional[torch.Tensor]:
        """The view's rotation ``[head_size, head_size]`` float32 (int4 / int2), else None."""
        return None if self._kv is None else self._kv.rotation

    @property
    def values_rotated_by(self) -> Optional[torch.Tensor]:
        return self._values_rotated_by

    @values_rotated_by.setter
    def values_rotated_by(self, r: Optional[torch.Tensor]) -> None:
        self._values_rotated_by = r
        if self._kv is not None:
            self._kv.values_rotated = r is not None

    @property
    def values_rotated(self) -> bool:
        """Whether v arrives rotated and the output leaves rotated (weights folded)."""
        return self._values_rotated_by is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, num_heads * head_size]``, k/v ``[T, num_kv_heads * head_size]`` -> ``[T, num_heads * head_size]``."""
        if self.split_hook is not None:
            return self.split_hook(self, q, k, v)
        meta = get_forward_context().attn_metadata[self.kv_cache_group_id]
        t = q.shape[0]
        out = self.impl.forward(q.view(t, self.num_heads, self.head_size), k.view(t, self.num_kv_heads, self.head_size),
                                v.view(t, self.num_kv_heads, self.head_size), self.kv, meta, self.scale,
                                self.sliding_window)
        return out.reshape(t, self.num_heads * self.head_size)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's ``Attention`` modules, ordered by ``layer_idx``."""
    return sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)


def bind_attention(model: nn.Module, backend: AttentionBackend) -> None:
    """Give every attention layer of ``model`` the backend ``backend``."""
    for layer in attention_layers(model):
        if layer.sinks is not None and not backend.supports_attention_sinks:
            raise ValueError(f"attention backend {backend.name!r} does not implement learned attention sinks "
                             f"(layer {layer.layer_idx}); use cpu, torch_ref or triton")
        layer.impl = backend


def bind_kv_cache(model: nn.Module, kv_caches: dict[int, torch.Tensor],
                  layer_group: Optional[dict[int, int]] = None,
                  specs: Optional[dict[int, KVCacheSpec]] = None) -> None:
    """Give each attention layer its ``KVCacheView``: its tensor (``kv_caches[layer_idx]``) in
    the format of its spec (``specs[layer_idx]``; without specs, a plain cache of the tensor's
    own float dtype), its rotation for a rotated format (int4 / int2), folded into the layer's
    value / output weights where they are dense (``bind_value_rotation``), its learned attention
    sinks (if any), and its KV cache group.

    Raises KeyError when a layer has no tensor, ValueError when a tensor does not hold its format
    or a layer with learned attention sinks gets a bounded KV cache (StreamingLLM / H2O).
    """
    for layer in attention_layers(model):
        if layer.sinks is not None and specs is not None and isinstance(specs[layer.layer_idx], BoundedKVSpec):
            raise ValueError(f"layer {layer.layer_idx} has learned attention sinks, which bounded KV "
                             f"(--kv-eviction-policy {specs[layer.layer_idx].policy}) does not implement")
        cache = kv_caches[layer.layer_idx]
        fmt = format_of_spec(specs[layer.layer_idx]) if specs is not None else plain_format(cache.dtype,
                                                                                             layer.head_size)
        layer.kv = KVCacheView.bind(cache, fmt)
        layer.kv_cache_group_id = (layer_group or {}).get(layer.layer_idx, 0)
    bind_value_rotation(model)
