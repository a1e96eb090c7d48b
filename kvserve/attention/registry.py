"""Attention backends by name: ``cpu``, ``torch_ref``, ``triton`` (imported on first use)."""

from __future__ import annotations

import importlib

from kvserve.attention.backend import AttentionBackend

#: name -> "module:Class"
ATTENTION_BACKENDS: dict[str, str] = {
    "cpu": "kvserve.attention.cpu_backend:CpuBackend",
    "torch_ref": "kvserve.attention.torch_ref:TorchRefBackend",
    "triton": "kvserve.attention.triton:TritonBackend",
}


def get_attn_backend(name: str) -> AttentionBackend:
    """A new instance of backend ``name``. Raises ValueError for unknown names."""
    path = ATTENTION_BACKENDS.get(name)
    if path is None:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}")
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)()
