"""Tree drafts verified in one target pass (EAGLE-2 / SpecInfer): the tree helpers; a scripted
tree proposer on a tiny random model (greedy identical to no speculation with the metrics equal
to a hand count, sampled outputs distributed as without speculation by a chi-square test, seeded
outputs identical, no blocks left); and EAGLE-1 / EAGLE-3 heads drafting trees on a tiny random
Llama (greedy identical to no speculation, batched with chunked prefill, prefix hits and
preemption; every target and head block free at the end)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.llama_eagle import save_random_eagle_head
from kvserve.spec_decode import Proposer, register_proposer
from kvserve.spec_decode.tree import select_tree, tree_ancestor_bits, tree_depths, walk_tree
from tests.utils import save_random_causal_lm


def test_tree_helpers():
    parents = [-1, -1, 0, 0, 2, 1]
    assert tree_depths(parents).tolist() == [0, 1, 1, 2, 2, 3, 2]
    bits = tree_ancestor_bits(parents).tolist()
    assert bits == [1, 0b11, 0b101, 0b1011, 0b10011, 0b101011, 0b1000101]
    assert tree_ancestor_bits([-1] + list(range(62)))[-1] == -1  # 64 rows: bit 63 is the sign bit
    with pytest.raises(ValueError, match="earlier node"):
        tree_depths([-1, 2, 0])
    drafts = [5, 6, 7, 8, 9, 4]
    # root samples 6 -> node 1 (row 2), which samples 4 -> node 5 (row 6), which samples 3: stop
    assert walk_tree(drafts, parents, [6, 0, 4, 0, 0, 0, 3]) == ([6, 4, 3], [0, 2, 6])
    assert walk_tree(drafts, parents, [1, 0, 0, 0, 0, 0, 0]) == ([1], [0])
    # pool: root children a(-0.1) b(-0.5); a's children c(-0.3) d(-2.0); b's child e(-0.6)
    tok, par = select_tree(np.array([10, 11, 12, 13, 14]), np.array([-0.1, -0.5, -0.3, -2.0, -0.6]),
                           np.array([-1, -1, 0, 0, 1]), 4)
    assert (tok, par) == ([10, 11, 12, 14], [-1, -1, 0, 1])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    return save_random_causal_lm(tmp_path_factory.mktemp("tiny_tree"), cfg, std=0.5)


class _TreeScript(Proposer):
    """Drafts a fixed tree per request: along ``script`` (the greedy continuation) with a wrong
    first sibling at every depth, so the walk must take the second child: ``[wrong, right]`` per
    depth, each right node the parent of the next pair."""

    script: list[int] = []
    supports_tree_drafts = True

    def __init__(self, config):
        super().__init__(config)
        self.trees = {}

    def continuation(self, st) -> list[int]:
        return self.script

    def propose(self, requests, batch):
        out = []
        for st in requests:
            nxt = self.continuation(st)[len(st.output_token_ids):][:3]
            toks, parents, parent = [], [], -1
            for t in nxt:
                toks += [(t + 1) % 8, t]
                parents += [parent, parent]
                parent = len(toks) - 1
            toks, parents = toks[:self.config.speculative_config.max_draft_tokens], parents[:len(toks)]
            self.trees[st.req_id] = (toks, parents)
            out.append(toks)
        return out

    def draft_tree(self, req_id, drafts):
        toks, parents = self.trees[req_id]
        assert toks[:len(drafts)] == list(drafts)
        return parents[:len(drafts)]


def test_scripted_tree_lossless_greedy_sampled_seeded(tiny_model):
    """Greedy: the walk takes the second child at each depth, all 3 depths accepted (hand count);
    sampled (unseeded) over many requests: the joint law of 3 tokens matches no speculation's
    (chi-square, vocab 8); seeded: the same tokens as without speculation."""
    prompt = [3, 4, 5, 3, 4]
    common = dict(model=tiny_model, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True, max_num_seqs=512, enable_prefix_caching=True)
    plain = LLM(**common)
    greedy = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    register_proposer("tree_script", _TreeScript)
    _TreeScript.script = list(greedy)
    spec = LLM(**common, speculative_config={"method": "tree_script", "num_speculative_tokens": 3,
                                             "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 7,
                                             "dynamic": False})
    st = spec.llm_engine.stats
    out = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy
    # by hand: after the prefill's token, a tree of 6 nodes accepts all 3 depths (+4 tokens); then
    # max_tokens leaves room for 2 drafts (a cut tree: [wrong, right]): 1 accepted (+2); then none
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2, 8, 4)
    assert st.num_accepted_tokens_per_pos == [2, 1, 1, 0, 0, 0]
    core = spec.llm_engine.engine_core
    assert core.kv_cache_manager.usage == 0.0
    N = 1200
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    samples = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        samples[name] = [tuple(o.outputs[0].token_ids) for o in eng.generate([prompt] * N, sp, use_tqdm=False)]
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    cells = sorted(set(samples["plain"]) | set(samples["spec"]))
    table = [[samples[n].count(c) for c in cells] for n in ("plain", "spec")]
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
    assert core.kv_cache_manager.usage == 0.0
    core.kv_cache_manager.check_invariants()


class _TreeScriptPerPrompt(_TreeScript):
    """``_TreeScript`` with each request's greedy continuation looked up by its prompt."""

    scripts: dict[tuple, list[int]] = {}

    def continuation(self, st) -> list[int]:
        return self.scripts[tuple(st.prompt_token_ids)]


def test_scripted_tree_with_cpu_tier_saves_accepted_kv(tiny_model):
    """CPU tier (``--kv-offloading-size``) with swap preemption and tree drafts whose first
    sibling at every depth is rejected: the greedy tokens equal a run without speculation, and
    every block both runs saved to the tier (same tokens, same content key) holds the same K/V,
    so the tier got the accepted path after its compaction, never a rejected sibling's K/V."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 8, (n,), generator=g).tolist() for n in (6, 9, 13, 7)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(model=tiny_model, skip_tokenizer_init=True, dtype="float32", disable_log_stats=True, block_size=4,
                  num_gpu_blocks_override=14, max_model_len=48, kv_offloading_size=0.001, preemption_mode="swap",
                  enable_prefix_caching=False)
    plain = LLM(**common)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    register_proposer("tree_script_per_prompt", _TreeScriptPerPrompt)
    _TreeScriptPerPrompt.scripts = {tuple(p): list(r) for p, r in zip(prompts, ref)}
    spec = LLM(**common, speculative_config={"method": "tree_script_per_prompt", "num_speculative_tokens": 3,
                                             "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 7,
                                             "dynamic": False})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    saved = []
    for llm in (plain, spec):
        core = llm.llm_engine.engine_core
        core.model_runner.kv_connector.wait_for_save()
        saved.append((core.kv_connector.index, core.model_runner.kv_connector.worker.pool))
    (idx_a, pool_a), (idx_b, pool_b) = saved
    # both runs saved every full block of every sequence (the last token's K/V is never
    # computed), blocks past the prompts included: K/V written by (tree) verify steps
    assert set(idx_a) == set(idx_b) and len(idx_a) == sum((len(p) + 15) // 4 for p in prompts)
    for k in idx_a:
        torch.testing.assert_close(pool_b[idx_b[k][0]], pool_a[idx_a[k][0]], atol=1e-5, rtol=1e-5)
    assert got == ref
    st, core = spec.llm_engine.stats, spec.llm_engine.engine_core
    assert st.num_preemptions > 0 and st.num_accepted_tokens > 0
    assert core.kv_connector.get_stats()["swap_out_blocks"] > 0
    assert core.kv_cache_manager.usage == 0.0
    core.kv_cache_manager.check_invariants()
    core.kv_connector.check_invariants()


def test_tree_config_checks(tiny_model):
    with pytest.raises(ValueError, match="drafts chains only"):
        LLM(model=tiny_model, skip_tokenizer_init=True, kv_cache_memory="16MiB", disable_log_stats=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "speculative_eagle_topk": 2})
    from kvserve.config import SpeculativeConfig

    for bad in ({"speculative_num_draft_tokens": 80}, {"speculative_eagle_topk": 0}):
        with pytest.raises(ValueError, match="speculative_"):
            SpeculativeConfig.from_dict({"method": "eagle", "model": "x", "speculative_eagle_topk": 2, **bad})
    assert SpeculativeConfig.from_dict({"method": "eagle", "model": "x", "num_speculative_tokens": 3,
                                        "speculative_eagle_topk": 4}).max_draft_tokens == 12


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    return save_random_causal_lm(tmp_path_factory.mktemp("tiny_tree_target"), cfg, std=0.3), cfg


def test_eagle3_tree_greedy_lossless_prefix_preempted_no_leaks(tiny_target, tmp_path):
    """An EAGLE-3 head drafting trees (topk 3, depth 3, 8 nodes): batched greedy with chunked
    prefill, preemption and (second round) prefix hits equals no speculation; drafts are trees
    (some node has a sibling) and some are accepted; every target and head block is free at the
    end. (EAGLE-1 heads draft through the same code, their tokens unmapped.)"""
    eagle3 = True
    path, cfg = tiny_target
    save_random_eagle_head(str(tmp_path), cfg, eagle3=eagle3, draft_vocab_size=32, seed=2, std=0.2)
    common = dict(model=path, skip_tokenizer_init=True, dtype="float32", disable_log_stats=True,
                  max_num_batched_tokens=24, enable_prefix_caching=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**common, kv_cache_memory="16MiB").generate(prompts, sp,
                                                                                           use_tqdm=False)]
    spec = LLM(**common, num_gpu_blocks_override=9, max_model_len=96,
               speculative_config={"method": "eagle3" if eagle3 else "eagle", "model": str(tmp_path),
                                   "num_speculative_tokens": 3, "speculative_eagle_topk": 3,
                                   "speculative_num_draft_tokens": 9, "dynamic": False})
    proposer = spec.llm_engine.engine_core.model_runner.proposer
    for _ in range(2):  # the second round hits the prefix cache
        outs = spec.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    assert any(len(set(p)) < len(p) for _, p in proposer.trees.values())  # siblings: real trees
    assert max(len(t) for t, _ in proposer.trees.values()) == 8  # whole trees (cut only near max_tokens)
    st = spec.llm_engine.stats
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert 0 < st.num_accepted_tokens <= st.num_draft_tokens
    core = spec.llm_engine.engine_core
    assert core.kv_cache_manager.usage == 0.0
    core.kv_cache_manager.check_invariants()
    spec.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(proposer.free_blocks) + sum(len(s.blocks) for s in proposer.states.values()) == \
        proposer.num_blocks - 1
