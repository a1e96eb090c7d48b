"""CUDA graphs for decode steps: bucket sizes (CPU) and graph == eager outputs (GPU)."""

from __future__ import annotations

import pytest
import torch

from kvserve.worker.cuda_graphs import capture_sizes, piecewise_sizes


def test_capture_sizes_cover_every_batch():
    sizes = capture_sizes(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    assert all(b % 8 == 0 for b in sizes[3:-1])
    for r in range(1, 101):
        assert any(s >= r for s in sizes)
    assert capture_sizes(3) == [1, 2, 3]


def test_capture_sizes_sparser_at_large_batch():
    sizes = capture_sizes(1024)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 1024 and len(sizes) <= 70
    assert set(range(8, 257, 8)) <= set(sizes)  # every multiple of 8 up to 256, as before
    for r in range(257, 1025):  # padding above 256 wastes at most ~6% of the batch
        assert next(s for s in sizes if s >= r) - r < 0.06 * r + 1


def test_piecewise_sizes_cover_every_token_count():
    sizes = piecewise_sizes(8192)
    assert sizes[0] == 16 and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    for t in range(1, 8193):
        s = next(x for x in sizes if x >= t)
        assert s <= max(16, 2 * t) and (t < 512 or s <= 1.5 * t + 1)
    assert piecewise_sizes(100) == [16, 32, 64, 100]
    assert piecewise_sizes(16) == [16]


def _random_llama(path) -> None:
    """A 2-layer random Llama (vocab 512, GQA 8:2) saved as a HF directory at ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
@pytest.mark.parametrize("budget", [512, 24])
def test_graph_replay_matches_eager(tmp_path, budget, kv_dtype):
    """Decode graphs and piecewise graphs (steps with prefill; budget 24 forces chunked
    prefill mixed with decodes) give the eager tokens; int4 also checks that the Hadamard
    rotation (``Attention.forward``) runs exactly once per layer both inside a decode graph and
    between the piecewise graph pieces."""
    from kvserve import LLM, SamplingParams

    _random_llama(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 9, 16, 33, 70)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                  max_num_seqs=12, kv_cache_memory="64MiB", enforce_eager=eager, disable_log_stats=True,
                  max_num_batched_tokens=budget, kv_cache_dtype=kv_dtype)
        runner = llm.llm_engine.engine_core.model_runner
        assert (runner.graph_runner is None) == eager and (runner.piecewise_runner is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_multi_token_graphs_match_eager(tmp_path, kv_dtype):
    """Decode graphs of query length 1 + k (verification steps of a scripted proposer that is
    right, then wrong) give the plain eager tokens; int4 also rolls back drafts written into
    the exact filling block's residual (kvserve/attention/kv_residual.py)."""
    from kvserve import LLM, SamplingParams
    from kvserve.spec_decode import Proposer, register_proposer

    _random_llama(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 9, 17, 40)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                  max_num_seqs=8, kv_cache_memory="64MiB", disable_log_stats=True, kv_cache_dtype=kv_dtype)
    ref = [o.outputs[0].token_ids for o in LLM(enforce_eager=True, **common).generate(prompts, sp, use_tqdm=False)]
    script = {tuple(p): r for p, r in zip(prompts, ref)}

    class Scripted(Proposer):
        def propose(self, requests, batch):
            out = []
            for st in requests:
                n = len(st.output_token_ids)
                d = list(script[tuple(st.prompt_token_ids)][n:n + self.num_speculative_tokens])
                if len(d) >= 2 and n % 2:
                    d[1] = (d[1] + 1) % 512
                out.append(d)
            return out

    register_proposer(f"scripted_gpu_{kv_dtype}", Scripted)
    llm = LLM(enforce_eager=False, speculative_config={"method": f"scripted_gpu_{kv_dtype}", "num_speculative_tokens": 3},
              **common)
    gr = llm.llm_engine.engine_core.model_runner.graph_runner
    assert gr is not None and any(q == 4 for (_, q, _) in gr.graphs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    assert llm.llm_engine.engine_core.scheduler.num_accepted_tokens > 0


@pytest.mark.gpu
def test_residual_growth_recaptures_decode_graphs(tmp_path):
    """int4's exact filling blocks (kv_residual) grow with the input batch mid-generation: the
    decode graphs, which hold the residuals' addresses, are captured again and give the tokens
    of an engine that never grew."""
    from kvserve import LLM, SamplingParams

    _random_llama(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 18, 33)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=512, max_num_seqs=4,
              kv_cache_memory="64MiB", disable_log_stats=True, kv_cache_dtype="int4")
    ref = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(**kw)
    runner = llm.llm_engine.engine_core.model_runner
    first = runner.graph_runner
    res = runner.attn_builder.residual
    orig, calls = runner.attn_builder.prepare, []

    def grow_on_step_6(sched, inp):
        calls.append(1)
        if len(calls) == 6:
            res.grow(9)
        return orig(sched, inp)

    runner.attn_builder.prepare = grow_on_step_6
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert res.num_slots == 9 and runner.graph_runner is not first
    assert got == ref
