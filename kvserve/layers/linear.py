"""Tensor-parallel linear layers and vocabulary-parallel embedding / LM head.

Megatron-LM's split (Shoeybi et al., arXiv:1909.08053): a column-parallel layer holds a
slice of the output features (no communication), a row-parallel layer a slice of the input
features and sums the partial outputs over the ranks (one all-reduce). Packed projections
(q/k/v, gate/up) are column-parallel per logical part, so each rank holds its slice of
every part. Each layer has ``weight_loader(param, full_tensor, shard_id)``, which takes the
unsharded checkpoint tensor and copies this rank's slice into ``param`` (raises ValueError
on a shape mismatch); loaders call the owning module's, so nothing hangs on parameters. With one rank every layer is a plain ``nn.Linear`` / embedding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed import get_tp_rank, get_tp_size, kv_head_range, tp_all_gather, tp_all_reduce


def _check(name: str, what: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(got)}, expected {tuple(want)} ({what})")


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide {what} ({n})")
    return n // tp


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T (+ b)`` with this rank's slice of each part of the output features.

    Args:
        in_features: input features (whole on every rank).
        output_sizes: the logical parts' output sizes (one part for a plain projection).
        bias: whether there is a bias (sliced like the weight).
        dtype: parameter dtype.
    Input ``[T, in]`` -> output ``[T, sum(output_sizes) / tp]``.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_sizes = list(output_sizes)
        self.local_sizes, self.local_starts = self._local_parts()
        super().__init__(in_features, sum(self.local_sizes), bias=bias, dtype=dtype)

    def _local_parts(self) -> tuple[list[int], list[int]]:
        """Per logical part: this rank's row count and first row in the full part."""
        sizes = [_divide(s, self.tp_size, "the output features") for s in self.output_sizes]
        return sizes, [self.tp_rank * s for s in sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        full = self.output_sizes[shard_id]
        _check(f"part {shard_id}", "full part", loaded.shape[:1], (full,))
        n, start = self.local_sizes[shard_id], self.local_starts[shard_id]
        dst = param.narrow(0, sum(self.local_sizes[:shard_id]), n)
        _check(f"part {shard_id}", "rank slice", loaded.shape[1:], dst.shape[1:])
        dst.copy_(loaded.narrow(0, start, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q/k/v projection: query heads split over the ranks, KV heads split or, when
    there are fewer KV heads than ranks, replicated (``kv_head_range``)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype) -> None:
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, dtype)

    def _local_parts(self) -> tuple[list[int], list[int]]:
        d = self.head_dim
        nq = _divide(self.total_heads, self.tp_size, "the attention heads")
        kv0, nkv = kv_head_range(self.total_kv_heads, self.tp_size, self.tp_rank)
        return [nq * d, nkv * d, nkv * d], [self.tp_rank * nq * d, kv0 * d, kv0 * d]


class RowParallelLinear(nn.Linear):
    """``y = sum_ranks(x_r W_r^T) (+ b)``: this rank's slice of the input features, partial
    products summed by one all-reduce. Input ``[T, in / tp]`` -> output ``[T, out]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.in_full = in_features
        super().__init__(_divide(in_features, self.tp_size, "the input features"), out_features, bias=bias,
                         dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if param.dim() == 1:  # the bias is whole on every rank, added once after the sum
            _check("bias", "full", loaded.shape, param.shape)
            param.copy_(loaded)
            return
        _check("weight", "full", loaded.shape, (param.shape[0], self.in_full))
        n = param.shape[1]
        param.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding with the vocabulary split in contiguous ranges (padded up to a multiple
    of the ranks): each rank looks up its own ids, zeros the rest, and an all-reduce sums.
    Input ids ``[T]`` int64 -> ``[T, hidden]``. ``weight`` is also the tied LM head's."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        super().__init__(self.per_rank, hidden, dtype=dtype)

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s normal init, skipped on the meta device: there are no values to
        set, and ``normal_`` on meta goes through ``torch._refs``, which imports
        ``torch._dynamo`` (~1 s of every start-up)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        _check("embedding", "full", loaded.shape, (self.vocab_size, param.shape[1]))
        rows = loaded[self.vocab_start:self.vocab_start + self.per_rank]
        param.zero_()
        param[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head split by vocabulary like ``VocabParallelEmbedding`` (an untied head)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not an embedding
        raise RuntimeError("ParallelLMHead is used through parallel_logits")


def parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding, bias: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """hidden ``[N, hidden]`` -> logits ``[N, vocab]`` float32 on every rank: each rank's
    vocabulary slice, all-gathered, padding dropped."""
    logits = F.linear(hidden, head.weight, bias)
    if head.tp_size > 1:
        logits = tp_all_gather(logits, dim=-1)[..., :head.vocab_size]
    return logits.float()
