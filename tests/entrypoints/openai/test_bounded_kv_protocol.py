"""The bounded-KV request extension (attention_sinks, max_attention_window) in the OpenAI
request models and the frontend validation against the engine's resolved cache config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvserve.config import CacheConfig
from kvserve.engine.input_processor import validate_request
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def test_fields_reach_sampling_params():
    sp = CompletionRequest(prompt="hi", max_tokens=3, attention_sinks=2, max_attention_window=64).to_sampling_params(16)
    assert (sp.attention_sinks, sp.max_attention_window) == (2, 64)
    sp = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_attention_window=32) \
        .to_sampling_params(16)
    assert (sp.attention_sinks, sp.max_attention_window) == (None, 32)


def test_bad_values_rejected():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="hi", attention_sinks=-1)
    with pytest.raises(ValueError, match="max_attention_window"):
        CompletionRequest(prompt="hi", max_attention_window=0).to_sampling_params(16)


def test_frontend_validation_against_engine_config():
    bounded = CacheConfig(kv_eviction_policy="streaming", attention_sinks=4, max_attention_window=128)
    ok = CompletionRequest(prompt="x", attention_sinks=4, max_attention_window=100).to_sampling_params(16)
    validate_request([1, 2], ok, 0, 100, 64, True, bounded)
    big = CompletionRequest(prompt="x", max_attention_window=129).to_sampling_params(16)
    with pytest.raises(ValueError, match="max_attention_window 129 > the engine's"):
        validate_request([1, 2], big, 0, 100, 64, True, bounded)
    with pytest.raises(ValueError, match="kv-eviction-policy"):
        validate_request([1, 2], ok, 0, 100, 64, True, CacheConfig())
