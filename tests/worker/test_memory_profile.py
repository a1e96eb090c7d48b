"""What the GPU memory profile counts before the KV cache is sized (``worker/memory.py``)."""

from __future__ import annotations

from kvserve.engine.arg_utils import EngineArgs
from kvserve.worker.memory import profile_logit_rows


def _config(**kw):
    return EngineArgs(device="cpu", dtype="float32", max_num_seqs=64, **kw).create_engine_config()


def test_profile_counts_the_logits_of_every_verified_position():
    """Speculation verifies 1 + k positions per request, so the sampler holds (1 + k) x
    max_num_seqs rows of float32 logits: the profile computes that many (a burst of verify steps
    at full batch would otherwise exceed the measured peak)."""
    assert profile_logit_rows(_config()) == 64
    cfg = _config(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                      "prompt_lookup_max": 3})
    assert profile_logit_rows(cfg) == 64 * 5
