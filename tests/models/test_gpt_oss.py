"""gpt-oss on a tiny random config vs transformers (float32, CPU): the engine's greedy tokens
batched, chunked and from the prefix cache, over 8-token windows on alternating layers with
learned attention sinks and YaRN RoPE; MXFP4 dequantization; the checkpoint errors."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.layers.attention import attention_layers
from kvserve.model_loader.mxfp4 import FP4_VALUES, MXFP4_BLOCK, mxfp4_dequantize
from kvserve.models.gpt_oss import GptOssForCausalLM

WINDOW = 8
BLOCK = 4
VOCAB = 256


def _config(**kw) -> transformers.GptOssConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=WINDOW, max_position_embeddings=512, tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 64,
                                 "rope_theta": 150000.0},
                architectures=["GptOssForCausalLM"])
    base.update(kw)
    return transformers.GptOssConfig(**base)


def _hf_model(cfg, scale: float = 0.08):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager",
                                                          experts_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # randomize everything (norms and sinks too): no near-tie greedy choices
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.endswith("sinks") else scale)
                    + (1.0 if "layernorm" in name or name == "model.norm.weight" else 0.0))
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss_tiny")
    hf = _hf_model(_config())
    hf.save_pretrained(d)
    llm = LLM(model=str(d), skip_tokenizer_init=True, dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB",
              max_num_batched_tokens=16, max_num_seqs=8, disable_log_stats=True)
    return str(d), hf, llm


def _hf_greedy(model, prompts, n):
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def test_greedy_equals_transformers_batched_chunked_and_prefix_cached(gpt_oss):
    """Prompts of 3 to 37 tokens (most longer than the 8-token window), chunks of 16 tokens;
    the second pass shares the first pass's prompts as prefixes (prefix-cache hits)."""
    _, hf, llm = gpt_oss
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 21, 37)]
    n = 24
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ref = _hf_greedy(hf, prompts, n)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    # The prompts extended by 5 of their greedy tokens: cached blocks, then new tokens; greedy
    # continues where transformers' run did.
    longer = [p + r[:5] for p, r in zip(prompts, ref)]
    outs = llm.generate(longer, SamplingParams(temperature=0, max_tokens=n - 5, ignore_eos=True), use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) >= 9 * BLOCK
    assert [o.outputs[0].token_ids for o in outs] == [r[5:] for r in ref]
    model = llm.llm_engine.engine_core.model_runner.model
    assert [a.sliding_window for a in attention_layers(model)] == [WINDOW, None]


def _random_mxfp4(shape, gen):
    """Random codes and scales for a ``[..., rows, cols]`` weight: ``(blocks, scales, values)`` with
    the codes packed into bytes here (element 2j in the low nibble) and values built from the
    E2M1 table times ``2 ** (scale - 127)``."""
    *pre, cols = shape
    codes = torch.randint(0, 16, (*pre, cols // MXFP4_BLOCK, MXFP4_BLOCK), generator=gen)
    scales = torch.randint(120, 131, (*pre, cols // MXFP4_BLOCK), generator=gen).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    vals = torch.tensor(FP4_VALUES)[codes] * torch.pow(2.0, scales.double() - 127).float().unsqueeze(-1)
    return blocks, scales, vals.reshape(shape)


def test_mxfp4_dequantization_is_exact_and_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(4)
    blocks, scales, vals = _random_mxfp4((3, 8, 64), g)
    out = mxfp4_dequantize(blocks, scales)
    assert torch.equal(out, vals)
    assert torch.equal(mxfp4_dequantize(blocks, scales, torch.bfloat16).float(), vals)  # in range: exact
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), vals.transpose(1, 2))
    with pytest.raises(ValueError, match="do not pair up"):
        mxfp4_dequantize(blocks, scales[..., :1])


def _empty_model(cfg):
    with torch.device("meta"):
        m = GptOssForCausalLM(cfg, torch.float32)
    return m.to_empty(device="cpu")


def test_mxfp4_checkpoint_loads_like_its_dense_form(gpt_oss):
    """The published layout (``*_blocks`` / ``*_scales``) and transformers' dense conversion of the
    same bytes give the same expert weights; tensors may arrive in any order."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, hf, _ = gpt_oss
    cfg = hf.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(5)
    gu_b, gu_s, _ = _random_mxfp4((e, 2 * i, h), g)
    dn_b, dn_s, _ = _random_mxfp4((e, h, i), g)
    sd = {k: v for k, v in hf.state_dict().items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    dense, packed = dict(sd), dict(sd)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        dense[f"{p}.gate_up_proj"] = convert_moe_packed_tensors(gu_b, gu_s, dtype=torch.float32)
        dense[f"{p}.down_proj"] = convert_moe_packed_tensors(dn_b, dn_s, dtype=torch.float32)
        packed.update({f"{p}.gate_up_proj_scales": gu_s, f"{p}.down_proj_blocks": dn_b,
                       f"{p}.gate_up_proj_blocks": gu_b, f"{p}.down_proj_scales": dn_s})
    a, b = _empty_model(cfg), _empty_model(cfg)
    a.load_weights(dense.items())
    b.load_weights(packed.items())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    moe = a.model.layers[0].mlp.experts
    # gate rows are the even columns of transformers' [E, H, 2I], up rows the odd ones
    assert torch.equal(moe.w13[1, :i], dense["model.layers.0.mlp.experts.gate_up_proj"][1][:, ::2].t())
    assert torch.equal(moe.w13[1, i:], dense["model.layers.0.mlp.experts.gate_up_proj"][1][:, 1::2].t())
    missing = {k: v for k, v in packed.items() if not k.endswith("down_proj_scales")}
    with pytest.raises(ValueError, match="down_proj_scales"):
        _empty_model(cfg).load_weights(missing.items())


def test_bad_expert_tensors_and_configs_are_named(gpt_oss):
    _, hf, _ = gpt_oss
    cfg = hf.config
    sd = dict(hf.state_dict())
    name = "model.layers.1.mlp.experts.down_proj"
    sd[name] = sd[name].transpose(1, 2).contiguous()  # [E, H, I]: nn.Linear's orientation, not the checkpoint's
    with pytest.raises(ValueError, match=r"down_proj.*\(4, 64, 32\), expected \(4, 32, 64\)"):
        _empty_model(cfg).load_weights(sd.items())
    sd = dict(hf.state_dict())
    del sd["model.layers.0.self_attn.sinks"]
    with pytest.raises(ValueError, match="missing weights.*attn.sinks"):
        _empty_model(cfg).load_weights(sd.items())
    from kvserve.model_loader.compressed_tensors_quant import resolve_checkpoint_quantization

    mxfp4 = _config(quantization_config={"quant_method": "mxfp4"})  # the published checkpoints' config
    assert resolve_checkpoint_quantization(None, mxfp4, "safetensors") == (None, [])
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):  # another model with MXFP4: refused
        resolve_checkpoint_quantization(None, transformers.LlamaConfig(quantization_config={"quant_method": "mxfp4"}),
                                        "safetensors")
    with torch.device("meta"):
        with pytest.raises(ValueError, match="num_experts_per_tok 5"):
            GptOssForCausalLM(_config(num_experts_per_tok=5), torch.float32)
        with pytest.raises(ValueError, match="unsupported gpt-oss layer types"):
            GptOssForCausalLM(_config(layer_types=["sliding_attention", "chunked_attention"]), torch.float32)


def test_real_gpt_oss_20b_shape_builds_on_meta():
    """The gpt-oss-20b shape (the GPU benchmark's dummy-weight model) passes start-up validation."""
    from kvserve.models.registry import get_model_class, validate_model_config

    cfg = transformers.GptOssConfig(num_hidden_layers=24, hidden_size=2880, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                    intermediate_size=2880, sliding_window=128, vocab_size=201088,
                                    architectures=["GptOssForCausalLM"])
    assert get_model_class(cfg) is GptOssForCausalLM
    validate_model_config(cfg, 4096)
    with torch.device("meta"):
        m = GptOssForCausalLM(cfg, torch.bfloat16, max_model_len=4096)
    windows = [a.sliding_window for a in attention_layers(m)]
    assert windows == [128, None] * 12
    assert sum(p.numel() for p in m.parameters()) == pytest.approx(20.9e9, rel=0.01)
