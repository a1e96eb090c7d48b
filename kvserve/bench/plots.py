"""PNG plots of a ``kvserve bench serve --sweep`` (matplotlib, Agg backend, imported lazily).

The x axis is the achieved request throughput (completed requests/s, "QPS"), so runs at
``--request-rate inf`` are placed where the server actually got.

Re-plot a saved sweep (the ``--save-result`` JSON), e.g. one made where matplotlib is
missing or one cut short::

    python -m kvserve.bench.plots results/serve.json results/plots [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional, Sequence


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def plot_sweep(runs: Sequence[dict[str, Any]], out_dir: str, title: str = "") -> list[str]:
    """Write ``ttft_vs_qps.png``, ``tpot_vs_qps.png`` and ``throughput_vs_qps.png`` into
    ``out_dir`` (created); returns their paths. Raises ImportError without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    pts = sorted(runs, key=lambda r: _num(r.get("request_throughput")))
    qps = [_num(r.get("request_throughput")) for r in pts]
    labels = [("inf" if math.isinf(_num(r.get("request_rate"))) else f"{_num(r.get('request_rate')):g}") for r in pts]

    def one(fname: str, ylabel: str, series: list[tuple[str, str]]) -> str:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for key, label in series:
            ax.plot(qps, [_num(r.get(key)) for r in pts], marker="o", label=label)
        for x, lab, r in zip(qps, labels, pts):
            ax.annotate(lab, (x, _num(r.get(series[0][0]))), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend()
        ax.set_title(title or fname[:-4].replace("_", " "))
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path)
        plt.close(fig)
        return path

    return [
        one("ttft_vs_qps.png", "TTFT (ms)", [("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")]),
        one("tpot_vs_qps.png", "TPOT (ms)", [("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99")]),
        one("throughput_vs_qps.png", "output tokens/s", [("output_throughput", "output tok/s")]),
    ]


def plot_result_file(path: str, out_dir: str, title: Optional[str] = None) -> list[str]:
    """Plot the runs of a ``kvserve bench serve --save-result`` JSON file into ``out_dir``."""
    with open(path) as fh:
        result = json.load(fh)
    runs = result.get("runs") or []
    if not runs:
        raise ValueError(f"{path}: no runs to plot")
    if title is None:
        cfg = result.get("config") or {}
        title = f"{cfg.get('model', '')} ({cfg.get('dataset', '')})" if cfg.get("model") else ""
    return plot_sweep(runs, out_dir, title)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.bench.plots",
                                description="PNG plots of a saved `kvserve bench serve` result (JSON).")
    p.add_argument("result", help="The JSON of --save-result.")
    p.add_argument("out_dir", help="Folder for the PNGs (created).")
    p.add_argument("--title", default=None, help="Plot title (default: model (dataset) from the JSON).")
    ns = p.parse_args(argv)
    try:
        paths = plot_result_file(ns.result, ns.out_dir, ns.title)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
