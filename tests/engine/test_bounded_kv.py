"""Bounded KV per request (``--kv-eviction-policy streaming|h2o``) end to end on a tiny random
Llama (float32, 4-token blocks): greedy outputs equal a plain-torch reference that attends to
exactly the kept keys with kvserve's in-cache positions (``tests/engine/bounded_ref.py``),
batched, with chunked prefill, past ``max_model_len`` and past the model's trained length;
block accounting after every step; no leak under preemption; start-up errors.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.kv_cache_spec import BoundedKVSpec
from tests.engine.bounded_ref import ref_logits, streaming_greedy

BS, SINKS, WINDOW = 4, 4, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False, num_hidden_layers=2,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # larger weights than the default init: no near-ties in greedy choices
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d)
    return str(d), model.eval()


def _llm(path, **kw):
    args = dict(skip_tokenizer_init=True, dtype="float32", block_size=BS, max_num_batched_tokens=16,
                max_num_seqs=8, max_model_len=48, disable_log_stats=True, kv_cache_memory="1MiB",
                kv_eviction_policy="streaming", attention_sinks=SINKS, max_attention_window=WINDOW)
    args.update(kw)
    return LLM(model=path, **args)


def _prompts(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lens]


def _run_checked(llm, prompts, params, bound=None):
    """Generate step by step; after every step each running request holds at most ``bound``
    blocks (default: sink blocks + ceil(window / bs) + 1, plus what the step's chunk spans).
    Every block is free at the end. Returns the token ids per prompt and the most blocks held."""
    eng = llm.llm_engine
    core = eng.engine_core
    kv = core.kv_cache_manager
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    results, worst = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            results[out.request_id] = out.outputs[0].token_ids
        in_flight = core._in_flight[0].num_scheduled_tokens if core._in_flight is not None else {}
        for req in core.scheduler.running:
            live = kv.num_live_blocks(req.request_id)[0]
            n = in_flight.get(req.request_id, 1)
            b = bound if bound is not None else -(-SINKS // BS) + -(-(WINDOW + n - 1) // BS) + 1
            worst = max(worst, live)
            assert live <= b, (req.request_id, req.num_computed_tokens, n, live)
    for g in kv.groups:
        assert g.pool.get_num_free_blocks() == g.pool.num_usable_blocks
        g.pool.check_invariants()
    return [results[i] for i in ids], worst


@pytest.mark.parametrize("backend,async_scheduling", [("cpu", False), ("torch_ref", False), ("cpu", True)])
def test_streaming_equals_reference_batched_chunked_past_max_model_len(tiny, backend, async_scheduling):
    """Prompts of 1..30 tokens (chunks of 16), 40 new tokens each: up to 70 tokens, past
    max_model_len=48 and the model's max_position_embeddings=64, with constant blocks."""
    path, hf = tiny
    prompts = _prompts([1, 6, 13, 30])
    llm = _llm(path, attention_backend=backend, async_scheduling=async_scheduling)
    spec = llm.llm_engine.engine_core.kv_cache_config.groups[0].spec
    assert isinstance(spec, BoundedKVSpec) and spec.policy == "streaming"
    got, worst = _run_checked(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert worst == -(-SINKS // BS) + -(-WINDOW // BS) + 1 or worst > 3  # blocks really are freed
    stats = llm.llm_engine.engine_core.scheduler.get_stats()
    assert stats.num_evicted_blocks > 0 and stats.num_evicted_tokens == BS * stats.num_evicted_blocks
    llm.shutdown()
    assert [len(g) for g in got] == [40] * 4
    ref = [streaming_greedy(hf, p, 40, SINKS, WINDOW, BS) for p in prompts]
    assert got == ref


def test_window_only_and_per_request_limits(tiny):
    """sinks=0 (window only) as an engine value, and per-request values below the engine's."""
    path, hf = tiny
    prompts = _prompts([9, 21], seed=2)
    llm = _llm(path, attention_sinks=SINKS)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, attention_sinks=0),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, attention_sinks=2,
                             max_attention_window=5)]
    got, _ = _run_checked(llm, prompts, params)
    with pytest.raises(ValueError, match="max_attention_window"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, max_attention_window=WINDOW + 1), use_tqdm=False)
    llm.shutdown()
    assert got[0] == streaming_greedy(hf, prompts[0], 30, 0, WINDOW, BS)
    assert got[1] == streaming_greedy(hf, prompts[1], 30, 2, 5, BS)


def test_no_leak_under_preemption(tiny):
    """A pool too small for all requests at once: preempted requests recompute (positions are
    a function of the token's position only, so the outputs are the reference's)."""
    path, hf = tiny
    prompts = _prompts([12, 17, 25, 7], seed=3)
    llm = _llm(path, num_gpu_blocks_override=16, kv_cache_memory=None)
    got, _ = _run_checked(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    llm.shutdown()
    assert got == [streaming_greedy(hf, p, 24, SINKS, WINDOW, BS) for p in prompts]


def test_long_generation_constant_blocks(tiny):
    """200 new tokens (4x max_model_len): the request's blocks stay bounded throughout."""
    path, _ = tiny
    llm = _llm(path)
    got, worst = _run_checked(llm, _prompts([5]), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert len(got[0]) == 200 and worst <= -(-SINKS // BS) + -(-WINDOW // BS) + 1
    # Without max_tokens the length limit stays max_model_len (vLLM's default).
    out = llm.generate(_prompts([5]), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 48 - 5
    llm.shutdown()


@pytest.mark.parametrize("kw,match", [
    (dict(kv_eviction_policy="streaming", max_attention_window=None), "max-attention-window"),
    (dict(attention_sinks=-1), "attention-sinks"),
    (dict(max_attention_window=0), "max-attention-window"),
    (dict(kv_budget_tokens=8), "kv-budget-tokens"),
    (dict(kv_eviction_policy="h2o", kv_budget_tokens=None), "kv-budget-tokens"),
    (dict(kv_eviction_policy="h2o", kv_budget_tokens=12, max_attention_window=8), "blocks"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
    (dict(kv_eviction_policy="none", max_attention_window=None), "attention-sinks"),
    (dict(kv_eviction_policy="lru"), "kv-eviction-policy"),
])
def test_start_up_errors(tiny, kw, match):
    with pytest.raises(ValueError, match=match):
        _llm(tiny[0], **kw)


def test_windowed_models_refused(tmp_path):
    from transformers import MistralConfig

    cfg = MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=1, sliding_window=8,
                        architectures=["MistralForCausalLM"])
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding-window"):
        _llm(str(tmp_path), load_format="dummy")


def test_per_request_values_need_a_bounded_engine(tiny):
    llm = _llm(tiny[0], kv_eviction_policy="none", attention_sinks=None, max_attention_window=None)
    with pytest.raises(ValueError, match="kv-eviction-policy"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, attention_sinks=2), use_tqdm=False)
    llm.shutdown()


def test_reference_matches_transformers_without_eviction(tiny):
    """The reference itself: with a window covering everything it is plain causal attention."""
    path, hf = tiny
    ids = _prompts([20], seed=4)[0]
    T = len(ids)
    vis = torch.ones(T, T, dtype=torch.bool).tril()
    ours = ref_logits(hf, ids, vis, torch.zeros(T, dtype=torch.long), 0)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["cpu", "torch_ref"])
def test_h2o_equals_reference_over_the_kept_blocks(tiny, backend):
    """H2O (budget 6 blocks): the engine's greedy tokens equal a plain-torch forward whose row
    ``p`` attends to exactly the blocks the engine held when it computed ``p`` (recorded from
    the real scheduler's block tables each step), at original positions."""
    path, hf = tiny
    prompts = _prompts([30, 11], seed=5)
    llm = _llm(path, attention_backend=backend, kv_eviction_policy="h2o", kv_budget_tokens=24)
    core = llm.llm_engine.engine_core
    sched, kv = core.scheduler, core.kv_cache_manager
    trace: dict[str, list] = {}  # request id -> [(first position, count, block ids)] per step
    real = sched.schedule

    def schedule():  # observe (not replace) what each step reads
        out = real()
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            trace.setdefault(rid, []).append((req.num_computed_tokens - n, n, kv.get_block_ids(rid)[0]))
        return out

    sched.schedule = schedule
    got, worst = _run_checked(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                              bound=24 // BS + -(-16 // BS) + 1)
    assert kv.num_evicted_blocks > 0
    llm.shutdown()
    for rid, prompt, out in zip(sorted(trace, key=int), prompts, got):
        ids = prompt + out
        T = len(ids) - 1  # the last token was never fed back
        vis = torch.zeros(T, T, dtype=torch.bool)
        for start, n, table in trace[rid]:
            for p in range(start, start + n):
                keys = torch.arange(p + 1)
                live = torch.tensor([table[k // BS] != 0 for k in keys.tolist()])
                vis[p, : p + 1] = live
        logits = ref_logits(hf, ids[:T], vis, torch.zeros(T, dtype=torch.long), 0)
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == out


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_cache_streams(tiny, kv_dtype):
    """int8 / int4 (Hadamard-rotated) KV under StreamingLLM (stored keys are never rewritten, so
    any format serves; the attention itself is checked per format in
    tests/attention/test_bounded_attention.py, the rotated sink queries there too)."""
    path, hf = tiny
    llm = _llm(path, kv_cache_dtype=kv_dtype)
    got, _ = _run_checked(llm, _prompts([13]), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert len(got[0]) == 60 and llm.llm_engine.engine_core.scheduler.get_stats().num_evicted_blocks > 10
    llm.shutdown()


def test_prefix_hits_equal_reference_and_respect_limits(tiny):
    """A multi-turn chat (each turn's prompt = the last prompt + its answer + a new message):
    later turns hit the sink blocks and the window before the new message (the blocks between
    are null in the hit), and every answer equals the reference. A request with other
    per-request limits never shares those blocks (its KV differs)."""
    path, hf = tiny
    # Prompts must fit max_model_len: 128 is past the model's 64 positions, allowed because
    # streaming distances stay <= 4 + 8 + 4 (h2o's grow: refused, test_long_max_model_len).
    llm = _llm(path, max_model_len=128)
    sched = llm.llm_engine.engine_core.scheduler
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt, turns = [], []
    for msg in _prompts([30, 5, 7], seed=6):
        prompt = prompt + msg
        got, _ = _run_checked(llm, [prompt], sp)
        turns.append((prompt, got[0]))
        prompt = prompt + got[0]
    hits = sched.prefix_cache_hits
    assert hits >= 2 * 16  # turns 2 and 3 reuse their sink + window blocks at least
    other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, max_attention_window=5)
    got_other, _ = _run_checked(llm, [turns[-1][0]], other)
    assert sched.prefix_cache_hits == hits
    llm.shutdown()
    for p, out in turns:
        assert out == streaming_greedy(hf, p, 12, SINKS, WINDOW, BS)
    assert got_other[0] == streaming_greedy(hf, turns[-1][0], 12, SINKS, 5, BS)


def test_long_max_model_len_needs_bounded_distances(tiny, monkeypatch):
    """max_model_len past the rope's positions: allowed for streaming (its attention distances
    stay bounded), refused for h2o and for no policy (unless the env override)."""
    monkeypatch.delenv("KVSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    path, _ = tiny
    _llm(path, max_model_len=1000).shutdown()
    with pytest.raises(ValueError, match="longer than the model's context"):
        _llm(path, max_model_len=1000, kv_eviction_policy="h2o", kv_budget_tokens=24)
    with pytest.raises(ValueError, match="longer than the model's context"):
        _llm(path, max_model_len=1000, kv_eviction_policy="none", attention_sinks=None, max_attention_window=None)
    with pytest.raises(ValueError, match="longer than the model's context"):  # window 60: distances reach 72
        _llm(path, max_model_len=1000, max_attention_window=60)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_cuda_piecewise_graphs_equal_eager(tiny, policy):
    """On CUDA a bounded engine runs piecewise CUDA graphs (attention eager between the graphed
    pieces, decode steps too): the same greedy tokens as ``--enforce-eager`` (and, for
    streaming, as the plain-torch reference)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, hf = tiny
    prompts = _prompts([1, 6, 13, 30])
    kw = dict(kv_eviction_policy="h2o", kv_budget_tokens=24) if policy == "h2o" else {}
    bound = 24 // BS + -(-16 // BS) + 1 if policy == "h2o" else None
    outs = []
    for eager in (True, False):
        llm = _llm(path, enforce_eager=eager, attention_backend="triton", **kw)
        got, _ = _run_checked(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), bound)
        llm.shutdown()
        outs.append(got)
    assert outs[0] == outs[1]
    if policy == "streaming":
        assert outs[1] == [streaming_greedy(hf, p, 40, SINKS, WINDOW, BS) for p in prompts]


def test_per_request_limits_checked_once_in_the_frontend():
    """``check_request_limits`` (input processing) is the one check; below it
    ``request_limits`` only reads the request's values (capped at the engine's)."""
    from kvserve.config import CacheConfig
    from kvserve.core.bounded_kv import request_limits
    from kvserve.engine.input_processor import check_request_limits

    cc = CacheConfig(kv_eviction_policy="streaming", attention_sinks=4, max_attention_window=32)
    check_request_limits(SamplingParams(attention_sinks=2, max_attention_window=32), cc)
    with pytest.raises(ValueError, match="attention_sinks 5 > the engine's --attention-sinks 4"):
        check_request_limits(SamplingParams(attention_sinks=5), cc)
    with pytest.raises(ValueError, match="kv-eviction-policy"):
        check_request_limits(SamplingParams(max_attention_window=8), CacheConfig())
    check_request_limits(SamplingParams(), None)
    assert request_limits(SamplingParams(attention_sinks=2), 4, 32) == (2, 32)
    assert request_limits(SamplingParams(max_attention_window=8), 4, 32) == (4, 8)
    assert request_limits(SamplingParams(), 4, 32) == (4, 32)
