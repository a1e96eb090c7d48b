"""The core seams on the real default model: the mp executor, multi-token steps with a scripted
proposer, and two models in one process with separate caches and backends."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.layers.attention import attention_layers
from kvserve.spec_decode import Proposer, register_proposer


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at",
             "Once upon a time, in a land far away,", "import numpy as np\n", "The three primary colors are",
             "1, 2, 3, 4,", "Translate to French: good morning"]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    """Greedy outputs of the plain (uni, no speculation) engine."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _small(**kw):
    """An engine of 11 usable blocks: about 4 of these requests at once (forces preemption)."""
    args = dict(dtype="float32", num_gpu_blocks_override=12, max_model_len=128, max_num_batched_tokens=32,
                disable_log_stats=True)
    args.update(kw)
    return LLM(**args)


def test_mp_executor_gives_the_uni_outputs_with_preemption(prompts, reference):
    llm = _small(distributed_executor_backend="mp")
    try:
        assert type(llm.llm_engine.engine_core.executor).__name__ == "MultiprocExecutor"
        assert llm.llm_engine.engine_core.model_runner is None  # the model lives in the worker process
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert llm.llm_engine.stats.num_preemptions > 0
        assert llm.llm_engine.engine_core.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()
    procs = llm.llm_engine.engine_core.executor.procs
    assert all(not p.is_alive() for p in procs)


class ScriptedProposer(Proposer):
    """Drafts the reference continuation, with a wrong second draft every third proposal."""

    script: dict[tuple, list[int]] = {}
    calls: list[tuple[str, int]] = []

    def propose(self, requests, batch):
        out = []
        for st in requests:
            ref = self.script.get(tuple(st.prompt_token_ids))
            n = len(st.output_token_ids)
            assert ref is not None and list(ref[:n]) == st.output_token_ids  # lossless so far
            row = st.row
            assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == st.prompt_token_ids + st.output_token_ids
            d = list(ref[n:n + self.num_speculative_tokens])
            if len(d) >= 2 and n % 3 == 1:
                d[1] = (d[1] + 1) % 1000
            self.calls.append((st.req_id, n))
            out.append(d)
        return out


def test_scripted_drafts_give_the_plain_outputs(prompts, reference):
    register_proposer("scripted", ScriptedProposer)
    ScriptedProposer.script = {tuple(p): r for p, r in zip(prompts, reference)}
    ScriptedProposer.calls = []
    llm = _small(speculative_config={"method": "scripted", "num_speculative_tokens": 3}, num_gpu_blocks_override=14)
    core = llm.llm_engine.engine_core
    assert not core.async_scheduling  # drafts of step N are needed to schedule step N+1
    # Twice: the second round hits the prefix cache.
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    s = core.scheduler
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert ScriptedProposer.calls
    assert llm.llm_engine.stats.prefix_cache_hits > 0
    assert core.kv_cache_manager.usage == 0.0  # rolled-back slots and everything else freed
    core.kv_cache_manager.check_invariants()


def test_bad_speculative_config_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown speculative decoding method"):
        LLM(speculative_config={"method": "nope"}, disable_log_stats=True)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "scripted", "num_speculative_tokens": 0}, disable_log_stats=True)
    with pytest.raises(ValueError, match="JSON"):
        LLM(speculative_config="{not json", disable_log_stats=True)


def test_two_models_in_one_process_keep_separate_caches(prompts, reference):
    """A target and a "draft" (the default model twice, different backends) stepped in turn."""
    from kvserve.engine.llm_engine import LLMEngine

    target = _small(attention_backend="cpu", num_gpu_blocks_override=40).llm_engine
    draft = _small(attention_backend="torch_ref", num_gpu_blocks_override=40).llm_engine
    assert isinstance(target, LLMEngine)
    t_layers = attention_layers(target.engine_core.model_runner.model)
    d_layers = attention_layers(draft.engine_core.model_runner.model)
    assert {type(x.impl).__name__ for x in t_layers} == {"CpuBackend"}
    assert {type(x.impl).__name__ for x in d_layers} == {"TorchRefBackend"}
    ptrs = {x.kv_cache.data_ptr() for x in t_layers} | {x.kv_cache.data_ptr() for x in d_layers}
    assert len(ptrs) == len(t_layers) + len(d_layers)
    for i, p in enumerate(prompts):
        target.add_request(f"t{i}", p, GREEDY)
        draft.add_request(f"d{i}", p, GREEDY)
    got: dict[str, list[int]] = {}
    while target.has_unfinished_requests() or draft.has_unfinished_requests():
        for eng in (target, draft):
            if eng.has_unfinished_requests():
                for o in eng.step():
                    got[o.request_id] = o.outputs[0].token_ids
    assert [got[f"t{i}"] for i in range(len(prompts))] == reference
    assert [got[f"d{i}"] for i in range(len(prompts))] == reference
    assert not torch.equal(t_layers[0].kv_cache[:, :2], torch.zeros_like(t_layers[0].kv_cache[:, :2]))
