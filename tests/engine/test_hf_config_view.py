"""The HF config a spawned process receives: every value the transformers config gives, without
transformers' import (kvserve.utils.hf_config_view)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest


def _public_values(cfg) -> dict:
    return {n: getattr(cfg, n) for n in dir(cfg)
            if not n.startswith("_") and not callable(getattr(cfg, n, None))}


def test_model_config_pickles_a_view_with_the_same_values(tmp_path):
    from transformers import Gemma3Config, LlamaConfig

    from kvserve.config import ModelConfig, SpeculativeConfig
    from kvserve.utils.hf_config_view import HFConfigView

    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    gemma = Gemma3Config(text_config={"hidden_size": 64, "num_hidden_layers": 2, "sliding_window": 32})
    mc = ModelConfig(model="x")
    mc.hf_config = llama
    sc = SpeculativeConfig(method="ngram")
    object.__setattr__(sc, "draft_hf_config", gemma)
    path = tmp_path / "cfg.pkl"
    path.write_bytes(pickle.dumps((mc, sc)))
    mc2, sc2 = pickle.loads(path.read_bytes())
    assert mc.hf_config is llama  # the live config is left as it is
    view = mc2.hf_config
    assert isinstance(view, HFConfigView)
    want = {k: v for k, v in _public_values(llama).items() if type(v).__module__.split(".")[0] != "transformers"}
    got = {k: getattr(view, k, "MISSING") for k in want}
    assert got == want
    assert view.rope_scaling["rope_type"] == "llama3" and view.head_dim == 16
    # attribute_map aliases (not in dir()) come through too.
    from transformers import MixtralConfig

    mixtral = pickle.loads(pickle.dumps(ModelConfig(model="x", hf_config=MixtralConfig(num_local_experts=4))))
    assert mixtral.hf_config.num_experts == mixtral.hf_config.num_local_experts == 4
    # Nested configs are views too; their values come through.
    assert isinstance(sc2.draft_hf_config.text_config, HFConfigView)
    assert sc2.draft_hf_config.text_config.sliding_window == 32
    assert sc2.draft_hf_config.text_config.hidden_size == 64
    with pytest.raises(AttributeError):
        view.to_dict()  # methods do not travel
    # A fresh interpreter reads it without importing transformers.
    code = ("import pickle, sys; mc, sc = pickle.load(open(sys.argv[1], 'rb')); "
            "assert mc.hf_config.num_key_value_heads == 2; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_kv_fingerprint_is_the_same_from_the_config_and_its_view():
    """The prefix-cache / P2P model fingerprint of an engine core (view) equals an in-process
    engine's (live config), and RoPE scaling is part of it."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from kvserve.config import ModelConfig
    from kvserve.kv_connector.block_hash import model_fingerprint

    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    prints = []
    for rope_scaling in (None, scaled):
        mc = ModelConfig(model="x", hf_config=LlamaConfig(max_position_embeddings=131072, rope_scaling=rope_scaling))
        live = model_fingerprint(SimpleNamespace(model_config=mc))
        assert model_fingerprint(SimpleNamespace(model_config=pickle.loads(pickle.dumps(mc)))) == live
        prints.append(live)
    assert prints[0] != prints[1]
