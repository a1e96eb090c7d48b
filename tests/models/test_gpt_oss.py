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
    longer = [p + r[:5] for p, r in zip(prompts, ref)]  # cached prompt blocks, then new tokens
    outs = llm.generate(longer, sp, use_tqdm=False)
    assert any(o.num_cached_tokens for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf, longer, n)
    model = llm.llm_engine.engine_core.model_runner.model
    assert [a.sliding_window for a in attention_layers(model)] == [WINDOW, None]
