"""Our Llama-family models vs HF transformers on tiny random configs (float32, CPU).

Each case: prefill two prompts through the paged KV cache (shuffled blocks), compare all
logits with HF, then decode one token per request from the cache and compare again.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.attention.forward_context import AttentionMetadata, forward_context
from kvserve.attention.registry import get_attn_backend
from kvserve.config import ModelConfig
from kvserve.layers.attention import bind_attention, bind_kv_cache
from kvserve.model_loader import get_model, load_hf_config

BLOCK = 4
NUM_BLOCKS = 16
COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
)

CASES = {
    "llama_gqa_llama3": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}),
    ),
    "qwen3_qknorm_tied": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    ),
    "qwen2_bias": (
        "Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "mistral_sliding": (
        "MistralConfig", "MistralForCausalLM",
        dict(num_key_value_heads=4, sliding_window=6, tie_word_embeddings=False),
    ),
}


def _hf_model(case: str) -> transformers.PreTrainedModel:
    cfg_cls, model_cls, extra = CASES[case]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF zeroes biases and sets norms to 1; randomize everything
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def _metadata(seq_lens, query_lens, block_tables, device="cpu") -> AttentionMetadata:
    slots, starts = [], [0]
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        for pos in range(s - q, s):
            slots.append(block_tables[i][pos // BLOCK] * BLOCK + pos % BLOCK)
        starts.append(starts[-1] + q)
    width = max(len(b) for b in block_tables)
    bt = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=bt,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        num_decodes=sum(1 for q in query_lens if q == 1),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_hf(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)
    cfg = load_hf_config(str(tmp_path), "safetensors")
    mc = ModelConfig(model=str(tmp_path), tokenizer=None, dtype="float32", load_format="safetensors",
                     max_model_len=256, seed=0, hf_config=cfg)
    ours = get_model(mc, "cpu")

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in (11, 7)]
    nxt = [torch.randint(0, 128, (1,), generator=g) for _ in prompts]
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = [torch.zeros(2, NUM_BLOCKS, BLOCK, hkv, d) for _ in range(cfg.num_hidden_layers)]
    bind_attention(ours, get_attn_backend("torch_ref"))
    bind_kv_cache(ours, dict(enumerate(kv)))
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [perm[:3], perm[3:5]]  # 12 and 8 token capacity: room for one decode each

    with torch.no_grad():
        ids = torch.cat(prompts)
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        meta = _metadata([11, 7], [11, 7], tables)
        with forward_context(meta):
            logits = ours.compute_logits(ours(ids, pos))
        assert logits.dtype == torch.float32 and logits.shape == (18, 128)
        ref = torch.cat([hf(p[None]).logits[0] for p in prompts])
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)

        meta = _metadata([12, 8], [1, 1], tables)
        with forward_context(meta):
            logits = ours.compute_logits(ours(torch.cat(nxt), torch.tensor([11, 7])))
        ref = torch.cat([hf(torch.cat([p, n])[None]).logits[0, -1:] for p, n in zip(prompts, nxt)])
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_load_weights_rejects_unknown_and_missing(tmp_path):
    from kvserve.models.llama import LlamaForCausalLM

    hf = _hf_model("llama_gqa_llama3")
    model = LlamaForCausalLM(hf.config, torch.float32)
    sd = hf.state_dict()
    with pytest.raises(ValueError, match="unknown weight"):
        model.load_weights(list(sd.items()) + [("model.layers.0.foo.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="missing"):
        model.load_weights([(k, v) for k, v in sd.items() if "k_proj" not in k])


def test_unsupported_architecture():
    from kvserve.models.registry import get_model_class

    cfg = transformers.GPT2Config()
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class(cfg)
