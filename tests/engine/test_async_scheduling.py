"""Async scheduling (step N+1 scheduled while step N runs) gives the same outputs as one step
at a time: greedy and seeded sampling, EOS and length stops, logprobs, penalties and
min_tokens (which fall back to one step at a time), n > 1, chunked prefill, preemption,
aborts. On the CPU nothing overlaps, but the bookkeeping (pending tokens, tokens read from
the previous step's device tensor, tokens dropped past a stop) is the same as on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    d = tmp_path_factory.mktemp("async")
    model.save_pretrained(d)
    return str(d)


def _prompts(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 70, (n,), generator=g)]


def _run(path, prompts, params, async_scheduling, **kw):
    args = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory="8MiB", max_model_len=256,
                disable_log_stats=True, max_num_batched_tokens=48)
    args.update(kw)
    llm = LLM(model=path, async_scheduling=async_scheduling, **args)
    assert llm.llm_engine.engine_core.async_scheduling is async_scheduling
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.engine_core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.pool.get_num_free_blocks() == core.config.cache_config.num_blocks - 1
    res = [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]
    return res, core.scheduler.num_preemptions


def _params(n):
    """A mix: greedy, seeded random with logprobs, EOS stops, penalties, min_tokens, n=2."""
    ps = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            ps.append(SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True))
        elif kind == 1:
            ps.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, logprobs=2, ignore_eos=True))
        elif kind == 2:
            ps.append(SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40))  # stops at EOS (id 2) or length
        elif kind == 3:
            ps.append(SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5,
                                     ignore_eos=True))
        elif kind == 4:
            ps.append(SamplingParams(temperature=1.0, seed=i, max_tokens=20, min_tokens=8, stop_token_ids=[5, 6]))
        else:
            ps.append(SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=9, ignore_eos=True))
    return ps


def test_async_matches_sync_on_a_mixed_batch(model_dir):
    prompts = _prompts(12)
    params = _params(12)
    sync, _ = _run(model_dir, prompts, params, False)
    asyn, _ = _run(model_dir, prompts, params, True)
    assert asyn == sync
    reasons = {c[1] for o in sync for c in o}
    assert reasons == {"length", "stop"}  # both stop paths were exercised


def test_async_matches_sync_under_preemption(model_dir):
    prompts = _prompts(10, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in prompts]
    kw = dict(kv_cache_memory=None, num_gpu_blocks_override=24, block_size=8, max_model_len=120)
    sync, pre_sync = _run(model_dir, prompts, params, False, **kw)
    asyn, pre_async = _run(model_dir, prompts, params, True, **kw)
    assert pre_sync > 0 and pre_async > 0
    assert asyn == sync


def test_async_abort_mid_flight_frees_everything(model_dir):
    llm = LLM(model=model_dir, async_scheduling=True, skip_tokenizer_init=True, dtype="float32",
              kv_cache_memory="8MiB", max_model_len=256, disable_log_stats=True)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [eng.add_request(None, p, sp) for p in _prompts(4, seed=5)]
    for _ in range(4):
        eng.step()
    assert eng.engine_core._in_flight is not None
    # Step N+1 was scheduled before step N's tokens reached the host.
    assert all(r.num_pending_tokens == 1 for r in eng.engine_core.scheduler.running)
    eng.abort_request(ids[0])
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            finished[o.request_id] = o
    assert set(finished) == set(ids[1:])
    assert all(len(o.outputs[0].token_ids) == 50 for o in finished.values())
    core = eng.engine_core
    assert core.kv_cache_manager.pool.get_num_free_blocks() == core.config.cache_config.num_blocks - 1
