"""``EngineArgs.create_engine_config``. ``--dtype auto``: on the CPU bfloat16 where it has native
bf16, float32 elsewhere, with or without a quantization; an explicit dtype is kept. The detection
is forced with ``KVSERVE_CPU_NATIVE_BF16`` (or by patching ``cpu_has_native_bf16``). The
resolved config: bounded KV and CPU threads resolved once, frozen component configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.engine import arg_utils
from kvserve.engine.arg_utils import EngineArgs, cpu_has_native_bf16, resolve_auto_dtype


def _dtype(**kw) -> str:
    return EngineArgs(device="cpu", **kw).create_engine_config().model_config.dtype


@pytest.mark.parametrize("native,want", [("1", "bfloat16"), ("0", "float32")])
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_cpu_auto_follows_native_bf16_with_or_without_quantization(monkeypatch, native, want, quantization):
    monkeypatch.setenv("KVSERVE_CPU_NATIVE_BF16", native)
    assert _dtype(quantization=quantization) == want  # the default model (a Q4_1 GGUF)


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("explicit", ["float32", "bfloat16"])
def test_explicit_dtype_is_kept(monkeypatch, native, explicit):
    monkeypatch.setenv("KVSERVE_CPU_NATIVE_BF16", native)
    assert _dtype(dtype=explicit) == explicit
    assert _dtype(dtype=explicit, quantization="gguf") == explicit


@pytest.mark.parametrize("detected,want", [(True, "bfloat16"), (False, "float32")])
def test_auto_reads_the_detection(monkeypatch, detected, want):
    monkeypatch.delenv("KVSERVE_CPU_NATIVE_BF16", raising=False)
    monkeypatch.setattr(arg_utils, "cpu_has_native_bf16", lambda: detected)
    assert resolve_auto_dtype("cpu") == want
    assert _dtype() == want


def test_env_override_and_cpuinfo(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_NATIVE_BF16", "1")
    assert cpu_has_native_bf16() is True
    monkeypatch.setenv("KVSERVE_CPU_NATIVE_BF16", "0")
    assert cpu_has_native_bf16() is False
    monkeypatch.setenv("KVSERVE_CPU_NATIVE_BF16", "yes")
    with pytest.raises(ValueError, match="KVSERVE_CPU_NATIVE_BF16 must be 0 or 1"):
        cpu_has_native_bf16()
    monkeypatch.delenv("KVSERVE_CPU_NATIVE_BF16")
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        flags = ""
    assert cpu_has_native_bf16() == (" avx512_bf16" in flags or " amx_bf16" in flags)


def test_gpu_auto_is_the_checkpoint_16_bit_type():
    cfg = lambda dt: SimpleNamespace(dtype=dt)  # noqa: E731
    assert resolve_auto_dtype("cuda", cfg("float16")) == "float16"
    assert resolve_auto_dtype("cuda", cfg("torch.float16")) == "float16"
    assert resolve_auto_dtype("cuda", cfg("bfloat16")) == "bfloat16"
    assert resolve_auto_dtype("cuda", cfg("float32")) == "bfloat16"
    assert resolve_auto_dtype("cuda", SimpleNamespace()) == "bfloat16"
    assert resolve_auto_dtype("cuda") == "bfloat16"


def test_resolved_config_is_frozen_where_nothing_plans_it_later(monkeypatch):
    """One resolution: bounded KV and CPU threads come resolved; the component configs that the
    engine core does not plan further at start-up (parallel, attention, device, observability,
    speculative) cannot be changed afterwards."""
    import dataclasses

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cfg = EngineArgs(device="cpu", dtype="float32", max_attention_window=64).create_engine_config()
    cc = cfg.cache_config
    assert (cc.kv_eviction_policy, cc.attention_sinks, cc.max_attention_window, cc.kv_budget_tokens) == \
        ("streaming", 4, 64, 68)
    assert cfg.device_config.cpu_threads == 3
    for sub in (cfg.parallel_config, cfg.attention_config, cfg.device_config, cfg.observability_config):
        with pytest.raises(dataclasses.FrozenInstanceError):
            sub.__setattr__(dataclasses.fields(sub)[0].name, None)
    from kvserve.config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_speculative_tokens = 3
