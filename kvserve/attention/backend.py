"""Attention backend interface and the registry of backends."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.attention.forward_context import AttentionMetadata


class AttentionBackend(ABC):
    """Computes attention for a flat varlen batch over a paged KV cache.

    KV cache layout (per layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]``;
    index 0 holds K, 1 holds V. The cache dtype may differ from the compute dtype.
    """

    name: str = "abstract"
    # True if forward never reads device values back, so a CUDA graph can capture it.
    cuda_graph_safe: bool = False

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store the new K/V into their slots, then attend.

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]`` for the new tokens.
            kv_cache: this layer's cache, written in place.
            meta: the batch description.
            scale: softmax scale (usually ``head_size ** -0.5``).
            sliding_window: if set, a query at position p sees keys in ``(p - window, p]``.

        Returns:
            ``[num_tokens, num_heads, head_size]`` in the query's dtype.
        """


def get_attn_backend(name: str) -> AttentionBackend:
    """Instantiate a backend by name ("cpu", "torch_ref", "triton"). Raises ValueError for unknown names."""
    if name == "cpu":
        from kvserve.attention.cpu_backend import CpuBackend

        return CpuBackend()
    if name == "torch_ref":
        from kvserve.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "triton":
        from kvserve.attention.triton import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: cpu, torch_ref, triton")
