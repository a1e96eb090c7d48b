"""The real default model: greedy equality with transformers, batch invariance, preemption."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvserve import LLM, SamplingParams


MAX_NEW = 24  # every decode crosses a 16-token KV block boundary; each token costs a transformers and a kvserve step
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
    small = LLM(dtype="float32", max_num_batched_tokens=19, max_model_len=512, kv_cache_memory="64MiB",
                enable_prefix_caching=False, disable_log_stats=True)
    outs = small.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ours_alone


@pytest.fixture(scope="module")
def tiny():
    """28 blocks x 16 tokens, prefix caching on (the default)."""
    return LLM(dtype="float32", num_gpu_blocks_override=29, max_model_len=448, disable_log_stats=True)


def test_preemption_keeps_outputs(prompt_ids, ours_alone, tiny):
    # 28 blocks x 16 tokens: the 8 prompts (~100-250 tokens + 24 new each) cannot all fit.
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


# ---- prefix caching (radix tree, token-granular copy-on-write) ------------------------------------

SHORT = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
_cold_salts = itertools.count()


def _cold(llm, prompts):
    """Each prompt computed from scratch: a fresh cache_salt sees an empty cache (caching off)."""
    outs = []
    for p in prompts:
        o = llm.generate([p], SHORT, use_tqdm=False, cache_salt=f"cold-{next(_cold_salts)}")[0]
        assert o.num_cached_tokens == 0
        outs.append(o.outputs[0].token_ids)
    return outs


def test_shared_prefix_token_granular_hits_match_caching_off(llm, prompt_ids):
    base, other = prompt_ids[-1], prompt_ids[0]
    assert len(base) > 160 and other[0] != base[37]
    salt = "shared-prefix-test"
    first = llm.generate([base[:150]], SHORT, use_tqdm=False, cache_salt=salt)[0]
    assert first.num_cached_tokens == 0
    prompts = [
        base[:150],  # identical repeat: 9 full blocks + 5 tokens copied, the last computed
        base[:37] + other[:20],  # 2 full blocks + 5 tokens of block 3, copied
        base[:150] + other[:10],  # 9 full blocks + the 6 prompt tokens of block 10 (+ outputs?)
        base[:20],  # 1 full block + 3 tokens
    ]
    mr = llm.llm_engine.engine_core.model_runner
    copies = []
    orig = mr.run_block_ops
    mr.run_block_ops = lambda ops: (copies.extend((o.src, o.dst, o.num_tokens) for o in ops), orig(ops))
    try:
        outs = llm.generate(prompts, SHORT, use_tqdm=False, cache_salt=salt)
    finally:
        del mr.run_block_ops
    assert [o.num_cached_tokens for o in outs[:2]] == [149, 37]
    assert outs[2].num_cached_tokens >= 150 and outs[3].num_cached_tokens == 19
    assert sorted(n for _, _, n in copies)[:3] == [3, 5, 5]
    assert [o.outputs[0].token_ids for o in outs] == _cold(llm, prompts)
    assert outs[0].outputs[0].token_ids == first.outputs[0].token_ids
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.usage == 0.0
    kv.pool.check_invariants()


def test_cache_salt_isolates_on_the_real_model(llm, prompt_ids):
    p = prompt_ids[3][:90]
    a = llm.generate([p], SHORT, use_tqdm=False, cache_salt="tenant-a")[0]
    b = llm.generate([p], SHORT, use_tqdm=False, cache_salt="tenant-b")[0]
    a2 = llm.generate([p], SHORT, use_tqdm=False, cache_salt="tenant-a")[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, a2.num_cached_tokens) == (0, 0, 89)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids


def test_eviction_under_a_tiny_pool_is_leaf_first_and_outputs_stay_right(tiny, llm, prompt_ids):
    kv = tiny.llm_engine.engine_core.kv_cache_manager
    kv.pool.reset_prefix_cache()
    a, b = prompt_ids[-1][:160], sum(prompt_ids[-2::-1], [])[:300]
    assert len(a) == 160 and len(b) == 300 and a[:16] != b[:16]
    # a computes 160 + 15 tokens: 10 full blocks cached (+1 uncached); b computes 315 tokens,
    # 20 blocks: the 18 uncached ones, then 2 of a's.
    ra = tiny.generate([a], SHORT, use_tqdm=False)[0]
    e0 = kv.pool.num_evictions
    rb = tiny.generate([b], SHORT, use_tqdm=False)[0]
    assert kv.pool.num_evictions - e0 == 2
    # Leaf-first, LRU: a's blocks 10 and 9 went; its first 8 blocks are still a path from the root.
    ra2 = tiny.generate([a], SHORT, use_tqdm=False)[0]
    assert ra2.num_cached_tokens == 8 * 16
    assert [ra.outputs[0].token_ids, rb.outputs[0].token_ids, ra2.outputs[0].token_ids] == _cold(llm, [a, b, a])
    assert kv.usage == 0.0
    kv.pool.check_invariants()
