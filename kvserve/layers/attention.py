"""The attention layer models call; it defers to the engine's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.forward_context import get_forward_context

_BACKEND: AttentionBackend | None = None
# Set while piecewise CUDA graphs are captured: called instead of attention, it ends the
# current graph piece (see kvserve.worker.cuda_graphs.PiecewiseCUDAGraphRunner).
_SPLIT_HOOK = None


def set_split_hook(hook) -> None:
    """Route every ``Attention.forward`` to ``hook(layer, q, k, v)`` (None restores attention)."""
    global _SPLIT_HOOK
    _SPLIT_HOOK = hook


def set_attn_backend(backend: AttentionBackend) -> None:
    """Select the backend every ``Attention`` layer uses (set once by the model runner)."""
    global _BACKEND
    _BACKEND = backend


def get_current_backend() -> AttentionBackend:
    global _BACKEND
    if _BACKEND is None:
        from kvserve.attention.backend import get_attn_backend

        _BACKEND = get_attn_backend("torch_ref")
    return _BACKEND


class Attention(nn.Module):
    """Paged attention for one layer.

    Args:
        num_heads: query heads; num_kv_heads: KV heads (divides num_heads; GQA/MQA).
        head_size: per-head dim; scale: softmax scale.
        layer_idx: index into the forward context's ``kv_caches``.
        sliding_window: optional window in tokens (Gemma 3 local layers, Mistral).
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, num_heads * head_size]``, k/v ``[T, num_kv_heads * head_size]`` -> ``[T, num_heads * head_size]``."""
        if _SPLIT_HOOK is not None:
            return _SPLIT_HOOK(self, q, k, v)
        ctx = get_forward_context()
        t = q.shape[0]
        out = get_current_backend().forward(
            q.view(t, self.num_heads, self.head_size),
            k.view(t, self.num_kv_heads, self.head_size),
            v.view(t, self.num_kv_heads, self.head_size),
            ctx.kv_caches[self.layer_idx],
            ctx.attn_metadata,
            self.scale,
            self.sliding_window,
        )
        return out.reshape(t, self.num_heads * self.head_size)
