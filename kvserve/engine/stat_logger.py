"""What the frontend reports: the hooks ``AsyncLLM`` calls with what it observes (``StatLogger``; the
Prometheus logger in ``kvserve.metrics`` implements them) and its start-up timing line."""

from __future__ import annotations

from typing import Any, Optional


class StatLogger:
    """Hooks AsyncLLM calls with what it observes (no-op base; see kvserve.metrics).

    Times are seconds.
    """

    def on_step(self, stats: Any, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """After every StepOutputs: scheduler stats and tokens computed in that step."""

    def on_first_token(self, ttft_s: float) -> None:
        """A completion got its first token, ``ttft_s`` after its arrival."""

    def on_inter_token(self, itl_s: float) -> None:
        """A completion got a token ``itl_s`` after its previous one."""

    def on_prefill_done(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A completion's prompt was prefilled (its first token came): all its prompt tokens, of
        which ``num_cached_tokens`` came from the prefix cache."""

    def on_finished(self, finish_reason: str, e2e_s: float, queue_s: Optional[float],
                    num_prompt_tokens: int, num_generation_tokens: int, ttft_s: Optional[float] = None) -> None:
        """A completion finished ("stop" | "length" | "abort" | "error"); ``ttft_s``: its first token's delay
        (None: it got none)."""


def startup_line(tokenizer_s: Optional[float], core_s: float, config: Any) -> str:
    """The frontend's start-up timing line: the tokenizer (loaded in a thread while the engine
    core starts; None: ``--skip-tokenizer-init``), the engine core, and the weight / KV formats."""
    mc, cc = config.model_config, config.cache_config
    tok = "skipped" if tokenizer_s is None else f"{tokenizer_s:.2f} s"
    return (f"start-up: tokenizer {tok} (alongside the engine core), engine core {core_s:.2f} s; "
            f"dtype {mc.dtype}, quantization {mc.quantization or 'none'}, kv_cache_dtype {cc.kv_cache_dtype}")
