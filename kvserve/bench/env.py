"""What a benchmark records about where it ran, and how it builds its engine."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any, Optional


def num_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def git_commit() -> Optional[str]:
    """``$KVSERVE_COMMIT`` if set (a copied tree may carry stale git metadata), else the
    kvserve checkout's ``git rev-parse HEAD``, else None."""
    if os.environ.get("KVSERVE_COMMIT"):
        return os.environ["KVSERVE_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def device_description(device: str) -> str:
    """The GPU's name, or the CPU model with its core count."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {name} ({num_cores()} cores)"


def make_llm(engine_args: dict[str, Any]):
    """Build the offline engine for a benchmark: ``kvserve.LLM(**engine_args)`` (tests replace it)."""
    from kvserve import LLM

    return LLM(**engine_args)
