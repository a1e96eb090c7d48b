"""Data parallelism behind one client (``DPAsyncLLM``): two engine-core processes on the CPU.

One module-scoped engine (tiny random Llama, float32, greedy) serves the tests in order; the
last one kills a core, so it stays last.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from kvserve.engine.arg_utils import EngineArgs  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
PROMPTS = [[5, 17, 33, 4, 90, 12], [7, 7, 8, 200, 31], [100, 101, 102, 103, 104, 105, 106, 107],
           [9, 60, 3], [250, 1, 44, 44, 12, 80, 81], [66, 77, 88, 99]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("dp-tiny")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)  # no near-ties under greedy
    model.save_pretrained(str(d))
    return str(d)


def _args(model_dir: str, dp: int) -> EngineArgs:
    return EngineArgs(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                      kv_cache_memory="8MiB", data_parallel_size=dp, disable_log_stats=True, cpu_threads=1)


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def dp(model_dir, loop):
    from kvserve.engine.dp_client import DPAsyncLLM
    from kvserve.metrics.prometheus import PrometheusStatLogger

    stats = PrometheusStatLogger("m", engine=0)
    engine = loop.run_until_complete(DPAsyncLLM.from_engine_args(_args(model_dir, 2), stats, startup_timeout=300))
    engine.prom = stats
    yield engine
    loop.run_until_complete(engine.shutdown())


async def _run(engine, ids, params, rid):
    final = None
    async for out in engine.generate(ids, params, rid):
        final = out
    return final


def test_dp2_equals_one_engine_and_spreads_requests(dp, loop, model_dir):
    from kvserve import LLM

    async def go():
        return await asyncio.gather(*(_run(dp, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)))

    outs = loop.run_until_complete(go())
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256, kv_cache_memory="8MiB",
              cpu_threads=1)
    try:
        ref = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for o, r in zip(outs, ref):
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert not dp.owner  # finished requests leave the owner map
    # Per-core series: both cores finished requests; the engine label separates them.
    text = dp.prom.render().decode()
    done = {}
    for line in text.splitlines():
        if line.startswith("kvserve:request_success_total{") and 'finished_reason="length"' in line:
            eng = line.split('engine="')[1].split('"')[0]
            done[eng] = done.get(eng, 0) + float(line.rsplit(" ", 1)[1])
    assert done.get("0", 0) > 0 and done.get("1", 0) > 0 and sum(done.values()) == len(PROMPTS)
    assert 'kvserve:num_requests_running{engine="1",model_name="m"}' in text


def test_shared_prefix_goes_to_the_same_core(dp, loop):
    long = list(range(10, 60))
    first = loop.run_until_complete(_run(dp, long, GREEDY, "p0"))
    assert first.finished
    owner = dp.choose(long + [3, 4])  # the cache-aware policy: the core that holds the prefix
    assert owner == dp.choose(long + [5])
    other = [200 - t for t in long]
    assert dp.choose(other) != owner  # a miss with equal loads: the other core (least recently picked)


def test_abort_goes_to_the_owning_core(dp, loop):
    calls = []
    for i, core in enumerate(dp.cores):
        orig = core.abort

        async def spy(rid, i=i, orig=orig):
            calls.append(i)
            await orig(rid)
        core.abort = spy

    async def go():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gen = dp.generate([11, 12, 13], params, "long")
        first = await gen.__anext__()
        owner = dp.owner["long"]
        await dp.abort("long")
        await dp.abort("unknown-id")  # ignored
        last = first
        async for out in gen:
            last = out
        return owner, last

    try:
        owner, last = loop.run_until_complete(go())
    finally:
        for core in dp.cores:
            core.__dict__.pop("abort", None)
    assert calls == [owner]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 200
    assert dp.num_unfinished() == 0


def test_killed_core_fails_the_engine(dp, loop):
    from kvserve.engine.async_client import EngineDeadError

    async def go():
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        tasks = [asyncio.ensure_future(_run(dp, [20 + i, 21, 22], params, f"k{i}")) for i in range(4)]
        await asyncio.sleep(0.3)
        assert {dp.owner[f"k{i}"] for i in range(4)} == {0, 1}
        os.kill(dp.cores[1].proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        res = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        return res, time.monotonic() - t0

    res, waited = loop.run_until_complete(go())
    assert all(isinstance(r, EngineDeadError) for r in res), res
    assert any("data-parallel engine core 1" in str(r) for r in res)
    assert waited < 10
    assert not dp.is_running and "engine core 1" in str(dp.errored)
    with pytest.raises(EngineDeadError):
        dp.check_alive()


# ---------------------------------------------------------------------------- without processes
def test_core_devices():
    from kvserve.engine.core_env import core_devices, environ_set

    assert core_devices(0, 2, None, 4) == "0,1" and core_devices(1, 2, None, 4) == "2,3"
    assert core_devices(1, 1, "4, 6,7", 8) == "6"
    with pytest.raises(ValueError, match="data-parallel core 1 needs GPUs 2..3"):
        core_devices(1, 2, "0,1,2", 8)
    os.environ.pop("KVSERVE_TEST_ENV", None)
    with environ_set({"KVSERVE_TEST_ENV": "x"}):
        assert os.environ["KVSERVE_TEST_ENV"] == "x"
    assert "KVSERVE_TEST_ENV" not in os.environ


def test_flag_and_refusals(model_dir):
    import argparse

    from kvserve import LLM
    from kvserve.engine.async_client import AsyncLLM
    from kvserve.engine.dp_client import DPAsyncLLM

    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(p.parse_args(["--data-parallel-size", "2"]))["data_parallel_size"] == 2
    assert EngineArgs.from_cli_args(p.parse_args(["-dp", "3"]))["data_parallel_size"] == 3
    with pytest.raises(ValueError, match="kvserve serve"):
        LLM(model_dir, data_parallel_size=2)
    with pytest.raises(ValueError, match="DPAsyncLLM"):
        asyncio.run(AsyncLLM.from_engine_args(_args(model_dir, 2)))
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        _args(model_dir, 0).create_engine_config()
    with pytest.raises(ValueError, match="kv_events"):
        DPAsyncLLM(_args(model_dir, 2), routing_policy="kv_events")
    from kvserve.metrics.prometheus import PrometheusStatLogger

    with pytest.raises(ValueError, match="engine=0"):
        DPAsyncLLM(_args(model_dir, 2), PrometheusStatLogger("m"))
    with pytest.raises(ValueError, match="for_engine needs a logger built with engine=0"):
        PrometheusStatLogger("m").for_engine(1)
    args = _args(model_dir, 2)
    args.kv_events_config = '{"enable_kv_cache_events": true, "publisher": "null"}'
    with pytest.raises(ValueError, match="--kv-events-config is not supported with data_parallel_size 2"):
        asyncio.run(DPAsyncLLM.from_engine_args(args))


def test_stats_line_sums_the_cores(model_dir):
    from kvserve.engine.dp_client import DPAsyncLLM

    args = _args(model_dir, 2)
    args.disable_log_stats, args.log_stats_interval = False, 0.001
    engine = DPAsyncLLM(args)
    engine._core_stats = [None, None]
    s0 = SimpleNamespace(num_running=3, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=10,
                         prefix_cache_hits=5, num_preemptions=0)
    s1 = SimpleNamespace(num_running=2, num_waiting=4, kv_cache_usage=0.25, prefix_cache_queries=30,
                         prefix_cache_hits=5, num_preemptions=1)
    engine._on_core_step(0, s0, 0, 0)
    time.sleep(0.01)
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda rec: lines.append(rec.getMessage())
    log = logging.getLogger("kvserve")
    log.addHandler(handler)
    try:
        engine._on_core_step(1, s1, 100, 10)
    finally:
        log.removeHandler(handler)
    text = "\n".join(lines)
    assert "Running: 5 reqs, Waiting: 5 reqs, KV cache usage: 37.5%, Prefix cache hit rate: 25.0%" in text
    assert "Preemptions: 1" in text
    assert "running [3, 2], waiting [1, 4]" in text
