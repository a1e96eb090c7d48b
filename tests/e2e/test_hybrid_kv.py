"""Sliding-window models on the hybrid KV cache manager: random tiny Mistral (every layer
windowed) and Qwen2 (``max_window_layers``: full and window layers mixed) configs with an
8-token window and 4-token blocks equal transformers (float32 greedy), batched and chunked;
window groups hold at most ``ceil(window / block_size) + 1`` blocks per request after every
step; prefix hits give the outputs of a run without caching; every block is free at the end.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.kv_cache_spec import SlidingWindowSpec

WINDOW, BS = 8, 4


def _config(kind: str):
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if kind == "mistral":
        from transformers import MistralConfig

        return MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, architectures=["MistralForCausalLM"],
                             **common)
    from transformers import Qwen2Config

    # Layers 0-1 full attention, 2-3 windowed (Qwen2 windows layers from max_window_layers on).
    return Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                       architectures=["Qwen2ForCausalLM"], **common)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model_dir(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32,
                                             attn_implementation="eager")
    with torch.no_grad():  # larger weights than the default init: no near-ties in greedy choices
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    return request.param, str(d), model.eval()


def _hf_greedy(model, prompts, n):
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _llm(path, **kw):
    args = dict(skip_tokenizer_init=True, dtype="float32", block_size=BS, max_num_batched_tokens=16,
                max_num_seqs=8, max_model_len=256, disable_log_stats=True)
    args.update(kw)
    return LLM(model=path, **args)


def _prompts(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lens]


def _run_checked(llm, prompts, params):
    """Generate step by step; after every step each running request holds at most
    ceil(window / block_size) + 1 blocks in every window group. Returns the CompletionOutputs."""
    eng = llm.llm_engine
    core = eng.engine_core
    kv = core.kv_cache_manager
    window_gids = [g.group_id for g in kv.window_groups]
    bound = -(-WINDOW // BS) + 1
    ids = [eng.add_request(None, p, params) for p in prompts]
    results, worst = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            results[out.request_id] = out.outputs[0]
        # With async scheduling the next step is already scheduled: its n tokens are on top.
        in_flight = core._in_flight[0].num_scheduled_tokens if core._in_flight is not None else {}
        for req in core.scheduler.running:
            live = kv.num_live_blocks(req.request_id)
            n = in_flight.get(req.request_id, 1)
            b = -(-(WINDOW + n - 1) // BS) + 1
            for gid in window_gids:
                worst = max(worst, live[gid])
                assert live[gid] <= b, (req.request_id, req.num_computed_tokens, n, live)
    for g in kv.groups:
        assert g.pool.get_num_free_blocks() == g.pool.num_usable_blocks
        g.pool.check_invariants()
    assert not window_gids or worst >= bound  # long requests reach it: blocks really are freed
    return [results[i] for i in ids]


_MAIN = "triton" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend,async_scheduling", [(_MAIN, False), ("torch_ref", False), (_MAIN, True)])
def test_window_models_equal_transformers_batched_and_chunked(model_dir, backend, async_scheduling):
    """Also with async scheduling (blocks freed after step N while step N+1 is scheduled)."""
    kind, path, hf = model_dir
    prompts = _prompts([1, 6, 9, 17, 30, 45])
    ref = _hf_greedy(hf, prompts, 20)
    llm = _llm(path, attention_backend=backend, kv_cache_memory="2MiB", async_scheduling=async_scheduling)
    kv_cfg = llm.llm_engine.engine_core.kv_cache_config
    windows = [g for g in kv_cfg.groups if isinstance(g.spec, SlidingWindowSpec)]
    assert [len(g.layer_indices) for g in windows] == ([2] if kind == "mistral" else [2])
    if kind == "qwen2":
        assert len(kv_cfg.groups) == 2 and windows[0].layer_indices == [2, 3]
    outs = _run_checked(llm, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    llm.shutdown()


def test_prefix_hits_equal_no_caching(model_dir):
    """A multi-turn chat (each turn's prompt is the last prompt, its answer and a short new
    message): hits on the hybrid cache reach up to the new message, and give the outputs
    (tokens and their logprobs) of a run without caching."""
    kind, path, _ = model_dir
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    messages = _prompts([10, 3, 2, 3, 1], seed=2)
    outs = {}
    for caching in (False, True):
        llm = _llm(path, enable_prefix_caching=caching, kv_cache_memory="2MiB")
        got, prompt, queried = [], [], 0
        for msg in messages:  # one turn after another: each can hit the previous turns' blocks
            prompt = prompt + msg
            got += _run_checked(llm, [prompt], params)
            queried += len(prompt)
            prompt = prompt + got[-1].token_ids
        outs[caching] = got
        hits = llm.llm_engine.engine_core.scheduler.prefix_cache_hits
        # Every later turn hits all full blocks of the previous prompt + answer.
        assert hits >= (queried - 10 - 4 * 4 * 2) if caching else hits == 0, (hits, queried)
        llm.shutdown()
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    # Logprobs too: a hit missing a block inside the window would read the null block.
    assert [o.cumulative_logprob for o in outs[True]] == pytest.approx([o.cumulative_logprob for o in outs[False]],
                                                                       abs=1e-4)


def test_hybrid_off_keeps_everything_and_agrees(model_dir):
    """--disable-hybrid-kv-cache-manager: one full-attention group, same tokens."""
    kind, path, hf = model_dir
    prompts = _prompts([23, 11], seed=3)
    llm = _llm(path, disable_hybrid_kv_cache_manager=True, kv_cache_memory="2MiB")
    assert not any(isinstance(g.spec, SlidingWindowSpec) for g in llm.llm_engine.engine_core.kv_cache_config.groups)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf, prompts, 10)
    llm.shutdown()
