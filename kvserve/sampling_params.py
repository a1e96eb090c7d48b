"""Per-request sampling parameters, with vLLM's field names and OpenAI's semantics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``); set exactly one.

    Enforced by a token bitmask from a compiled grammar (``kvserve.structured_output``,
    xgrammar): at every step only tokens that keep the output a valid prefix may be sampled.

    Attributes:
        json: a JSON schema (dict or JSON string); the output is a JSON value valid under it.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar / GBNF syntax) with a ``root`` rule.
        json_object: any JSON object (OpenAI's ``response_format: json_object``).
        whitespace_pattern: unused placeholder kept for vLLM compatibility; must be None.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(set_) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_ or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs json must be a JSON schema (object or string)")

    def key(self) -> tuple[str, str]:
        """``(kind, spec)`` in a canonical form: the compiled-grammar cache key."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, dict) else json.loads(self.json)
            return "json", json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar or ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) is not None}


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    Fields follow vLLM's ``SamplingParams``. ``temperature == 0`` means greedy.
    Validation happens in ``__post_init__`` and raises ``ValueError`` with the field name.

    Attributes:
        n: completions per prompt; they share the prompt's KV blocks.
        temperature: >= 0; 0 is greedy.
        top_p: in (0, 1]; nucleus sampling.
        top_k: 0 or -1 disables; else keep the k most likely tokens.
        min_p: in [0, 1]; drop tokens below ``min_p * p_max``.
        presence_penalty / frequency_penalty: in [-2, 2], OpenAI's additive penalties over
            output tokens.
        repetition_penalty: > 0; CTRL's multiplicative penalty over prompt and output tokens
            (arXiv:1909.05858).
        seed: per-request RNG seed; output does not depend on the rest of the batch.
        max_tokens: >= 1 new tokens (None: up to max_model_len).
        min_tokens: EOS and stop_token_ids are suppressed before this many new tokens.
        stop: strings that end the completion; they are not included in the text.
        stop_token_ids: token ids that end the completion (kept in token_ids, not in text).
        ignore_eos: keep generating past EOS.
        logprobs: if set, return the top-``logprobs`` log-probabilities per sampled token
            (plus the sampled token's own).
        prompt_logprobs: if set, return per prompt token its log-probability given the tokens
            before it, plus the top-``prompt_logprobs`` alternatives (vLLM's field; the first
            prompt token has none). Such a request never reuses cached prefix blocks (every
            prompt position's logits are computed).
        skip_special_tokens: drop special tokens from the detokenized text.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (``StructuredOutputsParams``; a dict of its fields is accepted).
        attention_sinks / max_attention_window: kvserve extension, bounded KV only
            (``--kv-eviction-policy``, docs/bounded-kv.md): this request's attention sinks
            (>= 0) and window (>= 1) in tokens, each at most the engine's (None: the engine's).
        extra_args: free-form extension arguments (vLLM's field), e.g. ``{"kv_transfer_params":
            {...}}`` for disaggregated prefill/decode (``kvserve.kv_connector.p2p``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[list[str] | str] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    attention_sinks: Optional[int] = None
    max_attention_window: Optional[int] = None
    extra_args: Optional[dict] = None
    # Filled by the engine (not by users): eos ids of the model.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int):
            raise bad("top_k", "must be an integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.attention_sinks is not None and (not isinstance(self.attention_sinks, int)
                                                 or self.attention_sinks < 0):
            raise bad("attention_sinks", "must be an integer >= 0")
        if self.max_attention_window is not None and (not isinstance(self.max_attention_window, int)
                                                      or self.max_attention_window < 1):
            raise bad("max_attention_window", "must be an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> "SamplingParams":
        from dataclasses import replace

        return replace(self, **changes)
