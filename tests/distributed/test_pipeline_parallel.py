"""Pipeline parallelism on the CPU (gloo, one process per stage through the mp executor): the
layer split, the KV budget over stages, the token relay to earlier stages, start-up errors, and
the real default model at PP=2 giving the one-rank tokens with preemption; a killed stage is a
clean error within seconds."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.kv_cache_spec import FullAttentionSpec
from kvserve.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvserve.executor.pipeline import TokenRelay, merge_kv_cache_specs, output_rank, pipeline_kv_bytes
from kvserve.models.pipeline import PARTITION_ENV, check_pipeline_parallel, pp_layer_range, pp_partition

pytest.importorskip("zmq")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_layer_split_follows_vllm_and_the_override(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert pp_partition(30, 2) == [15, 15]
    assert pp_partition(30, 4) == [7, 8, 8, 7]  # remainder to the stages before the last
    assert pp_partition(5, 3) == [2, 2, 1]
    assert [pp_layer_range(30, r, 4) for r in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        pp_partition(2, 3)
    monkeypatch.setenv(PARTITION_ENV, "20,10")
    assert pp_layer_range(30, 1, 2) == (20, 30)
    monkeypatch.setenv(PARTITION_ENV, "20,9")
    with pytest.raises(ValueError, match=PARTITION_ENV):
        pp_partition(30, 2)


def test_kv_budget_is_the_smallest_stage_and_the_output_rank_is_the_last_stage():
    from kvserve.config import ParallelConfig

    spec = FullAttentionSpec(16, 2, 8, "float32", "float32")
    page = spec.page_size_bytes
    stages = [{0: spec, 1: spec}, {2: spec}]  # two layers on stage 0, one on stage 1
    assert list(merge_kv_cache_specs(stages[::-1])) == [0, 1, 2]
    # stage 0 holds 10 two-layer blocks, stage 1 holds 30 one-layer blocks: 10 blocks in all
    assert pipeline_kv_bytes(stages, [20 * page, 30 * page]) == 10 * 3 * page
    assert pipeline_kv_bytes(stages, [200 * page, 4 * page]) == 4 * 3 * page
    assert output_rank(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)) == 4
    assert output_rank(ParallelConfig(tensor_parallel_size=3)) == 0


def test_token_relay_hands_sampled_tokens_to_earlier_stages_once():
    relay = TokenRelay()
    relay.on_output(ModelRunnerOutput(sampled_token_ids={"a": [5], "b": [6], "c": [7]}))
    sched = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a", "b"], [None, None], [3, 4], [[], []]),
                            finished_req_ids={"c"})
    early = relay.for_earlier_stages(sched)
    assert early.scheduled_cached_reqs.new_token_ids == [[5], [6]]
    assert sched.scheduled_cached_reqs.new_token_ids == [[], []]  # the last stage's copy is untouched
    relay.on_output(ModelRunnerOutput(sampled_token_ids={"a": [8]}))
    new = NewRequestData("a", [1], [5, 8], GREEDY, None, ([],), 0)  # preempted, back whole
    again = relay.for_earlier_stages(SchedulerOutput(scheduled_new_reqs=[new]))
    assert again.scheduled_cached_reqs.new_token_ids == []
    assert relay.for_earlier_stages(sched) is sched  # nothing left to deliver


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer Llama config alone: start-up errors come before any weights load."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny")
    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


def test_unsupported_models_and_flags_are_clear_errors(tiny):
    from transformers import Gemma3TextConfig

    from kvserve.models.gemma3 import Gemma3ForCausalLM
    from kvserve.models.llama import LlamaForCausalLM

    with pytest.raises(ValueError, match="Gemma3ForCausalLM does not support pipeline parallelism"):
        check_pipeline_parallel(Gemma3ForCausalLM, Gemma3TextConfig(num_hidden_layers=4), 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds"):
        check_pipeline_parallel(LlamaForCausalLM, type("C", (), {"num_hidden_layers": 2}), 3)
    kw = dict(model=tiny, skip_tokenizer_init=True, disable_log_stats=True)
    with pytest.raises(ValueError, match="mp or ray"):
        LLM(pipeline_parallel_size=2, distributed_executor_backend="uni", **kw)
    with pytest.raises(ValueError, match="--speculative-config not supported with pipeline"):
        LLM(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw)
    with pytest.raises(ValueError, match="pipeline_parallel_size 4 exceeds the model's 3 layers"):
        LLM(pipeline_parallel_size=4, **kw)


def test_pp2_real_model_equals_one_rank_with_preemption_and_a_killed_stage_fails_fast(llm):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def add(a, b):\n    return",
                                        "Water boils at", "Once upon a time,")]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # 6 usable blocks of 16 tokens per stage: the four requests (2 blocks each) cannot all run.
    pp = LLM(pipeline_parallel_size=2, dtype="float32", num_gpu_blocks_override=7, max_model_len=96,
             disable_log_stats=True)
    try:
        ex = pp.llm_engine.engine_core.executor
        assert type(ex).__name__ == "MultiprocExecutor" and len(ex.procs) == 2
        core = pp.llm_engine.engine_core
        assert core.max_concurrent_batches == 2
        queued, step = [], core._step_with_batch_queue
        core._step_with_batch_queue = lambda: (step(), queued.append(len(core._batch_queue)))[0]
        outs = pp.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert max(queued) == 1  # a step returned the oldest of two micro-batches in flight
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        os.kill(ex.procs[0].pid, signal.SIGKILL)  # the first stage: the last one waits on its recv
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="died"):
            pp.generate(prompts, GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 10
    finally:
        pp.shutdown()


def test_scheduler_skips_requests_in_flight_and_splits_micro_batches():
    from kvserve.config import SchedulerConfig
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.scheduler import Scheduler
    from kvserve.request import Request

    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                  KVCacheManager.for_blocks(64, 4, True))
    s.skip_in_flight, s.max_batch_requests = True, 2
    for i in range(4):
        s.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=float(i)))
    first = s.schedule()  # admission is not capped: the four prefills run together
    assert sorted(first.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]
    assert s.schedule().is_empty  # every request in flight: nothing to run
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={f"r{i}": [7] for i in range(4)}))
    a = s.schedule()  # decodes: at most two requests a micro-batch
    assert a.num_scheduled_tokens == {"r0": 1, "r1": 1}
    b = s.schedule()  # the other two; r0 and r1 are in flight
    assert b.num_scheduled_tokens == {"r2": 1, "r3": 1}
    assert s.schedule().is_empty
    s.update_from_output(a, ModelRunnerOutput(sampled_token_ids={"r0": [8], "r1": [8]}))
    assert s.schedule().num_scheduled_tokens == {"r0": 1, "r1": 1}
