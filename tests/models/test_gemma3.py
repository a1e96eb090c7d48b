"""Gemma 3 on tiny random configs vs transformers (float32, CPU): paged prefill + decode,
the engine's greedy output batched and chunked with 8-token windows over 4-token blocks,
per-layer windows, GGUF naming, and the config errors."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.attention.forward_context import forward_context
from kvserve.attention.registry import get_attn_backend
from kvserve.config import ModelConfig
from kvserve.layers.attention import attention_layers, bind_attention, bind_kv_cache
from kvserve.model_loader import get_model, load_hf_config
from kvserve.models.gemma3 import Gemma3ForCausalLM
from test_model_vs_hf import BLOCK, NUM_BLOCKS, _metadata

WINDOW = 8


def _config(**kw) -> transformers.Gemma3TextConfig:
    base = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=WINDOW,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                query_pre_attn_scalar=24, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                bos_token_id=2, eos_token_id=1, pad_token_id=0, architectures=["Gemma3ForCausalLM"])
    base.update(kw)
    cfg = transformers.Gemma3TextConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def _hf_model(cfg, scale: float = 0.1) -> transformers.Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF zeroes the (zero-centred) norms; randomize everything
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3_tiny")
    hf = _hf_model(_config(), scale=0.25)  # larger weights: greedy choices are not near-ties
    hf.save_pretrained(d)
    return str(d), hf


def test_paged_prefill_and_decode_match_hf(gemma_dir, tmp_path):
    path, hf = gemma_dir
    cfg = load_hf_config(path, "safetensors")
    mc = ModelConfig(model=path, dtype="float32", load_format="safetensors", max_model_len=512, hf_config=cfg)
    ours = get_model(mc, "cpu")
    assert isinstance(ours, Gemma3ForCausalLM)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 160, (n,), generator=g) for n in (23, 10)]  # both longer than the window
    nxt = [torch.randint(0, 160, (1,), generator=g) for _ in prompts]
    kv = [torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 32) for _ in range(4)]
    bind_attention(ours, get_attn_backend("torch_ref"))
    bind_kv_cache(ours, dict(enumerate(kv)))
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [perm[:6], perm[6:9]]  # 24 and 12 token capacity: room for one decode each
    with torch.no_grad():
        ids = torch.cat(prompts)
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        with forward_context(_metadata([23, 10], [23, 10], tables)):
            logits = ours.compute_logits(ours(ids, pos))
        ref = torch.cat([hf(p[None]).logits[0] for p in prompts])
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        with forward_context(_metadata([24, 11], [1, 1], tables)):
            logits = ours.compute_logits(ours(torch.cat(nxt), torch.tensor([23, 10])))
        ref = torch.cat([hf(torch.cat([p, n])[None]).logits[0, -1:] for p, n in zip(prompts, nxt)])
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def _hf_greedy(model, prompts, n):
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("chunk", [64, 8])
def test_engine_greedy_equals_transformers_batched_and_chunked(gemma_dir, chunk):
    """Windows of 8 tokens over 4-token blocks; prompts from 1 to 45 tokens; with chunk=8 every
    prompt longer than 8 is prefilled in chunks that straddle the window."""
    path, hf = gemma_dir
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (1, 5, 8, 9, 17, 30, 45)]
    ref = _hf_greedy(hf, prompts, 12)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB",
              max_num_batched_tokens=chunk, max_num_seqs=8, disable_log_stats=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    # Every attention layer exposes its window (None for the global layer) for the KV cache spec.
    model = llm.llm_engine.engine_core.model_runner.model
    assert [a.sliding_window for a in attention_layers(model)] == [WINDOW, WINDOW, None, WINDOW]


def test_layer_windows_pattern_and_config_errors():
    with torch.device("meta"):
        m = Gemma3ForCausalLM(_config(layer_types=None, sliding_window_pattern=2), torch.float32)
    assert [a.sliding_window for a in attention_layers(m)] == [WINDOW, None, WINDOW, None]
    assert [a.scale for a in attention_layers(m)] == [24**-0.5] * 4  # query_pre_attn_scalar
    with torch.device("meta"):
        with pytest.raises(ValueError, match="sliding_window 1024 is larger than the model's context"):
            Gemma3ForCausalLM(_config(sliding_window=1024), torch.float32)
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            Gemma3ForCausalLM(_config(attn_logit_softcapping=50.0), torch.float32)
        with pytest.raises(ValueError, match="unsupported rope_type"):
            Gemma3ForCausalLM(_config(rope_parameters={
                "full_attention": {"rope_type": "su", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), torch.float32)


def test_window_larger_than_context_is_a_start_up_error(tmp_path):
    from kvserve.engine.arg_utils import EngineArgs

    _config(sliding_window=1024).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding_window 1024 is larger than the model's context"):
        EngineArgs(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                   device="cpu").create_engine_config()


def test_final_logit_softcapping_matches_hf():
    cfg = _config(final_logit_softcapping=3.0)
    hf = _hf_model(cfg)
    with torch.device("meta"):
        ours = Gemma3ForCausalLM(cfg, torch.float32)
    ours = ours.to_empty(device="cpu")
    ours.load_weights(hf.state_dict().items())
    h = torch.randn(5, 64)
    ref = hf.lm_head(h)
    ref = torch.tanh(ref / 3.0) * 3.0
    torch.testing.assert_close(ours.compute_logits(h), ref)
    assert ours.compute_logits(h).abs().max() <= 3.0


def test_gguf_gemma3_tensor_names():
    from kvserve.model_loader.gguf_loader import gguf_to_hf_name

    names = {
        "blk.3.attn_norm.weight": "model.layers.3.input_layernorm.weight",
        "blk.3.post_attention_norm.weight": "model.layers.3.post_attention_layernorm.weight",
        "blk.3.ffn_norm.weight": "model.layers.3.pre_feedforward_layernorm.weight",
        "blk.3.post_ffw_norm.weight": "model.layers.3.post_feedforward_layernorm.weight",
        "blk.3.attn_q_norm.weight": "model.layers.3.self_attn.q_norm.weight",
        "token_embd.weight": "model.embed_tokens.weight",
    }
    for gguf_name, hf_name in names.items():
        assert gguf_to_hf_name(gguf_name, "gemma3") == hf_name
    assert gguf_to_hf_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
