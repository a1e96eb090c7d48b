"""DeepSeek multi-token prediction (``"method": "deepseek_mtp"``) on tiny random DeepSeek-V3
checkpoints written by transformers, with the MTP layer (layer ``num_hidden_layers``: a
decoder block saved by transformers plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``)
added under its HF names: greedy outputs with k = 1 and k = 2 equal those without
speculation (batched, chunked prefill, preemption, prefix hit); the MTP layer's logits equal
a plain torch reference of the formula (transformers' decoder block) on the same weights, in
prefill and in decode; an MTP layer that predicts the target exactly has every greedy draft
accepted, and seeded sampling gives the tokens it gives without speculation; unseeded sampled
tokens have the distribution they have without speculation (chi-square); a checkpoint
without an MTP layer and tree drafts on the MLA target are refused at start-up."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.eagle import _EagleState

VOCAB, LAYERS, STEPS, BLOCK = 128, 2, 16, 4


def _config(num_layers: int) -> transformers.DeepseekV3Config:
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
        num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32, "beta_slow": 1})
    cfg._attn_implementation = "eager"
    return cfg


def _write_checkpoint(path, oracle: bool = False):
    """A target of LAYERS layers whose checkpoint also holds the MTP layer (index LAYERS).

    Returns transformers' model of LAYERS + 1 layers (its last layer: the MTP block) and the
    MTP-only tensors. ``oracle``: every block adds zero (o_proj, down_proj 0), so the target is
    a bigram model ``t -> f(t)`` and an MTP layer that reads only ``enorm(embed(t_{i+1}))``
    with the target's norm and head drafts ``f(t_{i+1}) = t_{i+2}`` exactly."""
    torch.manual_seed(0)
    big = transformers.AutoModelForCausalLM.from_config(_config(LAYERS + 1)).eval()
    g = torch.Generator().manual_seed(1)
    h = big.config.hidden_size
    with torch.no_grad():
        for name, p in big.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * 0.1)
            if oracle and ("o_proj" in name or "down_proj" in name):
                p.zero_()
        for name, b in big.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    big.save_pretrained(path)
    pre = f"model.layers.{LAYERS}."
    extra = {pre + "enorm.weight": 1 + torch.randn(h, generator=g) * 0.1,
             pre + "hnorm.weight": 1 + torch.randn(h, generator=g) * 0.1,
             pre + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.1,
             pre + "shared_head.norm.weight": 1 + torch.randn(h, generator=g) * 0.1,
             pre + "shared_head.head.weight": torch.randn(VOCAB, h, generator=g) * 0.1,
             pre + "embed_tokens.weight": big.model.embed_tokens.weight.detach().clone()}
    if oracle:
        extra[pre + "enorm.weight"] = torch.ones(h)
        extra[pre + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        extra[pre + "shared_head.norm.weight"] = big.model.norm.weight.detach().clone()
        extra[pre + "shared_head.head.weight"] = big.lm_head.weight.detach().clone()
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    tensors.update(extra)
    save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["num_hidden_layers"] = LAYERS  # the checkpoint's last layer is the MTP layer
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return big, extra


def _prompts():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 11, 21)]
    hit = prompts[3][:16] + torch.randint(3, VOCAB, (5,), generator=g).tolist()  # 4 shared blocks
    return prompts, hit


def _llm(path, k=None, **kw):
    spec = None if k is None else {"method": "deepseek_mtp", "num_speculative_tokens": k, "dynamic": False}
    # 12 usable blocks of 4 tokens for 4 requests of up to 37 tokens: preemption; 8-token chunks.
    args = dict(model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
                num_gpu_blocks_override=13, max_model_len=48, max_num_batched_tokens=8, max_num_seqs=8,
                cpu_threads=1, disable_log_stats=True, speculative_config=spec)
    args.update(kw)
    return LLM(**args)


def _run(llm):
    prompts, hit = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    hit_out = llm.generate([hit], sp, use_tqdm=False)[0]
    return outs + [hit_out.outputs[0].token_ids], hit_out.num_cached_tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3_mtp")
    big, extra = _write_checkpoint(str(path))
    return path, big, extra


@pytest.fixture(scope="module")
def reference(ckpt):
    return _run(_llm(ckpt[0]))[0]


@pytest.fixture(scope="module")
def mtp_k1(ckpt):
    return _llm(ckpt[0], k=1)


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_equals_no_speculation(ckpt, reference, mtp_k1, k):
    llm = mtp_k1 if k == 1 else _llm(ckpt[0], k=2)
    outs, cached = _run(llm)
    assert outs == reference
    eng = llm.llm_engine
    assert eng.stats.num_preemptions > 0 and cached >= 12
    st = eng.stats
    assert 0 < st.num_drafts <= st.num_draft_tokens <= k * st.num_drafts  # counters move (fewer near the end)
    assert st.num_accepted_tokens <= st.num_draft_tokens
    assert sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens and len(st.num_accepted_tokens_per_pos) == k
    proposer = eng.engine_core.model_runner.proposer
    spec = proposer.head.layers[0].self_attn.attn.kv_cache_spec(BLOCK, eng.engine_core.config)
    assert spec.type_name == "mla_latent(16+8)"  # the MTP layer caches the latent row
    assert eng.engine_core.kv_cache_manager.usage == 0.0
    held = sum(len(s.blocks) for s in proposer.states.values())
    assert len(proposer.free_blocks) + held == proposer.num_blocks - 1


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_logits_equal_torch_reference(ckpt, mtp_k1):
    """logits = head(norm(block(eh_proj(cat(enorm(emb(t)), hnorm(h)))))), the block being
    transformers' decoder layer with the MTP layer's weights and emb zero at position 0:
    prefill of T - 1 pairs, then one decode step (the absorbed-latent path) at the last position."""
    _, big, extra = ckpt
    proposer = mtp_k1.llm_engine.engine_core.model_runner.proposer
    head = proposer.head
    g = torch.Generator().manual_seed(7)
    T = 9
    ids = torch.randint(3, VOCAB, (T,), generator=g)
    hid = torch.randn(T, big.config.hidden_size, generator=g)
    st = _EagleState()
    st.base = 0  # the pairs start at the sequence's position 0: its embedding is zeroed
    assert proposer._ensure_blocks(st, T)
    try:
        with torch.inference_mode():
            f1 = proposer._forward([(0, st)], ids[:T - 1].numpy(), np.arange(T - 1), hid[:T - 1], [T - 1], [T - 1])
            f2 = proposer._forward([(0, st)], ids[T - 1:].numpy(), np.array([T - 1]), hid[T - 1:], [1], [T])
            got = head.compute_logits(torch.cat([f1, f2]))
    finally:
        proposer._reset(st)
    pre, eps = f"model.layers.{LAYERS}.", big.config.rms_norm_eps
    with torch.no_grad():
        emb = big.model.embed_tokens(ids)[None]
        emb[:, 0] = 0
        x = torch.cat([_rms(emb, extra[pre + "enorm.weight"], eps), _rms(hid[None], extra[pre + "hnorm.weight"], eps)],
                      dim=-1) @ extra[pre + "eh_proj.weight"].T
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = big.model.layers[LAYERS](x, attention_mask=mask, position_ids=pos,
                                       position_embeddings=big.model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        ref = _rms(out[0], extra[pre + "shared_head.norm.weight"], eps) @ extra[pre + "shared_head.head.weight"].T
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(head.greedy_tokens(torch.cat([f1, f2])), ref.argmax(-1))
    # the target loaded layers 0..L-1 and left layer L (the MTP layer's block) to the proposer
    target = mtp_k1.llm_engine.engine_core.model_runner.model
    assert len(target.model.layers) == LAYERS
    w = [big.model.layers[i].self_attn.kv_b_proj.weight for i in (LAYERS - 1, LAYERS)]
    assert torch.equal(target.model.layers[LAYERS - 1].self_attn.kv_b_proj.weight, w[0])
    assert torch.equal(head.layers[0].self_attn.kv_b_proj.weight, w[1])


@pytest.fixture(scope="module")
def oracle_ckpt(tmp_path_factory):
    """A checkpoint whose MTP layer predicts the (bigram) target's greedy token exactly."""
    path = tmp_path_factory.mktemp("deepseek_v3_mtp_oracle")
    _write_checkpoint(str(path), oracle=True)
    return path


def test_exact_mtp_layer_accepts_greedy_drafts_and_sampling_is_unchanged(oracle_ckpt):
    """Greedy: every draft of an MTP layer that predicts the target exactly is accepted.
    Sampled (temperature 0.7, seeded): the tokens equal those without speculation while drafts
    are both kept and rejected."""
    tmp_path = oracle_ckpt
    llm = _llm(tmp_path, k=2, num_gpu_blocks_override=64)
    prompts = _prompts()[0][1:]  # a 1-token prompt drafts from position 0, whose embedding is zeroed
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    st = llm.llm_engine.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.num_accepted_tokens_per_pos[0] == st.num_accepted_tokens_per_pos[1] > 0
    assert all(len(o.outputs[0].token_ids) == STEPS for o in outs)
    drafts, accepted = st.num_draft_tokens, st.num_accepted_tokens
    sampled = [SamplingParams(temperature=0.7, max_tokens=STEPS, ignore_eos=True, seed=s) for s in range(len(prompts))]
    plain = _llm(tmp_path, num_gpu_blocks_override=64).generate(prompts, sampled, use_tqdm=False)
    spec = llm.generate(prompts, sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    st = llm.llm_engine.stats
    assert 0 < st.num_accepted_tokens - accepted < st.num_draft_tokens - drafts


def test_sampled_distribution_matches_without_speculation(oracle_ckpt):
    """Unseeded sampling (temperature 0.05) of one prompt many times: the third output token
    (an accepted second draft, the target's sample at a rejected draft, or a later step's
    token) has the same distribution with MTP speculation (k = 2) as without, by a chi-square
    two-sample test; drafts are both kept and rejected. (Accepting a second draft without
    comparing it fails this test: p ~ 1e-7.)"""
    kw = dict(num_gpu_blocks_override=1024, max_num_batched_tokens=1024, max_num_seqs=256)
    prompt, N = _prompts()[0][1], 600
    sp = SamplingParams(temperature=0.05, max_tokens=4, ignore_eos=True)  # room for 2 drafts after the first token
    samples = {}
    for name, k in (("plain", None), ("spec", 2)):
        llm = _llm(oracle_ckpt, k=k, **kw)
        samples[name] = [o.outputs[0].token_ids[2] for o in llm.generate([prompt] * N, sp, use_tqdm=False)]
    st = llm.llm_engine.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    cells = sorted(set(samples["plain"]) | set(samples["spec"]))
    table = [[samples[n].count(c) for c in cells] for n in ("plain", "spec")]
    keep = [i for i in range(len(cells)) if table[0][i] + table[1][i] >= 10]  # expected counts >= 5
    rare = [i for i in range(len(cells)) if i not in keep]
    t = [[row[i] for i in keep] + [sum(row[i] for i in rare)] for row in table]
    assert len(keep) >= 4
    stats = pytest.importorskip("scipy.stats")
    _, pval, _, _ = stats.chi2_contingency(t)
    assert pval > 1e-3, (pval, t)


def test_checkpoint_without_mtp_layer_is_refused(tmp_path):
    torch.manual_seed(0)
    cfg = _config(LAYERS)
    cfg.num_nextn_predict_layers = 0
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        _llm(tmp_path, k=1)


def test_tree_drafts_refused_on_mla_target(ckpt):
    """The tree attention mask lives in the full-attention prefill kernel; MLA's latent paths
    attend causally, so ``speculative_eagle_topk > 1`` on a DeepSeek target is a start-up error."""
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "speculative_eagle_topk": 2}
    with pytest.raises(ValueError, match=r"speculative_eagle_topk 2 \(tree drafts\).*multi-head latent attention"):
        _llm(ckpt[0], speculative_config=spec)
