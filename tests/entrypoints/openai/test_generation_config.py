"""``--generation-config``: the checkpoint's recommended sampling as request defaults (vLLM's meaning)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from kvserve.entrypoints.openai import protocol as P  # noqa: E402
from kvserve.entrypoints.openai.generation_config import (  # noqa: E402
    apply_generation_defaults,
    load_generation_defaults,
)


def test_auto_vllm_and_folder(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64}))
    assert load_generation_defaults("auto", str(model)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                            "max_tokens": 64}
    assert load_generation_defaults("vllm", str(model)) == {}
    assert load_generation_defaults("auto", str(tmp_path / "model.gguf")) == {}  # no file next to it
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert load_generation_defaults(str(other), str(model)) == {"repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="--generation-config"):
        load_generation_defaults(str(tmp_path), str(model))


def test_request_fields_win():
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    req = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=1.0)
    apply_generation_defaults(req, defaults)
    sp = req.to_sampling_params(16)
    assert sp.temperature == 1.0 and sp.top_k == 20
    req = P.CompletionRequest(prompt="hi")
    apply_generation_defaults(req, defaults)
    assert req.to_sampling_params(16).temperature == 0.6


def test_ready_and_startup_lines():
    from types import SimpleNamespace

    from kvserve.engine.stat_logger import startup_line
    from kvserve.entrypoints.openai.api_server import ready_line

    assert ready_line("m", "0.0.0.0", 8000) == "kvserve ready: serving m at http://0.0.0.0:8000/v1"
    assert ready_line("m", "::1", 80) == "kvserve ready: serving m at http://[::1]:80/v1"
    cfg = SimpleNamespace(model_config=SimpleNamespace(dtype="bfloat16", quantization="int8"),
                          cache_config=SimpleNamespace(kv_cache_dtype="fp8_e4m3"))
    line = startup_line(1.234, 15.0, cfg)
    assert line.startswith("start-up: tokenizer 1.23 s") and "engine core 15.00 s" in line
    assert "quantization int8" in line and "kv_cache_dtype fp8_e4m3" in line
