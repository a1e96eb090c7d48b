"""Cascade attention end to end (the triton backend under the Triton interpreter): requests
sharing a cached system prompt decode through the cascade kernels, and their greedy outputs
equal those with cascade attention off and Hugging Face transformers' (tiny random Llama,
float32, 4-token blocks)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.triton import backend as triton_backend
from kvserve.attention.triton import cascade

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False, num_hidden_layers=2,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # larger weights than the default init: no near-ties in greedy choices
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    d = tmp_path_factory.mktemp("tiny_llama_cascade")
    model.save_pretrained(d)
    return str(d), model.eval()


def _greedy_hf(model, ids, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_shared_system_prompt_same_tokens_with_cascade_on_and_off(tiny, monkeypatch):
    path, hf = tiny
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 2 * BS)  # tiny prompts: 2 shared blocks qualify
    monkeypatch.setattr(cascade, "GRAPH_MIN_BATCH", 1)  # on CUDA: the small decode graphs plan too
    calls = []
    real = triton_backend.cascade_decode_attention

    def counted(*a, **kw):
        calls.append(kw.get("kv_format"))
        return real(*a, **kw)

    monkeypatch.setattr(triton_backend, "cascade_decode_attention", counted)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 256, (9,), generator=g).tolist()  # 2 full blocks + 1 token
    prompts = [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in (2, 5)]
    prompts.append(torch.randint(3, 256, (4,), generator=g).tolist())  # no shared prefix
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kw = dict(model=path, skip_tokenizer_init=True, dtype="float32", block_size=BS, max_num_seqs=8, max_model_len=48,
              disable_log_stats=True, kv_cache_memory="1MiB", attention_backend="triton", enable_prefix_caching=True)
    llm = LLM(enable_cascade_attention=True, **kw)
    builder = llm.llm_engine.engine_core.model_runner.attn_builder
    llm.generate([system + [7]], SamplingParams(temperature=0, max_tokens=1))  # the system prompt cached
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls  # the shared requests' decode steps went through cascade
    n = len(calls)
    builder.cascade_per_item = {}  # the same engine (and cached blocks) without cascade
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len(calls) == n
    llm.shutdown()
    assert on == off
    assert on == [_greedy_hf(hf, p, 3) for p in prompts]
    llm = LLM(enable_cascade_attention=False, **kw)  # the flag: no plan
    assert llm.llm_engine.engine_core.model_runner.attn_builder.cascade_per_item == {}
    llm.shutdown()
