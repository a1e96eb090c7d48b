"""RoPE scaling types against transformers' rope init functions (known answers), the rotary
cos/sin cache with attention factors, and the engine's --rope-scaling / --max-model-len rules."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.layers.rope_scaling import (
    ROPE_TYPES,
    apply_rope_overrides,
    layer_rope_dicts,
    rope_inv_freq,
    scaled_context_length,
)
from kvserve.layers.rotary import RotaryEmbedding

HEAD_DIM = 64
MAX_POS = 4096


def _hf_config(rope: dict, max_pos: int = MAX_POS) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=max_pos, rope_parameters=dict(rope))


def _hf(rope: dict, seq_len=None, max_pos: int = MAX_POS):
    cfg = _hf_config(rope, max_pos)
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, None, seq_len=seq_len), cfg


def _ramp(lo: float, hi: float) -> list[float]:
    return torch.linspace(lo, hi, HEAD_DIM // 2).tolist()


STATIC_CASES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 128},
    "yarn_untruncated_attn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "truncate": False,
                              "attention_factor": 1.25, "original_max_position_embeddings": 2048},
}


@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_static_types_match_transformers(case):
    rope = STATIC_CASES[case]
    (ref, ref_attn), _ = _hf(rope)
    inv, attn = rope_inv_freq(rope, HEAD_DIM, MAX_POS)
    assert inv.dtype == torch.float32 and inv.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn, rel=1e-12)
    if case.startswith("yarn") and "attention_factor" not in rope:
        assert attn > 1.0  # YaRN's temperature: 0.1 ln(s) + 1 (ratio of mscales)


@pytest.mark.parametrize("max_model_len", [1024, MAX_POS, 3 * MAX_POS, 8 * MAX_POS])
def test_dynamic_ntk_matches_transformers_at_the_engine_length(max_model_len):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    (ref, _), _ = _hf(rope, seq_len=max_model_len)
    inv, attn = rope_inv_freq(rope, HEAD_DIM, MAX_POS, max_model_len)
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    plain, _ = rope_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, HEAD_DIM, MAX_POS)
    # Within the native context dynamic NTK is the plain rope; beyond it the base grows.
    assert torch.equal(inv, plain) == (max_model_len <= MAX_POS)
    assert attn == 1.0


@pytest.mark.parametrize("max_model_len", [512, 1024, 1025, 4096])
def test_longrope_short_and_long_factors_match_transformers(max_model_len):
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _ramp(1.0, 1.5),
            "long_factor": _ramp(1.0, 30.0), "original_max_position_embeddings": 1024}
    (ref, ref_attn), _ = _hf(rope, seq_len=max_model_len)
    inv, attn = rope_inv_freq(rope, HEAD_DIM, MAX_POS, max_model_len)
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn)  # sqrt(1 + ln(4096/1024) / ln(1024))
    assert attn == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(1024.0)).item()) ** 0.5)


@pytest.mark.parametrize("case", ["yarn", "longrope", "dynamic", "linear"])
def test_rotary_cos_sin_equal_hf_rotary_embedding(case):
    """cos/sin caches (attention factor included) equal LlamaRotaryEmbedding's at every position."""
    rope = {
        "yarn": STATIC_CASES["yarn"], "linear": STATIC_CASES["linear"],
        "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _ramp(1.0, 2.0),
                     "long_factor": _ramp(1.0, 8.0), "original_max_position_embeddings": 1024},
    }[case]
    max_pos = 2048
    cfg = _hf_config(rope, max_pos)
    hf_rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(HEAD_DIM, max_pos, cfg.rope_parameters, max_model_len=max_pos)
    n = 1500 if case != "longrope" else max_pos  # longrope: transformers picks long factors past 1024
    pos = torch.arange(n)[None]
    cos, sin = hf_rot(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(ours.cos_cache[:n], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin_cache[:n], sin[0], rtol=1e-6, atol=1e-6)


def test_unsupported_and_incomplete_rope_types_raise():
    with pytest.raises(ValueError, match="unsupported rope_type 'ntk-by-parts'.*dynamic, yarn, longrope"):
        rope_inv_freq({"rope_type": "ntk-by-parts", "rope_theta": 1e4, "factor": 2.0}, HEAD_DIM, MAX_POS)
    with pytest.raises(ValueError, match="needs factor"):
        rope_inv_freq({"type": "dynamic", "rope_theta": 1e4}, HEAD_DIM, MAX_POS)
    with pytest.raises(ValueError, match="factor must be a number >= 1"):
        rope_inv_freq({"rope_type": "linear", "rope_theta": 1e4, "factor": 0.5}, HEAD_DIM, MAX_POS)
    with pytest.raises(ValueError, match="short_factor has 3 entries"):
        rope_inv_freq({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3,
                       "long_factor": [1.0] * 32}, HEAD_DIM, MAX_POS)
    with pytest.raises(ValueError, match="rope_theta must be a positive number"):
        rope_inv_freq({"rope_type": "default", "rope_theta": -1.0}, HEAD_DIM, MAX_POS)
    with pytest.raises(ValueError, match="unsupported rope_type"):
        RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "mrope", "rope_theta": 1e4})
    assert set(ROPE_TYPES) >= {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}


def test_overrides_and_scaled_lengths():
    cfg = _hf_config({"rope_type": "default", "rope_theta": 10000.0}, max_pos=2048)
    apply_rope_overrides(cfg, {"type": "dynamic", "factor": 4.0}, None)
    assert layer_rope_dicts(cfg) == {"default": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}
    assert scaled_context_length(cfg.rope_parameters, 2048) == 8192
    apply_rope_overrides(cfg, None, 5e5)
    assert cfg.rope_parameters["rope_theta"] == 5e5 and cfg.rope_parameters["rope_type"] == "dynamic"
    apply_rope_overrides(cfg, {"rope_type": "yarn", "factor": 2.0}, None)
    assert cfg.rope_parameters["original_max_position_embeddings"] == 2048
    assert scaled_context_length(cfg.rope_parameters, 2048) == 4096
    # llama3 / longrope configs state the extended length themselves.
    assert scaled_context_length(STATIC_CASES["llama3"], 131072) == 131072
    # Gemma 3: the overrides go to the global layers only.
    g = transformers.Gemma3TextConfig(num_hidden_layers=6)
    apply_rope_overrides(g, {"rope_type": "linear", "factor": 8.0}, None)
    d = layer_rope_dicts(g)
    assert d["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert d["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="unsupported rope_type"):
        apply_rope_overrides(g, {"rope_type": "su"}, None)


# ---- engine flags (config resolution only: no weights are loaded) -----------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_rope")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=256,
                                   architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(d)
    return str(d)


def _engine_config(path, **kw):
    from kvserve.engine.arg_utils import EngineArgs

    return EngineArgs(model=path, load_format="dummy", skip_tokenizer_init=True, device="cpu", **kw) \
        .create_engine_config()


def test_rope_flags_resolve_context_length(tiny_dir, monkeypatch):
    monkeypatch.delenv("KVSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert _engine_config(tiny_dir).model_config.max_model_len == 256
    cfg = _engine_config(tiny_dir, rope_scaling=json.dumps({"rope_type": "dynamic", "factor": 4.0}))
    assert cfg.model_config.max_model_len == 1024  # factor x native when --max-model-len is not given
    assert cfg.model_config.rope_scaling == {"rope_type": "dynamic", "factor": 4.0}
    assert cfg.model_config.hf_config.rope_parameters["rope_type"] == "dynamic"
    cfg = _engine_config(tiny_dir, rope_scaling='{"type": "yarn", "factor": 2.0}', rope_theta=20000.0,
                         max_model_len=400)
    assert cfg.model_config.max_model_len == 400
    assert cfg.model_config.hf_config.rope_parameters["rope_theta"] == 20000.0
    with pytest.raises(ValueError, match="longer than the model's context.*--rope-scaling"):
        _engine_config(tiny_dir, max_model_len=1000)
    monkeypatch.setenv("KVSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert _engine_config(tiny_dir, max_model_len=1000).model_config.max_model_len == 1000
    with pytest.raises(ValueError, match="--rope-scaling.*unsupported rope_type 'foo'"):
        _engine_config(tiny_dir, rope_scaling='{"rope_type": "foo", "factor": 2}')
    with pytest.raises(ValueError, match="--rope-scaling must be a JSON object"):
        _engine_config(tiny_dir, rope_scaling="dynamic")
    with pytest.raises(ValueError, match="--rope-theta must be > 0"):
        _engine_config(tiny_dir, rope_theta=0.0)


def test_rope_flags_on_the_command_line():
    import argparse

    from kvserve.engine.arg_utils import EngineArgs

    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = p.parse_args(["--rope-scaling", '{"rope_type":"dynamic","factor":4.0}', "--rope-theta", "1e6"])
    args = EngineArgs.from_cli_args(ns)
    assert json.loads(args["rope_scaling"]) == {"rope_type": "dynamic", "factor": 4.0}
    assert args["rope_theta"] == 1e6
