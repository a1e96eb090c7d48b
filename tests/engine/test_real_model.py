"""The real default model: greedy equality with transformers, batch invariance, preemption."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(llm, humaneval_prompts):
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in humaneval_prompts]
    assert len({len(i) for i in ids}) == 8  # all different lengths
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2, prompt_ids):
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = hf_smollm2.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                                    min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def ours_alone(llm, prompt_ids):
    return [llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for ids in prompt_ids]


def test_greedy_matches_transformers(ours_alone, hf_greedy):
    for i, (a, b) in enumerate(zip(ours_alone, hf_greedy)):
        assert len(a) == MAX_NEW
        assert a == b, f"prompt {i}: first difference at token {next(k for k in range(MAX_NEW) if a[k] != b[k])}"


def test_batched_with_others_is_invariant(llm, prompt_ids, ours_alone):
    # The 8 prompts plus 8 others of different lengths and output lengths, in one batch.
    others = [list(range(100 + i, 140 + 7 * i)) for i in range(8)]
    params = [GREEDY] * 8 + [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(8)]
    outs = llm.generate(prompt_ids + others, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:8]] == ours_alone
    assert [len(o.outputs[0].token_ids) for o in outs[8:]] == [8 + 3 * i for i in range(8)]
    assert llm.llm_engine.engine_core.kv_cache_manager.usage == 0.0


def test_tiny_token_budget_chunks_prefill(prompt_ids, ours_alone):
    small = LLM(max_num_batched_tokens=19, max_model_len=512, kv_cache_memory="64MiB",
                enable_prefix_caching=False, disable_log_stats=True)
    outs = small.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ours_alone


def test_preemption_keeps_outputs(prompt_ids, ours_alone):
    # 28 blocks x 16 tokens: the 8 prompts (~100-250 tokens + 32 new each) cannot all fit.
    tiny = LLM(num_gpu_blocks_override=29, max_model_len=448, disable_log_stats=True)
    outs = tiny.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert tiny.llm_engine.stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == ours_alone
    pool = tiny.llm_engine.engine_core.kv_cache_manager.pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    pool.check_invariants()


def test_chat_answers_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out.outputs[0].text


def test_n_completions_share_prompt_blocks(llm, prompt_ids):
    eng = llm.llm_engine
    q0, h0 = eng.stats.prefix_cache_queries, eng.stats.prefix_cache_hits
    ids = list(reversed(prompt_ids[-1]))  # a prompt no earlier test cached
    out = llm.generate([ids], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=8), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) > 0 for o in out.outputs)
    # siblings 2 and 3 reuse every full block of the prompt computed by sibling 1
    full = (len(ids) - 1) // 16 * 16
    assert eng.stats.prefix_cache_hits - h0 >= 2 * full
    assert eng.stats.prefix_cache_queries - q0 == 3 * len(ids)
