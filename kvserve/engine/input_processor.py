"""Frontend input handling shared by the offline engine and the API server: tokenize,
validate, fan ``n`` completions out into child requests, and the stats log line."""

from __future__ import annotations

import logging
from typing import Optional, Union

from kvserve.engine.core_types import EngineCoreRequest
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

PromptType = Union[str, list[int]]


def tokenize_prompt(tokenizer, prompt: PromptType) -> tuple[Optional[str], list[int]]:
    """``(text or None, token ids)``; strings get the tokenizer's special tokens (BOS).

    Raises:
        ValueError: a string without a tokenizer, or anything but a string / list of ints.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (the engine runs with skip_tokenizer_init)")
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError("a prompt must be a string or a list of token ids (ints)")


def validate_request(
    ids: list[int], params: SamplingParams, priority: int, vocab_size: int, max_model_len: int,
    has_tokenizer: bool = True, cache_config=None,
) -> None:
    """Raise ValueError for an empty prompt, ids outside ``[0, vocab_size)``, a prompt longer
    than ``max_model_len`` tokens, a non-integer priority, stop strings without a tokenizer,
    a structured-output constraint that does not compile (or has no tokenizer), or per-request
    bounded-KV values (``attention_sinks`` / ``max_attention_window``) that the engine's
    ``cache_config`` (a resolved ``CacheConfig``) does not allow."""
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling params must be a SamplingParams")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
    if params.structured_outputs is not None:
        if not has_tokenizer:
            raise ValueError("structured_outputs need a tokenizer (the engine runs with skip_tokenizer_init)")
        from kvserve.structured_output.manager import validate_structured_outputs

        validate_structured_outputs(params.structured_outputs)
    check_request_limits(params, cache_config)
    if not ids:
        raise ValueError("the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) is longer than max_model_len ({max_model_len} tokens)")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError("priority must be an integer")


def check_request_limits(params: SamplingParams, cache_config=None) -> None:
    """Per-request bounded-KV values (``attention_sinks`` / ``max_attention_window``) against
    the engine's resolved ``cache_config`` (a ``CacheConfig``; None: an unbounded engine): they
    need a bounded engine and may only lower its values (the pool is planned for the engine's).
    The one place they are checked; below the frontend ``kvserve.core.bounded_kv.request_limits``
    only reads them. Raises ValueError."""
    if params.attention_sinks is None and params.max_attention_window is None:
        return
    if getattr(cache_config, "kv_eviction_policy", "none") == "none":
        raise ValueError("attention_sinks / max_attention_window need an engine started with "
                         "--kv-eviction-policy streaming|h2o")
    sinks, window = cache_config.attention_sinks, cache_config.max_attention_window
    if params.attention_sinks is not None and params.attention_sinks > sinks:
        raise ValueError(f"attention_sinks {params.attention_sinks} > the engine's --attention-sinks {sinks}")
    if params.max_attention_window is not None and params.max_attention_window > window:
        raise ValueError(f"max_attention_window {params.max_attention_window} > the engine's "
                         f"--max-attention-window {window}")


def make_child_requests(
    request_id: str, ids: list[int], params: SamplingParams, arrival: float, priority: int,
    eos_token_id: Optional[int], cache_salt: Optional[str] = None,
) -> list[EngineCoreRequest]:
    """One engine request per completion: ``n == 1`` keeps the id, else ``"{id}#{k}"``.

    Seeded siblings get ``seed + k`` so that their completions differ (as vLLM does).
    """
    children = []
    for k in range(params.n):
        cp = params.clone(n=1)
        if params.n > 1 and params.seed is not None:
            cp.seed = params.seed + k
        cid = request_id if params.n == 1 else f"{request_id}#{k}"
        children.append(EngineCoreRequest(cid, list(ids), cp, arrival, priority, eos_token_id, cache_salt))
    return children


def resolve_eos_token_id(tokenizer, hf_config) -> Optional[int]:
    """The tokenizer's EOS id, else the first of the model config's ``eos_token_id``."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) else eos
    return eos


def log_stats_line(
    prompt_tps: float, gen_tps: float, running: int, waiting: int, kv_usage: float,
    prefix_queries: int, prefix_hits: int, preemptions: int, recompute_hits: int = 0,
    num_draft_tokens: int = 0, num_accepted_tokens: int = 0, num_drafts: int = 0, tier: dict | None = None,
    evicted_blocks: int = 0,
) -> None:
    """The periodic stats line (throughputs in tokens/s; kv_usage as a 0..1 fraction); with
    speculative decoding also the draft acceptance rate and mean acceptance length; with KV
    tiers (``tier``: the connector's counters) their hits and usage; with bounded KV
    (``--kv-eviction-policy``) the blocks evicted so far."""
    hit = prefix_hits / prefix_queries if prefix_queries else 0.0
    spec = ""
    if num_draft_tokens:
        spec = (f", Draft acceptance rate: {100 * num_accepted_tokens / num_draft_tokens:.1f}%, "
                f"Mean acceptance length: {1 + num_accepted_tokens / max(num_drafts, 1):.2f}")
    if tier and "kv_transfer_bytes" in tier:  # KV transfer between engines (P2PKVConnector)
        spec += (f", KV transfers: {tier.get('kv_transfers', 0):.0f} ({tier['kv_transfer_bytes'] / 2**20:.1f} MiB), "
                 f"{tier.get('kv_transfer_failures', 0):.0f} failed, {tier.get('receiving', 0):.0f} receiving, "
                 f"{tier.get('sending', 0):.0f} lent")
    elif tier:
        spec += (f", CPU tier: {tier.get('hit_tokens', 0):.0f} hit tokens, "
                 f"{100 * tier.get('blocks_used', 0) / max(tier.get('blocks_total', 1), 1):.1f}% used, "
                 f"{tier.get('blocks_stored', 0):.0f} blocks stored, {tier.get('blocks_loaded', 0):.0f} loaded")
        if tier.get("disk_blocks_stored") or tier.get("disk_hit_tokens"):
            spec += f", disk tier: {tier.get('disk_hit_tokens', 0):.0f} hit tokens"
    if evicted_blocks:
        spec += f", Evicted KV blocks: {evicted_blocks}"
    logger.info(
        "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
        "Preemptions: %d, Recompute prefix hits: %d tokens%s",
        prompt_tps, gen_tps, running, waiting, 100 * kv_usage, 100 * hit, preemptions, recompute_hits, spec,
    )
