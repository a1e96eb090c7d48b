"""Speculation configured but off (dynamic speculation, k = 0): such a decode step replays the
plain engine's decode graph (same key, same attention metadata, no EAGLE-3 mid-layer states
kept), and greedy output crossing on -> off -> on equals no speculation's. Run through the
decode-graph runner's CPU stand-in (``CUDAGraphRunner(eager=True)``: the static buffers,
padding and graph keys of the CUDA path, the model run at replay)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.llama_eagle import save_random_eagle_head
from kvserve.worker.cuda_graphs import CUDAGraphRunner
from tests.utils import save_random_causal_lm


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    return save_random_causal_lm(tmp_path_factory.mktemp("spec_off_target"), cfg, std=0.3), cfg


COMMON = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB", disable_log_stats=True,
              async_scheduling=True, max_num_seqs=8, max_model_len=256)


def _stand_in(llm):
    """Replace the runner's (absent on the CPU) decode graphs with the CPU stand-in; returns it."""
    runner = llm.llm_engine.engine_core.model_runner
    sc = runner.config.scheduler_config
    widths = [-(-sc.max_model_len // runner.block_size)] * len(runner.kv_cache_config.groups)
    gr = CUDAGraphRunner(runner.model, runner.attn_builder, sc.max_num_seqs, widths, sc.max_model_len,
                         runner.device, runner.max_query_len_decode, eager=True)
    gr.capture()
    runner.graph_runner = gr
    return gr


def _host_meta(builder, key, inp):
    """The host ints of a replay's attention metadata (what picks kernels and grids)."""
    bs, q, _ = key
    seq = [int(c) + q for c in inp.ctx_lens] + [q] * (bs - len(inp.ctx_lens))
    m = builder.capture_metadata(bs, q, seq)[0]
    return m.query_lens_cpu, m.seq_lens_cpu, m.max_query_len, m.max_seq_len, m.num_decodes


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_k0_decode_step_is_the_plain_step_and_on_off_on_is_lossless(target, tmp_path, method):
    path, cfg = target
    save_random_eagle_head(str(tmp_path), cfg, eagle3=method == "eagle3", seed=4, std=0.2)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 64, (10,), generator=g).tolist() for _ in range(8)]
    # 8 requests, dynamic_max_batch 4: on for the first step, off while many run, on again as
    # the short ones finish (the band turns on at 3 running).
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6,) * 5 + (30,) * 3]
    plain = LLM(model=path, **COMMON)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sps, use_tqdm=False)]
    plain_gr = _stand_in(plain)
    plain_keys = []
    orig_plain = plain_gr.run

    def plain_run(inp, pending=None, aux=True):
        plain_keys.append(plain_gr.graph_key(inp, aux))
        return orig_plain(inp, pending, aux)

    plain_gr.run = plain_run
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, sps, use_tqdm=False)] == ref
    assert plain_keys and all(q == 1 and not a for _, q, a in plain_keys)  # the stand-in ran the decodes

    spec = LLM(model=path, **COMMON, speculative_config={"method": method, "model": str(tmp_path),
                                                         "num_speculative_tokens": 2, "dynamic_max_batch": 4})
    core = spec.llm_engine.engine_core
    runner, proposer = core.model_runner, core.model_runner.proposer
    inner = runner.model.model
    assert bool(inner.aux_hidden_state_layers) == (method == "eagle3")
    gr = _stand_in(spec)
    if method == "eagle3":  # q = 1 graphs with and without the states; verification graphs with them
        assert {(q, a) for _, q, a in gr.graphs} == {(1, True), (1, False), (2, True), (3, True)}
    else:
        assert {(q, a) for _, q, a in gr.graphs} == {(1, False), (2, False), (3, False)}
    steps = []  # (k, key, plain engine's key for the same inputs, metadata equal, states kept)
    orig = gr.run

    def run(inp, pending=None, aux=True):
        out = orig(inp, pending, aux)
        key = gr.last_key
        same_meta = key[1] == 1 and _host_meta(runner.attn_builder, key, inp) == \
            _host_meta(plain.llm_engine.engine_core.model_runner.attn_builder, plain_gr.graph_key(inp), inp)
        steps.append((proposer.k, key, plain_gr.graph_key(inp) if key[1] == 1 else None, same_meta,
                      bool(inner.aux_hidden_states)))
        return out

    gr.run = run
    all_ks = []  # every step's k (prefill steps run eagerly, decodes through the stand-in)
    orig_keep = runner._keep_aux_states

    def keep():
        on = orig_keep()
        all_ks.append(proposer.k)
        assert on == (method == "eagle3" and proposer.k > 0)  # EAGLE-3: kept exactly for the steps the head records
        return on

    runner._keep_aux_states = keep
    policy = core.scheduler.spec_policy
    real = policy.observe_step
    # The random head accepts nothing, so measured step times would keep speculation off;
    # scripted times (drafting pays) leave on / off to the batch band.
    policy.observe_step = lambda b, k, s: real(b, k, 0.5 if k else 1.0)
    out = spec.generate(prompts, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref  # lossless across on -> off -> on

    assert all_ks[0] > 0 and 0 in all_ks  # on, then off under load
    ks = [k for k, *_ in steps]
    # ... and on again as requests finish, through the decode graphs (the turn-on step keeps the states)
    assert 0 in ks and any(k > 0 for k in ks[ks.index(0):])
    for k, key, plain_key, same_meta, kept in steps:
        if k == 0:  # off: the plain engine's graph and metadata, nothing kept for the head
            assert key == plain_key and same_meta and not kept
        else:  # on: EAGLE-3 keeps the states the head drafts from
            assert kept == (method == "eagle3")
    assert spec.llm_engine.stats.num_draft_tokens > 0
    spec.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(proposer.free_blocks) + sum(len(s.blocks) for s in proposer.states.values()) == \
        proposer.num_blocks - 1
    assert core.kv_cache_manager.usage == 0.0


def test_model_forward_without_aux_states_is_the_same_forward(target):
    """``LlamaModel.keep_aux_hidden_states`` off: the same hidden states, none kept."""
    path, cfg = target
    llm = LLM(model=path, **COMMON)
    model = llm.llm_engine.engine_core.model_runner.model
    inner = model.model
    from kvserve.attention.metadata import AttentionMetadataBuilder
    from kvserve.attention.forward_context import forward_context
    import numpy as np

    metas, pos = AttentionMetadataBuilder.dummy(np.arange(1, 3, dtype=np.int32)[None, :], [12], 16,
                                                torch.device("cpu"))
    ids = torch.randint(3, 64, (12,), generator=torch.Generator().manual_seed(0))
    try:
        inner.aux_hidden_state_layers = (1, 3)
        with torch.inference_mode(), forward_context(metas):
            on = model(ids, pos)
        kept = dict(inner.aux_hidden_states)
        inner.keep_aux_hidden_states = False
        with torch.inference_mode(), forward_context(metas):
            off = model(ids, pos)
        assert set(kept) == {1, 3} and inner.aux_hidden_states == {}
        torch.testing.assert_close(on, off, rtol=0, atol=0)
    finally:
        inner.aux_hidden_state_layers, inner.keep_aux_hidden_states = (), True


def test_decode_step_kind_matches_the_per_request_rule():
    """``decode_step_kind``: its no-draft shortcut gives what the per-request rule gives."""
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.engine.engine_core import decode_step_kind

    def rule(sched):  # the definition: every request computes 1 + its drafts; k or 0 or None
        spec = sched.scheduled_spec_decode_tokens
        if any(n != 1 + len(spec.get(r, ())) for r, n in sched.num_scheduled_tokens.items()):
            return None
        if spec:
            return int(sched.num_speculative_tokens or max(len(d) for d in spec.values()))
        return 0 if sched.num_speculative_tokens == 0 else None

    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        s = SchedulerOutput()
        n = int(torch.randint(0, 5, (1,), generator=g))
        for i in range(n):
            d = int(torch.randint(0, 3, (1,), generator=g)) if torch.rand(1, generator=g) < 0.3 else 0
            extra = int(torch.rand(1, generator=g) < 0.15) * 7  # a prefill chunk
            s.num_scheduled_tokens[f"r{i}"] = 1 + d + extra
            if d:
                s.scheduled_spec_decode_tokens[f"r{i}"] = [5] * d
        s.num_speculative_tokens = [None, 0, 2][int(torch.randint(0, 3, (1,), generator=g))]
        assert decode_step_kind(s) == rule(s), s
