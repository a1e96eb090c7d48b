"""EAGLE speculation: the published-layout loader (round trip, EAGLE-1 and EAGLE-3, .bin and
safetensors), size checks, a tiny random Llama target + tiny heads (proposal shapes, lossless
greedy output, rollback leaving no leaked head blocks), and on the real default model greedy
outputs identical to no speculation with a random head and with the shipped one."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.llama_eagle import load_eagle_head, save_random_eagle_head
from tests.utils import save_random_causal_lm

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "kvserve", "spec_decode", "data", "eagle-smollm2-135m")


def _tiny_cfg(**kw):
    from transformers import LlamaConfig

    args = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    args.update(kw)
    return LlamaConfig(**args)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    cfg = _tiny_cfg()
    return save_random_causal_lm(tmp_path_factory.mktemp("tiny_eagle_target"), cfg, std=0.3), cfg


@pytest.mark.parametrize("eagle3,fmt", [(False, "safetensors"), (False, "bin"), (True, "safetensors")])
def test_loader_round_trip_published_layout(tmp_path, eagle3, fmt):
    cfg = _tiny_cfg()
    t = save_random_eagle_head(str(tmp_path), cfg, eagle3=eagle3, draft_vocab_size=16, seed=1, fmt=fmt)
    head = load_eagle_head(str(tmp_path), cfg, torch.float32, "cpu", eagle3=eagle3)
    lay = "midlayer." if eagle3 else "layers.0."
    p = dict(head.named_parameters())
    q, k, v = (t[lay + f"self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(p["layers.0.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    g, u = t[lay + "mlp.gate_proj.weight"], t[lay + "mlp.up_proj.weight"]
    assert torch.equal(p["layers.0.mlp.gate_up_proj.weight"], torch.cat([g, u]))
    assert torch.equal(p["fc.weight"], t["fc.weight"])
    assert torch.equal(p["layers.0.mlp.down_proj.weight"], t[lay + "mlp.down_proj.weight"])
    if eagle3:
        assert p["fc.weight"].shape == (32, 96) and p["layers.0.self_attn.qkv_proj.weight"].shape[1] == 64
        assert torch.equal(head.d2t, t["d2t"]) and torch.equal(p["lm_head.weight"], t["lm_head.weight"])
        # draft index i -> target token i + d2t[i], exactly the tokens t2d marks
        assert torch.equal((torch.arange(16) + head.d2t).sort().values, t["t2d"].nonzero()[:, 0])
    else:
        assert p["fc.weight"].shape == (32, 64) and torch.equal(p["fc.bias"], t["fc.bias"])
    with pytest.raises(ValueError, match="EAGLE-3"):
        load_eagle_head(str(tmp_path), cfg, torch.float32, "cpu", eagle3=not eagle3)


def test_mismatched_sizes_refused(tmp_path):
    save_random_eagle_head(str(tmp_path), _tiny_cfg(hidden_size=48, head_dim=8))
    with pytest.raises(ValueError, match="hidden_size 48, the target has 32"):
        load_eagle_head(str(tmp_path), _tiny_cfg(), torch.float32, "cpu")
    save_random_eagle_head(str(tmp_path), _tiny_cfg(vocab_size=80))
    with pytest.raises(ValueError, match="vocab_size 80, the target has 64"):
        load_eagle_head(str(tmp_path), _tiny_cfg(), torch.float32, "cpu")


def test_mismatched_hidden_size_is_a_startup_error(tiny_target, tmp_path):
    path, _ = tiny_target
    save_random_eagle_head(str(tmp_path), _tiny_cfg(hidden_size=48, head_dim=8))
    with pytest.raises(ValueError, match="hidden_size 48"):
        LLM(model=path, skip_tokenizer_init=True, kv_cache_memory="16MiB", disable_log_stats=True,
            speculative_config={"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2})


@pytest.mark.parametrize("eagle3", [False, True])
def test_tiny_target_proposals_lossless_and_no_leaked_blocks(tiny_target, tmp_path, eagle3):
    """Batched greedy with chunked prefill: identical to no speculation; each proposal is k
    in-vocabulary tokens (EAGLE-1 with draft_vocab_size 16: ids < 16); after the requests
    finish (and a later step tells the worker), every head block is free again."""
    path, cfg = tiny_target
    save_random_eagle_head(str(tmp_path), cfg, eagle3=eagle3, draft_vocab_size=32, seed=2, std=0.2)
    common = dict(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True, max_num_batched_tokens=24)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    extra = {} if eagle3 else {"draft_vocab_size": 16}  # EAGLE-1: draft among ids < 16 only
    spec = LLM(**common, speculative_config={"method": "eagle3" if eagle3 else "eagle", "model": str(tmp_path),
                                             "num_speculative_tokens": 3, "dynamic": False, **extra})
    proposer = spec.llm_engine.engine_core.model_runner.proposer
    seen = []
    orig = proposer.propose

    def spy(requests, batch):
        out = orig(requests, batch)
        seen.extend(out)
        return out

    proposer.propose = spy
    outs = spec.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert seen and all(len(d) == 3 and all(0 <= t < (64 if eagle3 else 16) for t in d) for d in seen if d)
    assert sum(1 for d in seen if d) >= len(seen) - len(prompts)  # every request drafts after its prefill
    st = spec.llm_engine.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens <= st.num_draft_tokens
    spec.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    held = sum(len(s.blocks) for s in proposer.states.values())
    assert len(proposer.states) <= 1 and len(proposer.free_blocks) + held == proposer.num_blocks - 1
    spec.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(proposer.free_blocks) + sum(len(s.blocks) for s in proposer.states.values()) == \
        proposer.num_blocks - 1
    assert spec.llm_engine.engine_core.kv_cache_manager.usage == 0.0


def test_tiny_target_dynamic_off_then_on(tiny_target, tmp_path):
    """8 requests with dynamic_max_batch=4: speculation is off while many run (the head keeps
    no backlog), back on as they finish; outputs identical to no speculation."""
    path, cfg = tiny_target
    save_random_eagle_head(str(tmp_path), cfg, seed=3, std=0.2)
    common = dict(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 64, (10,), generator=g).tolist() for _ in range(8)]
    sps = [SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(8)]
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sps, use_tqdm=False)]
    spec = LLM(**common, speculative_config={"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2,
                                             "dynamic_max_batch": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sps, use_tqdm=False)] == ref
    assert spec.llm_engine.stats.num_draft_tokens > 0
    proposer = spec.llm_engine.engine_core.model_runner.proposer
    assert all(s.pend is None or len(s.pend) <= 1 for s in proposer.states.values())


def test_tiny_target_eagle3_dynamic_async_off_then_on(tiny_target, tmp_path):
    """EAGLE-3 with dynamic speculation keeps async scheduling: 8 requests with
    dynamic_max_batch=4 (on for the first step, off while many run, on again as they finish);
    while off the head records no hidden states; the engine reports step times to the policy;
    greedy outputs equal no speculation's and no head or target block leaks."""
    path, cfg = tiny_target
    save_random_eagle_head(str(tmp_path), cfg, eagle3=True, seed=4, std=0.2)
    common = dict(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True, async_scheduling=True)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 64, (10,), generator=g).tolist() for _ in range(8)]
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6,) * 5 + (30,) * 3]
    ref = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sps, use_tqdm=False)]
    spec = LLM(**common, speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2,
                                             "dynamic_max_batch": 4})
    core = spec.llm_engine.engine_core
    assert core.async_scheduling
    proposer = core.model_runner.proposer
    ks, orig = [], proposer.record_hidden_states

    def pend():
        return {r: (s.pend_start, None if s.pend is None else len(s.pend)) for r, s in proposer.states.items()}

    def spy(*a):
        before = pend()
        orig(*a)
        ks.append(proposer.k)
        if proposer.k == 0:  # off: nothing kept
            assert pend() == before

    proposer.record_hidden_states = spy
    orig_propose = proposer.propose

    def propose_spy(requests, batch):
        out = orig_propose(requests, batch)
        if proposer.k == 0:  # off: the head's blocks go back to its pool (it restarts later)
            assert all(not proposer.states[r.req_id].blocks for r in requests if r.req_id in proposer.states)
        return out

    proposer.propose = propose_spy
    # The random head accepts nothing, so measured step times would (rightly) keep speculation
    # off; the policy gets scripted times instead (drafting pays), the band decides on / off.
    policy, steps = core.scheduler.spec_policy, []
    real = policy.observe_step

    def scripted(batch_size, k, seconds):
        steps.append((batch_size, k))
        real(batch_size, k, 0.5 if k else 1.0)

    policy.observe_step = scripted
    out = spec.generate(prompts, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert ks and all(k > 0 for k in ks)  # the runner hands over states only while on
    assert spec.llm_engine.stats.num_draft_tokens > 0
    kinds = [k for _, k in steps]
    assert 0 in kinds and kinds[-1] > 0  # off under load, on again at the end (on at first: ks)
    spec.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(proposer.free_blocks) + sum(len(s.blocks) for s in proposer.states.values()) == \
        proposer.num_blocks - 1
    assert core.kv_cache_manager.usage == 0.0


@pytest.fixture(scope="module")
def chat_prompts(llm):
    tok = llm.get_tokenizer()
    qs = ["What are three good habits for staying healthy?", "Explain what a hash table is.",
          "Write a short poem about the sea.", "Why is the sky blue?"]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in qs]


def test_eagle_greedy_lossless_on_default_model(llm, chat_prompts, tmp_path):
    """A random EAGLE-3 head (nearly nothing accepted) and the shipped EAGLE-1 head (some accepted, some
    rejected; a random EAGLE-1 head when it is not there): batched greedy outputs identical to no
    speculation, with chunked prefill and prefix-cache hits."""
    sp = SamplingParams(temperature=0, max_tokens=24)
    ref = [o.outputs[0].token_ids for o in llm.generate(chat_prompts, sp, use_tqdm=False)]
    hf = llm.llm_engine.engine_core.model_runner.model.config
    heads = [("eagle3", str(tmp_path / "e3"))]
    save_random_eagle_head(heads[0][1], hf, eagle3=True, draft_vocab_size=4096, seed=0)
    if os.path.isdir(SHIPPED):
        heads.append(("eagle", SHIPPED))
    else:
        heads.append(("eagle", str(tmp_path / "e1")))
        save_random_eagle_head(heads[1][1], hf, seed=0)
    for method, path in heads:
        spec = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, disable_log_stats=True,
                   max_num_batched_tokens=48,
                   speculative_config={"method": method, "model": path, "num_speculative_tokens": 3,
                                       "dynamic": False})
        for _ in range(2):  # the second round hits the prefix cache
            outs = spec.generate(chat_prompts, sp, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == ref, (method, path)
        st = spec.llm_engine.stats
        assert st.num_draft_tokens > 0 and st.prefix_cache_hits > 0
        if path == SHIPPED:  # trained on other prompts: it accepts some (~20% on the held-out chat questions)
            assert st.num_accepted_tokens > 0
        spec.shutdown()
