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


def test_expandable_segments_are_the_default_and_a_user_setting_wins():
    import os
    import subprocess
    import sys

    code = "import os, kvserve; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    got = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == "expandable_segments:True", got.stderr[-500:]
    env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:native"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == "backend:native", got.stderr[-500:]
