"""The mp executor on a tiny random model: same tokens as uni, clean errors when a worker dies
or fails to start."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvserve import LLM, SamplingParams

pytest.importorskip("zmq")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return str(path)


def _llm(path, **kw):
    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
               disable_log_stats=True, **kw)


PROMPTS = [[1, 2, 3], [5] * 17, list(range(40, 80))]
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_mp_matches_uni_profiles_and_a_killed_worker_fails_fast(tiny, tmp_path, monkeypatch):
    uni = _llm(tiny)
    want = [o.outputs[0].token_ids for o in uni.generate(PROMPTS, SP, use_tqdm=False)]
    with pytest.raises(RuntimeError, match="KVSERVE_TORCH_PROFILER_DIR"):
        uni.start_profile()  # profiling is off without the directory
    uni.shutdown()
    monkeypatch.setenv("KVSERVE_TORCH_PROFILER_DIR", str(tmp_path))
    llm = _llm(tiny, distributed_executor_backend="mp")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
        assert got == want
        # torch.profiler in the worker process: errors come back and the worker stays up
        with pytest.raises(RuntimeError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        (summary,) = llm.stop_profile()
        assert summary["rank"] == 0 and summary["wall_ms"] > 0
        names = [r["name"] for r in summary["top"]]
        assert any("mm" in n or "linear" in n for n in names), names[:10]
        assert (tmp_path / "rank0.pt.trace.json.gz").stat().st_size > 0
        assert "aten::" in (tmp_path / "rank0_kernels.txt").read_text()
        proc = llm.llm_engine.engine_core.executor.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="died"):
            llm.generate(PROMPTS, SP, use_tqdm=False)
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()


def test_worker_start_up_error_reaches_the_caller(tiny):
    with pytest.raises(ValueError, match="unknown attention backend"):
        _llm(tiny, distributed_executor_backend="mp", attention_backend="nope")

