"""``--dtype auto``: on the CPU bfloat16 where it has native bf16, float32
elsewhere, with or without a quantization; an explicit dtype is kept. The detection is forced
with ``KVSERVE_CPU_NATIVE_BF16`` (or by patching ``cpu_has_native_bf16``)."""

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
