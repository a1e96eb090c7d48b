"""``torch.profiler`` around engine steps, per worker: vLLM's ``LLM.start_profile()`` /
``stop_profile()`` with the trace directory from ``KVSERVE_TORCH_PROFILER_DIR``
(vLLM: ``VLLM_TORCH_PROFILER_DIR``).

Each rank writes ``rank{r}.pt.trace.json.gz`` (a Chrome / Perfetto trace) and
``rank{r}_kernels.txt`` (the operators and kernels sorted by device time) into the directory,
and ``stop`` returns a summary: the top kernels by device time (µs, calls) and the wall time
the profile covered (on the CPU: the operators by their own CPU time). Kernels launched inside CUDA graphs are recorded where CUPTI traces graph
launches (CUDA 12+).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

ENV = "KVSERVE_TORCH_PROFILER_DIR"


def profiler_dir() -> Optional[str]:
    """The trace directory, or None when profiling is off (``KVSERVE_TORCH_PROFILER_DIR`` unset)."""
    d = os.environ.get(ENV, "").strip()
    return os.path.abspath(os.path.expanduser(d)) if d else None


def _device_us(evt) -> float:
    # torch >= 2.4 names it device time; older builds cuda time; on the CPU the ops' own CPU time
    names = ("self_device_time_total", "self_cuda_time_total") if torch.cuda.is_available() else ("self_cpu_time_total",)
    for name in names:
        v = getattr(evt, name, None)
        if v is not None:
            return float(v)
    return 0.0


class WorkerProfiler:
    """Start/stop ``torch.profiler`` on one rank.

    Raises:
        RuntimeError: ``start`` without ``KVSERVE_TORCH_PROFILER_DIR``, ``start`` twice, or ``stop``
            without ``start``.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._prof = None
        self._t0 = 0.0

    def start(self) -> None:
        out = profiler_dir()
        if out is None:
            raise RuntimeError(f"profiling is off: set {ENV} to a directory before starting the engine")
        if self._prof is not None:
            raise RuntimeError("the profiler is already running")
        os.makedirs(out, exist_ok=True)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def stop(self, top: int = 40) -> dict:
        """Stop, write the trace and the table; returns ``{"rank", "wall_ms", "device_ms",
        "top": [{"name", "device_us", "calls"}]}`` (device time summed over kernels)."""
        if self._prof is None:
            raise RuntimeError("the profiler is not running")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        out = profiler_dir() or "."
        prof.export_chrome_trace(os.path.join(out, f"rank{self.rank}.pt.trace.json.gz"))
        avg = [e for e in prof.key_averages() if _device_us(e) > 0]
        avg.sort(key=_device_us, reverse=True)
        rows = [{"name": e.key[:160], "device_us": round(_device_us(e), 1), "calls": int(e.count)} for e in avg]
        with open(os.path.join(out, f"rank{self.rank}_kernels.txt"), "w") as f:
            f.write(f"# rank {self.rank}: {wall_ms:.1f} ms profiled\n# device_us calls name\n")
            for r in rows:
                f.write(f"{r['device_us']:12.1f} {r['calls']:7d} {r['name']}\n")
        return {"rank": self.rank, "wall_ms": round(wall_ms, 2),
                "device_ms": round(sum(r["device_us"] for r in rows) / 1e3, 3), "top": rows[:top]}
