"""Speculative decoding end to end: lossless on the real default model (greedy: identical
tokens batched, with chunked prefill, prefix hits and preemption; sampled with seeds,
penalties and logprobs: identical to no speculation), the distribution test on a small
random model, and metrics."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.spec_decode import Proposer, register_proposer

CODE = '''def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
'''

TEXTS = ["Rewrite this code with type hints:\n" + CODE, "The capital of France is",
         "List: apple, banana, cherry, apple, banana, cherry, apple,", "Count: 1 2 3 4 5 1 2 3 4 5 1 2",
         "def fibonacci(n):\n    ", "Once upon a time, once upon a time, once upon"]


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(t) for t in TEXTS]


def _spec_llm(**kw):
    args = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, disable_log_stats=True,
                speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 3})
    args.update(kw)
    return LLM(**args)


def test_ngram_greedy_is_lossless_batched_chunked_prefix_preempted(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    # 16 blocks of 16 tokens for 6 requests of up to ~120 tokens: preemption; a 32-token budget
    # chunks the prefills and mixes them with verification steps.
    spec = _spec_llm(num_gpu_blocks_override=16, max_num_batched_tokens=32, max_model_len=192)
    core = spec.llm_engine.engine_core
    for _ in range(2):  # the second round hits the prefix cache
        outs = spec.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    st = spec.llm_engine.stats
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert 0 < st.num_accepted_tokens <= st.num_draft_tokens
    assert sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens
    assert st.num_accepted_tokens_per_pos == sorted(st.num_accepted_tokens_per_pos, reverse=True)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert core.kv_cache_manager.usage == 0.0  # rolled-back slots and everything else freed
    core.kv_cache_manager.check_invariants()
    spec.shutdown()


def test_ngram_sampled_with_seeds_penalties_logprobs_equals_no_speculation(llm, prompts):
    sps = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=24, ignore_eos=True,
                          logprobs=2 if i % 2 else None, repetition_penalty=1.1 if i % 3 == 0 else 1.0,
                          presence_penalty=0.5 if i == 1 else 0.0, min_tokens=3 if i == 2 else 0, top_k=40)
           for i in range(len(prompts))]
    ref = llm.generate(prompts, sps, use_tqdm=False)
    spec = _spec_llm()
    outs = spec.generate(prompts, sps, use_tqdm=False)
    assert spec.llm_engine.stats.num_draft_tokens > 0
    for r, o in zip(ref, outs):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        if r.outputs[0].logprobs is not None:
            for a, b in zip(r.outputs[0].logprobs, o.outputs[0].logprobs):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t][0] == pytest.approx(b[t][0], abs=1e-4) and a[t][1] == b[t][1]
    spec.shutdown()


class _GreedyScript(Proposer):
    """Drafts a fixed continuation (a tiny model's greedy one) whatever was sampled."""

    script: list[int] = []

    def propose(self, requests, batch):
        return [self.script[len(st.output_token_ids):][: self.num_speculative_tokens] or [0]
                for st in requests]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    d = tmp_path_factory.mktemp("tiny_spec")
    model.save_pretrained(d)
    return str(d)


def test_sampled_distribution_matches_without_speculation(tiny_model):
    """Chi-square two-sample test over the joint distribution of 3 sampled tokens (vocab 8:
    512 cells), speculation (drafts of a fixed continuation, k=2) vs none, unseeded; and the
    same seeds give the same tokens."""
    prompt = [3, 4, 5, 3, 4]
    common = dict(model=tiny_model, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True, max_num_seqs=512, enable_prefix_caching=True)
    plain = LLM(**common)
    greedy = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    register_proposer("greedy_script", _GreedyScript)
    _GreedyScript.script = list(greedy)
    spec = LLM(**common, speculative_config={"method": "greedy_script", "num_speculative_tokens": 2,
                                             "dynamic": False})
    N = 3000
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    samples = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        outs = eng.generate([prompt] * N, sp, use_tqdm=False)
        samples[name] = [tuple(o.outputs[0].token_ids) for o in outs]
    st = spec.llm_engine.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # drafts both kept and rejected
    cells = sorted(set(samples["plain"]) | set(samples["spec"]))
    table = [[samples[n].count(c) for c in cells] for n in ("plain", "spec")]
    # merge rare cells so expected counts are >= 5
    keep = [i for i, c in enumerate(cells) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(cells)) if i not in keep]
    t = [[row[i] for i in keep] + [sum(row[i] for i in rare)] for row in table]
    stats = pytest.importorskip("scipy.stats")
    _, pval, _, _ = stats.chi2_contingency(t)
    assert pval > 1e-3, pval
    seeded = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=s) for s in range(40)]
    a = [o.outputs[0].token_ids for o in plain.generate([prompt] * 40, seeded, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec.generate([prompt] * 40, seeded, use_tqdm=False)]
    assert a == b


def test_spec_metrics_in_prometheus():
    from kvserve.core.scheduler import SchedulerStats
    from kvserve.metrics.prometheus import PrometheusStatLogger

    m = PrometheusStatLogger("m")
    m.on_step(SchedulerStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=5,
                             num_accepted_tokens_per_pos=[3, 2, 0]), 0, 0)
    m.on_step(SchedulerStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7,
                             num_accepted_tokens_per_pos=[4, 2, 1]), 0, 0)
    text = m.render() if isinstance(m.render(), str) else m.render().decode()
    for line in ['kvserve:spec_decode_num_drafts_total{model_name="m"} 4.0',
                 'kvserve:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'kvserve:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
                 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0']:
        assert line in text, line


def test_draft_model_equal_to_target_accepts_everything(llm, prompts, smollm2_path):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], sp, use_tqdm=False)]
    spec = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256, disable_log_stats=True,
               max_num_batched_tokens=64,
               speculative_config={"method": "draft_model", "model": smollm2_path, "num_speculative_tokens": 3,
                                   "draft_num_blocks": 40})
    outs = spec.generate(prompts[:4], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    st = spec.llm_engine.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    proposer = spec.llm_engine.engine_core.model_runner.proposer
    # Finished requests reach the worker with the next step: states of the last round remain
    # until then; every block is either free or held by one of them.
    assert len(proposer.free_blocks) + sum(len(s.blocks) for s in proposer.states.values()) == 39
    spec.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert set(proposer.states) <= {o.request_id for o in outs} | {str(len(outs))}
    assert len(proposer.free_blocks) + sum(len(s.blocks) for s in proposer.states.values()) == 39
    assert len(proposer.states) <= 1
    assert spec.llm_engine.engine_core.kv_cache_manager.usage == 0.0
    spec.shutdown()


def test_draft_model_with_another_vocabulary_is_a_startup_error(tiny_model, smollm2_path):  # the default model is the target
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(disable_log_stats=True, speculative_config={"method": "draft_model", "model": tiny_model})
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(disable_log_stats=True, speculative_config={"method": "draft_model"})
    with pytest.raises(FileNotFoundError):
        LLM(disable_log_stats=True, speculative_config={"method": "draft_model", "model": "/nonexistent/x.gguf"})


def test_dynamic_speculation_turns_off_under_load(tiny_model):
    """8 requests running together: with dynamic_max_batch=4 nothing is drafted (the
    proposer is told k=0), without dynamic speculation drafts flow; outputs identical."""
    common = dict(model=tiny_model, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 8, (12,), generator=g).tolist() for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    got = {}
    for dyn in (True, False):
        eng = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1, "dynamic": dyn, "dynamic_max_batch": 4})
        got[dyn] = (eng.generate(prompts, sp, use_tqdm=False), eng.llm_engine.stats.num_draft_tokens)
        assert [o.outputs[0].token_ids for o in got[dyn][0]] == ref
    assert got[True][1] == 0 and got[False][1] > 0


def test_dynamic_speculation_with_async_scheduling(tiny_model):
    """Dynamic speculation keeps async scheduling: steps overlap while the batch is large
    (speculation off), and run one at a time once it shrinks and drafts flow; greedy
    outputs equal no speculation's."""
    common = dict(model=tiny_model, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True, async_scheduling=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 8, (12,), generator=g).tolist() for _ in range(8)]
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4,) * 5 + (32,) * 3]
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sps, use_tqdm=False)]
    eng = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                            "dynamic": True, "dynamic_max_batch": 4})
    assert eng.llm_engine.engine_core.async_scheduling
    out = eng.generate(prompts, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert eng.llm_engine.stats.num_draft_tokens > 0  # on once 3 requests were left


def test_suffix_decoding_is_lossless_and_learns_from_finished_outputs(tiny_model):
    """Suffix decoding (arXiv:2411.04975): greedy outputs equal no speculation's, batched; run
    again, the same requests draft from the global tree of the first round's outputs and get
    more drafts accepted."""
    common = dict(model=tiny_model, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 8, (10,), generator=g).tolist() for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    eng = LLM(**common, speculative_config={"method": "suffix", "num_speculative_tokens": 4, "dynamic": False,
                                            "suffix_decoding_max_spec_factor": 2.0})
    st = eng.llm_engine.stats
    accepted = []
    for _ in range(2):
        before = st.num_accepted_tokens
        assert [o.outputs[0].token_ids for o in eng.generate(prompts, sp, use_tqdm=False)] == ref
        accepted.append(st.num_accepted_tokens - before)
    assert accepted[1] > accepted[0] > 0, accepted
    assert eng.llm_engine.engine_core.kv_cache_manager.usage == 0.0
