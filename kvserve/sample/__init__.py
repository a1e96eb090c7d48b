"""Batched token sampling (vLLM semantics): penalties, min_tokens, temperature, top-k,
top-p, min-p, seeded per-request RNGs and logprobs."""

from kvserve.sample.metadata import SamplingMetadata, build_sampling_metadata, get_generator
from kvserve.sample.sampler import (
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    exponential_race,
    token_counts,
)

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "build_sampling_metadata",
    "exponential_race",
    "get_generator",
    "token_counts",
]
