"""Figures, tables and JSON of ``kvserve bench serve`` / ``latency``.

Latencies are reported in milliseconds as mean, median (p50), p90 and p99 over the
successful requests; ITL is over every inter-chunk gap of every successful request.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from typing import Any, Iterable, Optional, Sequence

from kvserve.bench.serve_client import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default); nan if empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_ms(values_s: Iterable[float]) -> dict[str, float]:
    """``{"mean", "median", "p90", "p99"}`` in ms of values given in seconds (nan if empty)."""
    xs = [v * 1000.0 for v in values_s]
    mean = sum(xs) / len(xs) if xs else float("nan")
    return {"mean": mean, "median": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms). Raises ValueError."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {val!r} is not a number of ms") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[key] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A successful request whose TTFT/TPOT/E2EL (ms) are all <= the given SLOs.
    A one-token request has no TPOT and meets any TPOT SLO."""
    if not r.success:
        return False
    vals = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(vals[k] is None or vals[k] * 1000.0 <= ms for k, ms in slos.items())


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    slos: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """Aggregate figures of one run.

    Throughputs are per second of ``duration_s`` (the run's wall time): ``request_throughput``
    (successful requests/s), ``output_throughput`` (output tokens/s),
    ``total_token_throughput`` ((prompt + output) tokens/s) and ``goodput`` (requests/s
    meeting every SLO in ``slos``; None when no SLO is given).
    """
    ok = [r for r in results if r.success]
    n_out = sum(r.output_tokens for r in ok)
    n_in = sum(r.prompt_tokens for r in ok)
    dur = duration_s if duration_s > 0 else float("nan")
    m: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur, "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
        "goodput": None, "slos_ms": dict(slos or {}),
    }
    if slos:
        m["goodput"] = sum(meets_slos(r, slos) for r in results) / dur
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name in LATENCIES:
        for stat, v in summarize_ms(series[name]).items():
            m[f"{stat}_{name}_ms"] = v
    errors = [r.error for r in results if not r.success]
    m["errors"] = sorted(set(errors))[:5]
    return m


# --------------------------------------------------------------------------- tables

#: (metrics key, column header) of the Markdown table; one row per request rate.
TABLE_COLUMNS = (
    ("request_rate", "rate (req/s)"),
    ("completed", "ok"),
    ("failed", "failed"),
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("total_token_throughput", "total tok/s"),
    ("goodput", "goodput (req/s)"),
    ("mean_ttft_ms", "TTFT mean"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("p99_tpot_ms", "TPOT p99"),
    ("median_itl_ms", "ITL p50"),
    ("p99_itl_ms", "ITL p99"),
    ("median_e2el_ms", "E2EL p50"),
    ("p99_e2el_ms", "E2EL p99"),
)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if math.isnan(v):
            return "-"
        return f"{v:.2f}"
    return str(v)


def markdown_table(runs: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of runs (each a metrics dict with ``request_rate``); latencies in ms."""
    head = "| " + " | ".join(h for _, h in TABLE_COLUMNS) + " |"
    sep = "|" + "|".join("---:" for _ in TABLE_COLUMNS) + "|"
    rows = ["| " + " | ".join(_fmt(run.get(k)) for k, _ in TABLE_COLUMNS) + " |" for run in runs]
    return "\n".join([head, sep, *rows])


def summary_text(m: dict[str, Any]) -> str:
    """A few human-readable lines of one run."""
    lines = [
        f"rate {_fmt(float(m['request_rate']))} req/s: {m['completed']} ok, {m['failed']} failed in "
        f"{m['duration_s']:.2f} s; {m['request_throughput']:.2f} req/s, "
        f"{m['output_throughput']:.2f} out tok/s, {m['total_token_throughput']:.2f} total tok/s"
        + (f", goodput {m['goodput']:.2f} req/s" if m.get("goodput") is not None else ""),
    ]
    for name in LATENCIES:
        lines.append(f"  {name.upper():<5} ms: mean {_fmt(m[f'mean_{name}_ms'])}  p50 {_fmt(m[f'median_{name}_ms'])}"
                     f"  p90 {_fmt(m[f'p90_{name}_ms'])}  p99 {_fmt(m[f'p99_{name}_ms'])}")
    for e in m.get("errors") or []:
        lines.append(f"  error: {e}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- env / JSON

def env_info(extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Where the benchmark ran: ``device`` (this machine's GPU or CPU; for ``bench serve``
    that is the client's, the server's is not visible over the API), host, versions and the
    kvserve git commit (``$KVSERVE_COMMIT`` where git cannot tell); ``extra`` entries are
    added last (and win)."""
    from kvserve.bench.env import device_description, git_commit, num_cores

    versions = {"python": platform.python_version()}
    for mod in ("httpx", "torch", "transformers"):
        m = sys.modules.get(mod)
        if m is None and mod == "httpx":
            try:
                import httpx as m  # noqa: F811
            except ImportError:
                m = None
        if m is not None:
            versions[mod] = getattr(m, "__version__", "?")
    from importlib.metadata import version

    for dist in ("torch", "transformers", "triton", "kvserve"):  # installed versions, not imported here
        if dist in versions:
            continue
        try:
            versions[dist] = version(dist)
        except Exception:
            pass
    device = None
    if "torch" in sys.modules:  # kvserve's package import has loaded it already

        try:
            device = device_description("cuda" if sys.modules["torch"].cuda.is_available() else "cpu")
        except Exception:
            device = None
    env = {"device": device, "host": platform.node(), "platform": platform.platform(), "cpu_cores": num_cores(),
           "versions": versions, "git_commit": git_commit()}
    env.update(extra or {})
    return env


def _json_safe(obj: Any) -> Any:
    """inf/nan floats become the strings "inf"/"nan" (strict JSON has neither)."""
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: str, result: dict[str, Any]) -> None:
    """Write ``result`` as indented strict JSON, creating parent folders."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(_json_safe(result), fh, indent=2, default=str, allow_nan=False)
        fh.write("\n")
