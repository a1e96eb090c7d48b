"""The draft steps' static-buffer (CUDA-graph) path on the CPU: ``DraftGraphRunner`` with its
eager stand-in replays the same static buffers, padding, last-row gathers and device-side slot
arithmetic a captured graph does. For an EAGLE-3 head on a tiny Llama and the MTP layer of a
tiny DeepSeek-V3, every draft call that fits the graphs is run both ways from the same head
KV: the drafts are equal and so is the head's KV cache afterwards; greedy outputs with the
graphs on equal those without speculation. On CUDA (GPU_TESTS) the real captured graphs
are checked against the eager drafts the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.layers.attention import attention_layers
from kvserve.models.llama_eagle import save_random_eagle_head
from tests.spec_decode.test_deepseek_mtp import _write_checkpoint
from tests.spec_decode.test_eagle import _tiny_cfg

K = 3


@pytest.fixture(scope="module")
def eagle3_setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    cfg = _tiny_cfg(num_hidden_layers=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    target = tmp_path_factory.mktemp("dg_target")
    model.save_pretrained(target)
    head = tmp_path_factory.mktemp("dg_head")
    save_random_eagle_head(str(head), cfg, eagle3=True, draft_vocab_size=32, seed=2, std=0.2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 17, 9)]
    return dict(model=str(target)), {"method": "eagle3", "model": str(head)}, prompts, 12


@pytest.fixture(scope="module")
def mtp_setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("dg_mtp")
    _write_checkpoint(str(path), oracle=True)  # every draft accepted: 1 + k new pairs per step
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 11, 3)]
    return dict(model=str(path), block_size=4, max_model_len=64), {"method": "deepseek_mtp"}, prompts, 24


def compare_both_ways(proposer, calls: list, atol: float = 1e-5, tree: bool = False) -> None:
    """Wrap ``_draft`` (``tree``: ``_draft_tree``): a call the graphs serve runs eagerly and through
    the graphs from the same head KV; drafts (trees: tokens, parents, ranks) and KV must agree (the
    graph's result is kept)."""
    kv = attention_layers(proposer.head)[0].kv.cache
    graphs = proposer.draft_graphs
    eager_draft = proposer._draft_tree_eager if tree else proposer._draft_eager

    def both(rows, ids, pos, hid, qlens, seq, k):
        if not (graphs.can_run(len(rows), qlens, k) and proposer._graph_ready(rows)):
            return eager_draft(rows, ids, pos, hid, qlens, seq, k)
        before = kv.clone()
        eager = eager_draft(rows, ids, pos, hid, qlens, seq, k)
        kv_eager = kv.clone()
        kv.copy_(before)
        got = graphs.run(proposer._block_tables(rows), ids, pos, hid, qlens, seq, k)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(eager))
        # block 0 is the null block: padding rows may write it on one path and not the other
        torch.testing.assert_close(kv[1:], kv_eager[1:], atol=atol, rtol=atol)
        calls.append((len(rows), max(qlens), k))
        return got

    if tree:
        proposer._draft_tree = both
    else:
        proposer._draft = both


@pytest.mark.parametrize("setup", ["mtp_setup", "eagle3_setup"])
def test_static_buffer_draft_path_equals_dynamic(setup, request):
    model_kw, spec, prompts, max_tokens = request.getfixturevalue(setup)
    common = dict(model_kw, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=4,
                  cpu_threads=1, disable_log_stats=True, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(**common, speculative_config=dict(spec, num_speculative_tokens=K, dynamic=False))
    proposer = llm.llm_engine.engine_core.model_runner.proposer
    proposer.capture_cuda_graphs(eager=True)
    assert sorted({k for _, k in proposer.draft_graphs.graphs}) == list(range(1, K + 1))
    calls: list = []
    compare_both_ways(proposer, calls)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    # Decode steps went through the static path, batched (padded to a captured size).
    assert len(calls) >= 4 and any(r > 1 for r, _, _ in calls)
    if spec["method"] == "deepseek_mtp":  # the oracle's drafts are accepted: step 0 feeds 1 + k pairs
        assert any(q == K + 1 for _, q, _ in calls)
    proposer.num_drafts_allowed = 1  # dynamic speculation lowered k: the k=1 graph
    assert proposer.draft_graphs.can_run(3, [2, 1, 4], 1) and not proposer.draft_graphs.can_run(3, [K + 2], 1)
    proposer.release_cuda_graphs()
    assert proposer.draft_graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setup", ["mtp_setup", "eagle3_setup"])
def test_cuda_draft_graphs_equal_eager(setup, request):
    """On a GPU: the engine captures the target's verify graphs and the draft graphs (EAGLE-3's
    mid-layer states from the graphs' static buffers); every graphed draft call equals the
    eager drafts from the same KV, and greedy outputs equal an eager engine without speculation."""
    model_kw, spec, prompts, max_tokens = request.getfixturevalue(setup)
    model_kw = {k: v for k, v in model_kw.items() if k != "block_size"}  # the GPU default
    common = dict(model_kw, skip_tokenizer_init=True, dtype="float32", device="cuda", max_num_seqs=4,
                  disable_log_stats=True, max_num_batched_tokens=64, kv_cache_memory="64MiB")
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**common, enforce_eager=True).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(**common, speculative_config=dict(spec, num_speculative_tokens=K, dynamic=False))
    runner = llm.llm_engine.engine_core.model_runner
    proposer = runner.proposer
    assert runner.graph_runner is not None and proposer.draft_graphs is not None
    assert not proposer.draft_graphs.eager
    calls: list = []
    # MLA: the eager step 0 of uneven new pairs takes the expanded path, the graph the absorbed one
    compare_both_ways(proposer, calls, atol=1e-4)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert len(calls) >= 4


def test_aux_hidden_states_static_buffers():
    """What the target's graphs do for EAGLE-3: the kept mid-layer states are copied into
    static buffers inside the captured forward and published back to the model after replay."""
    from kvserve.worker.cuda_graphs import AuxHiddenStates

    class Inner(torch.nn.Module):
        aux_hidden_state_layers = (0, 2)

        def forward(self, x):
            self.aux_hidden_states = {0: x * 2, 2: x + 1}
            return x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def forward(self, x):
            return self.model(x)

    m = Outer()
    aux = AuxHiddenStates(m, max_tokens=8)
    x = torch.randn(8, 4)
    m(x)
    aux.allocate()  # the warm-up
    assert set(aux.bufs) == {0, 2} and aux.bufs[0].shape == (8, 4)
    y = torch.randn(5, 4)
    m(y)
    aux.store(5)  # inside the captured forward
    m.model.aux_hidden_states = {}  # a replay runs no Python
    aux.publish(5)
    torch.testing.assert_close(m.model.aux_hidden_states[0], y * 2)
    torch.testing.assert_close(m.model.aux_hidden_states[2], y + 1)
    assert AuxHiddenStates(torch.nn.Linear(2, 2), 4).owner is None  # no kept states: nothing to do
