"""DeepSeek-V2 (V2-Lite style: q_proj, softmax group-limited routing) and DeepSeek-V3 (query
LoRA, YaRN with mscale, sigmoid noaux_tc routing with a random score-correction bias) on tiny
random configs saved by transformers: the engine's greedy tokens equal transformers' (float32)
batched, with chunked prefill, under preemption (a tiny KV pool) and with a prefix hit; the
cache holds the latent only; routing equals transformers' routers; KV features the latent
cannot serve are refused at start-up; FP8 block dequantization."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.layers.moe.routing import select_experts
from kvserve.models.deepseek_v2 import DeepseekV2ForCausalLM, dequantize_fp8_block, moe_routing

VOCAB, STEPS, BLOCK = 256, 24, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
              kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
              max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0)


def _v3_config() -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        **COMMON, q_lora_rank=48, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=2.5,
        num_mtp_layers=0, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 128, "mscale": 1.0,
                                           "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})


def _v2_config() -> transformers.DeepseekV2Config:
    return transformers.DeepseekV2Config(
        **COMMON, q_lora_rank=None, n_shared_experts=2, num_experts_per_tok=3, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def _hf_model(cfg, scale: float = 0.08):
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms near 1, everything else random
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def _hf_greedy(model, prompts):
    outs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend
    try:
        with torch.inference_mode():
            for ids in prompts:
                x = torch.tensor([ids])
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
                outs.append(y[0, len(ids):].tolist())
    finally:
        torch.set_num_threads(threads)
    return outs


def _prompts():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 9, 17, 30)]
    hit = prompts[4][:20] + torch.randint(3, VOCAB, (6,), generator=g).tolist()  # 5 shared blocks
    return prompts, hit


@pytest.fixture(scope="module", params=["v2", "v3"])
def deepseek(request, tmp_path_factory):
    """(llm, hf model, config, outputs of the batch, output of the prefix-hit prompt)."""
    cfg = _v2_config() if request.param == "v2" else _v3_config()
    hf = _hf_model(cfg)
    path = tmp_path_factory.mktemp(f"deepseek_{request.param}")
    hf.save_pretrained(path)
    # 23 usable blocks of 4 tokens for 5 requests of up to 54 tokens: preemption; 8-token chunks.
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
              num_gpu_blocks_override=24, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8,
              cpu_threads=1, disable_log_stats=True)
    prompts, hit = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    hit_out = llm.generate([hit], greedy, use_tqdm=False)[0]
    return llm, hf, cfg, outs, hit_out


def test_greedy_equals_transformers_batched_chunked_preempted_prefix_hit(deepseek):
    llm, hf, cfg, outs, hit_out = deepseek
    prompts, hit = _prompts()
    ref = _hf_greedy(hf, prompts + [hit])
    assert [o.outputs[0].token_ids for o in outs] == ref[:-1]
    assert llm.llm_engine.stats.num_preemptions > 0
    assert hit_out.num_cached_tokens >= 16  # the shared blocks came from the prefix cache
    assert hit_out.outputs[0].token_ids == ref[-1]
    runner = llm.llm_engine.engine_core.model_runner
    assert isinstance(runner.model, DeepseekV2ForCausalLM)
    assert type(runner.model).__name__ == cfg.architectures[0]
    pool = llm.llm_engine.engine_core.kv_cache_manager.pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_cache_holds_the_latent_only(deepseek):
    llm, _, cfg, _, _ = deepseek
    engine = llm.llm_engine.engine_core
    kv_cfg = engine.kv_cache_config
    want = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 4
    assert kv_cfg.bytes_per_token == want
    caches = engine.model_runner.kv_caches
    allocated = sum(c.numel() * c.element_size() for c in caches.values())
    assert allocated == want * kv_cfg.groups[0].num_blocks * BLOCK
    assert "mla_latent(32+8)" in kv_cfg.describe()


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_routing_equals_transformers_router(version):
    cfg = _v2_config() if version == "v2" else _v3_config()
    router_cls = (transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter if version == "v2"
                  else transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter)
    router = router_cls(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        bias = None
        if version == "v3":
            bias = torch.randn(cfg.n_routed_experts, generator=g) * 0.3
            router.e_score_correction_bias.copy_(bias)
    x = torch.randn(64, cfg.hidden_size, generator=g)
    _, ref_w, ref_ids = router(x)
    kw = moe_routing(cfg)
    kw.pop("use_correction_bias")
    w, ids = select_experts(x @ router.weight.T, cfg.num_experts_per_tok, e_score_correction_bias=bias, **kw)
    ref_sorted, order = ref_ids.sort(dim=-1)
    ours_sorted, ours_order = ids.long().sort(dim=-1)
    assert torch.equal(ours_sorted, ref_sorted)
    torch.testing.assert_close(w.gather(1, ours_order), ref_w.gather(1, order))


def test_refused_kv_features(deepseek):
    path = deepseek[0].llm_engine.config.model_config.model
    base = dict(model=path, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=24,
                max_model_len=64, cpu_threads=1, disable_log_stats=True)
    with pytest.raises(ValueError, match="latent"):
        LLM(**base, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="bounded KV"):
        LLM(**base, kv_eviction_policy="streaming", attention_sinks=4, max_attention_window=16)


def test_fp8_block_dequantization():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 130, generator=g)
    scale = torch.rand(2, 2, generator=g) + 0.5
    q = (w / scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130]).to(torch.float8_e4m3fn)
    out = dequantize_fp8_block(q, scale, torch.float32)
    torch.testing.assert_close(out, w, atol=0.1 * w.abs().max().item(), rtol=0.1)
    assert out[0, 0] == q[0, 0].float() * scale[0, 0] and out[199, 129] == q[199, 129].float() * scale[1, 1]
    with pytest.raises(ValueError, match="weight_scale_inv"):
        dequantize_fp8_block(q, scale[:1], torch.float32)


def test_fp8_latent_bytes_and_perplexity(deepseek):
    """fp8_e4m3 latent rows (e4m3 codes + one fp16 scale per token, padded to 16 bytes): the
    cache holds 48 bytes per token and layer here (40 values + 2 + padding; 592 for 576-value
    rows), and the perplexity of the model's own greedy continuations moves by < 4% (V3 here:
    +2.1%; e4m3 keeps 3 mantissa bits; docs/architecture.md states the bound)."""
    from kvserve.bench.accuracy import engine_nll

    llm, _, cfg, outs, _ = deepseek
    fp8 = LLM(model=llm.llm_engine.config.model_config.model, skip_tokenizer_init=True, dtype="float32",
              block_size=BLOCK, num_gpu_blocks_override=40, max_model_len=64, max_num_batched_tokens=8,
              kv_cache_dtype="fp8", cpu_threads=1, disable_log_stats=True)
    kv_cfg = fp8.llm_engine.engine_core.kv_cache_config
    assert kv_cfg.bytes_per_token == 48 * cfg.num_hidden_layers
    assert "mla_fp8_e4m3" in kv_cfg.describe()
    prompts, _ = _prompts()
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts[1:], outs[1:])]
    kinds = ["all"] * len(seqs)
    (n_ref, count), = engine_nll(llm, seqs, kinds).values()
    (n_fp8, _), = engine_nll(fp8, seqs, kinds).values()
    ratio = torch.exp(torch.tensor((n_fp8 - n_ref) / count)).item()
    assert abs(ratio - 1) < 0.04, ratio


def test_cpu_tier_holds_latent_blocks(deepseek):
    """The CPU KV tier copies latent pages like any others: with 29 device blocks the second
    pass over four ~30-token prompts is served from the tier, tokens unchanged."""
    llm, _, cfg, _, _ = deepseek
    if cfg.model_type != "deepseek_v3":
        pytest.skip("one model is enough: the tier only moves pages")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (30, 29, 31, 28)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    tier = LLM(model=llm.llm_engine.config.model_config.model, skip_tokenizer_init=True, dtype="float32",
               block_size=BLOCK, max_model_len=64, num_gpu_blocks_override=30, kv_offloading_size=0.01, cpu_threads=1,
               disable_log_stats=True)
    assert [o.outputs[0].token_ids for o in tier.generate(prompts, sp, use_tqdm=False)] == ref
    again = tier.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == ref
    assert all(o.num_cached_tokens >= 24 for o in again)


def test_pd_round_trip_of_latent_pages(deepseek):
    """P/D over TCP (P2PKVConnector): the handshake names the format (MLAAttentionSpec, one
    row per token), the consumer's latent pages equal the producer's bit for bit, it computes
    one prompt token, and its greedy tokens equal a colocated run's."""
    import json

    llm, _, cfg, _, _ = deepseek
    if cfg.model_type != "deepseek_v3":
        pytest.skip("one model is enough: the connector only moves pages")
    path = llm.llm_engine.config.model_config.model
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(37)]  # 38 tokens: 2 full blocks of 16 + 6

    def engine(role):
        ktc = {"kv_connector": "P2PKVConnector", "kv_role": role,
               "kv_connector_extra_config": {"kv_host": "127.0.0.1", "kv_port": 0}}
        return LLM(model=path, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=12, max_model_len=64,
                   dtype="float32", cpu_threads=1, disable_log_stats=True, kv_transfer_config=json.dumps(ktc))

    def pages(eng, ids):
        caches = eng.llm_engine.engine_core.model_runner.kv_caches
        idx = torch.tensor(ids, dtype=torch.long)
        return {layer: c.index_select(1, idx.to(c.device)).cpu() for layer, c in caches.items()}

    producer, consumer = engine("kv_producer"), engine("kv_consumer")
    try:
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        params = producer.generate([prompt], sp, use_tqdm=False)[0].kv_transfer_params
        group = params["kv_layout"]["groups"][0]
        assert group["kind"] == "MLAAttentionSpec" and group["page_shape"] == [1, 16, 1, 40]
        src = params["remote_block_ids"][0][:2]  # the two full blocks
        before = pages(producer, src)
        seen = {}
        conn = consumer.llm_engine.engine_core.kv_connector
        orig = conn.on_kv_connector_output

        def spy(kvo):
            for rid in kvo.finished_recving:
                ids = consumer.llm_engine.engine_core.kv_cache_manager.get_block_ids(rid)[0][:2]
                seen[rid] = pages(consumer, ids)
            orig(kvo)

        conn.on_kv_connector_output = spy
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": params})
        out = consumer.generate([prompt], sp, use_tqdm=False)[0]
        after = next(iter(seen.values()))
        assert all(torch.equal(before[layer], after[layer]) for layer in before)
        assert out.num_cached_tokens == len(prompt) - 1
        ref = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    finally:
        producer.shutdown()
        consumer.shutdown()
