"""Out of device memory in one step fails that step's requests only; the engine goes on.

The allocation failure is forced (the executor raises ``torch.OutOfMemoryError`` on a chosen
step): the failed requests end with finish_reason "error" and their blocks are freed, and the
next requests give the same tokens as before."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.async_client import RequestFailedError
from kvserve.engine.engine_core import is_out_of_memory
from kvserve.entrypoints.openai.errors import APIError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_out_of_memory_fails_the_steps_requests_and_the_engine_goes_on(llm, monkeypatch):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "Water boils at")]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    core = llm.llm_engine.engine_core
    real = core.executor.execute_model
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 3:  # both requests are decoding by now
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (forced by the test)")
        return real(sched)

    monkeypatch.setattr(core.executor, "execute_model", flaky)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert all(len(o.outputs[0].token_ids) < GREEDY.max_tokens for o in outs)
    assert core.kv_cache_manager.usage == 0.0 and not core.has_unfinished_requests()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert after == before


def test_other_errors_still_propagate(llm, monkeypatch):
    core = llm.llm_engine.engine_core

    def broken(sched):
        raise RuntimeError("a kernel bug, not a memory error")

    monkeypatch.setattr(core.executor, "execute_model", broken)
    with pytest.raises(RuntimeError, match="kernel bug"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    core.abort_requests(list(core.scheduler.requests))  # the request the failed step left behind
    assert core.kv_cache_manager.usage == 0.0
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)  # the shared engine still serves
    assert out[0].outputs[0].finish_reason == "length"


def test_out_of_memory_detection_and_http_status():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    # a worker process's failure, re-raised by the multi-process executor with its text
    assert is_out_of_memory(RuntimeError("worker 1 failed: torch.OutOfMemoryError: CUDA out of memory."))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("CUDA out of memory"))
    err = APIError.from_exception(RequestFailedError("request r: the engine step that ran it failed"))
    assert err.status == 500 and err.body()["error"]["type"] == "internal_server_error"
