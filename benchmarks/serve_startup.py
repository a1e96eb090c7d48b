"""``kvserve serve`` start-up time: from the command to the first ``GET /health`` 200.

Starts the server (default model unless ``--model``; the CPU test suite's worker flags) again and
again, alternating the source trees given (``--tree``: a checkout imported through PYTHONPATH;
``.`` is this one), and reports per tree the median wall time to ready and the server's own
start-up line (engine core, model load, tokenizer). Each start is a fresh process tree.

    PYTHONPATH=. python3 benchmarks/serve_startup.py --tree /tmp/before --tree . --rounds 4 \\
        --out benchmarks/results/serving/serve_startup_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB"]
_CORE = re.compile(r"engine core ready .*start-up: model ([\d.]+) s")
_LINE = re.compile(r"start-up: tokenizer (?:([\d.]+) s|skipped)[^,]*, engine core ([\d.]+) s")


def free_port() -> int:
    from kvserve.utils.processes import free_port as fp

    return fp()


def start_once(tree: str, model: str | None, timeout: float = 300.0) -> dict:
    """One start of ``kvserve serve`` from ``tree``; its timings in seconds."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *FLAGS, "--port", str(port)]
    if model:
        cmd[4:4] = [model]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=env["PYTHONPATH"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # cwd: ``-m`` puts it first on sys.path
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(Path(log.name).read_text()[-2000:])
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            ready = time.monotonic() - t0
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        text = Path(log.name).read_text()
    core, line = _CORE.search(text), _LINE.search(text)
    return {"ready_s": round(ready, 2), "engine_core_s": float(line.group(2)) if line else None,
            "model_s": float(core.group(1)) if core else None,
            "tokenizer_s": float(line.group(1)) if line and line.group(1) else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="source tree (repeat to compare)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="directory for startup.json")
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {t: [] for t in a.tree}
    for r in range(a.rounds):
        for t in a.tree:
            runs[t].append(start_once(t, a.model))
            print(f"round {r} {t}: {runs[t][-1]}", flush=True)
    summary = {}
    for t, rs in runs.items():
        summary[t] = {k: statistics.median(x[k] for x in rs if x[k] is not None)
                      for k in ("ready_s", "engine_core_s", "model_s", "tokenizer_s") if any(x[k] for x in rs)}
        print(f"{t}: median {summary[t]}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        meta = {"cpu_count": os.cpu_count(), "flags": FLAGS, "model": a.model or "default", "rounds": a.rounds}
        with open(os.path.join(a.out, "startup.json"), "w") as f:
            json.dump({"meta": meta, "median": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
