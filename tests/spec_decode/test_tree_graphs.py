"""EAGLE-2 tree drafts through the draft CUDA graphs' static buffers, on the CPU with stand-in
"graphs" (``TreeDraftGraphRunner`` with ``eager=True``: the captured function replayed over the
same static buffers, padding and device-side slot / mask / top-k bookkeeping). For EAGLE-3 and
EAGLE heads, topk 2-4 and depth 2-4, batched and single requests: every tree draft the graphs
serve is also run eagerly from the same head KV, and the candidate pools (tokens, parent
pointers, ranks: the same tree) and the head's KV afterwards are equal; greedy outputs with the
graph path on equal no speculation, and no target or head block is left behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.llama_eagle import save_random_eagle_head
from tests.spec_decode.test_draft_graphs import compare_both_ways
from tests.spec_decode.test_eagle import _tiny_cfg
from tests.utils import save_random_causal_lm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = _tiny_cfg()
    target = save_random_causal_lm(tmp_path_factory.mktemp("tg_target"), cfg, std=0.3)
    heads = {}
    for eagle3 in (True, False):
        h = tmp_path_factory.mktemp("tg_head3" if eagle3 else "tg_head1")
        save_random_eagle_head(str(h), cfg, eagle3=eagle3, draft_vocab_size=32, seed=2, std=0.2)
        heads[eagle3] = str(h)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 17, 9)]
    # device="cpu": the stand-in graphs' exact equality is a CPU claim (on a GPU, padded float32 GEMMs may
    # round differently and flip a near-tie); test_cuda_tree_draft_graphs_equal_eager is the CUDA one
    common = dict(model=str(target), device="cpu", skip_tokenizer_init=True, dtype="float32", kv_cache_memory="8MiB",
                  max_num_seqs=4, cpu_threads=1, disable_log_stats=True, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    return common, heads, prompts, sp, ref


def test_pool_ranks_select_as_select_tree():
    """The device ranks (a stable sort, ties in pool order) pick the same nodes as ``select_tree``."""
    from kvserve.spec_decode.tree import pool_ranks, select_ranked, select_tree

    tok = np.array([10, 11, 12, 13, 14, 15, 16])
    score = np.array([-0.1, -0.5, -0.5, -0.3, -0.5, -0.7, -0.5], dtype=np.float32)
    parent = np.array([-1, -1, -1, 0, 0, 1, 3])
    rank = pool_ranks(torch.from_numpy(score)[None])[0].numpy()
    assert rank.tolist() == [0, 2, 3, 1, 4, 6, 5]
    for n in range(1, 8):
        assert select_ranked(tok, rank, parent, n) == select_tree(tok, score, parent, n)


@pytest.mark.parametrize("eagle3,topk,depth", [(True, 2, 4), (False, 3, 3), (True, 4, 2)])
def test_tree_draft_graphs_equal_eager_and_lossless(setup, eagle3, topk, depth):
    common, heads, prompts, sp, ref = setup
    nodes = min(topk + (depth - 1) * topk * topk, 2 * depth + 2)
    llm = LLM(**common, speculative_config={
        "method": "eagle3" if eagle3 else "eagle", "model": heads[eagle3], "num_speculative_tokens": depth,
        "speculative_eagle_topk": topk, "speculative_num_draft_tokens": nodes + 1, "dynamic": False})
    proposer = llm.llm_engine.engine_core.model_runner.proposer
    proposer.capture_cuda_graphs(eager=True)
    graphs = proposer.draft_graphs
    assert {(t, d) for _, t, d in graphs.graphs} == {(topk, d) for d in range(1, depth + 1)}
    calls: list = []
    compare_both_ways(proposer, calls, tree=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)  # several requests (padded to a captured size)
    assert [o.outputs[0].token_ids for o in outs] == ref
    # batched (padded to a captured size); after an accepted draft, step 0 fed 1 + accepted pairs
    assert any(r > 1 for r, _, _ in calls) and any(q > 1 for _, q, _ in calls)
    n_batched = len(calls)
    outs = llm.generate(prompts[1:2], sp, use_tqdm=False)  # one request
    assert outs[0].outputs[0].token_ids == ref[1]
    assert len(calls) > n_batched and all(r == 1 for r, _, _ in calls[n_batched:])
    assert any(len(set(p)) < len(p) for _, p in proposer.trees.values())  # siblings: real trees
    st = llm.llm_engine.stats
    assert 0 < st.num_accepted_tokens <= st.num_draft_tokens
    core = llm.llm_engine.engine_core
    assert core.kv_cache_manager.usage == 0.0
    core.kv_cache_manager.check_invariants()
    assert len(proposer.free_blocks) + sum(len(s.blocks) for s in proposer.states.values()) == \
        proposer.num_blocks - 1
    proposer.release_cuda_graphs()
    assert proposer.draft_graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tree_draft_graphs_equal_eager(setup):
    """On a GPU: the engine captures the tree draft graphs; every graphed tree draft equals the
    eager one from the same head KV, and greedy outputs equal an eager engine without speculation."""
    common, heads, prompts, sp, _ = setup
    common = dict(common, device="cuda", max_num_batched_tokens=64, kv_cache_memory="64MiB")
    common.pop("cpu_threads")
    ref = [o.outputs[0].token_ids for o in LLM(**common, enforce_eager=True).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(**common, speculative_config={"method": "eagle3", "model": heads[True], "num_speculative_tokens": 3,
                                            "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 9,
                                            "dynamic": False})
    proposer = llm.llm_engine.engine_core.model_runner.proposer
    assert proposer.draft_graphs is not None and not proposer.draft_graphs.eager
    calls: list = []
    compare_both_ways(proposer, calls, tree=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert len(calls) >= 4
