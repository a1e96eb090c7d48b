"""Data parallelism behind one API server on two GPUs (``nvidia-h200-x2``): DP=2 vs DP=1, in one call.

The online-serving workload of ``benchmarks/gpu_serve_sweep.sh`` (Llama-3.1-8B shape, dummy
bf16 weights, no tokenizer, random prompts of 4..400 and outputs of 4..354 tokens, Poisson
arrivals) at a few request rates, each for ``--duration`` s of arrivals, against
``kvserve serve --data-parallel-size 1`` and then ``--data-parallel-size 2`` (the script is run
once per size, each with its share of ``--deadline``). Per rate and size: the sustained rate
(completed requests / wall time, drain included), output tokens/s, TTFT p50 / p99; and
DP=2 / DP=1 of the sustained rate (goal >= 1.8x where DP=1 is saturated).

Writes ``<out>/dp1/``, ``<out>/dp2/`` (each sweep's files) and ``<out>/dp.json``; prints a table.

Usage (repo root): python3 benchmarks/gpu_data_parallel.py --out DIR [--rates 64,96] [--duration 10]
    [--deadline 140] [--cpu-smoke]
``--cpu-smoke``: the tiny config on the CPU, 2 and 4 requests/s for 3 s (checks the plumbing).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_size(n: int, out: str, rates: str, duration: float, deadline: float, smoke: bool, port: int) -> dict:
    """One ``gpu_serve_sweep.sh`` run with ``--data-parallel-size n``; returns its JSON (or an error)."""
    d = os.path.join(out, f"dp{n}")
    os.makedirs(d, exist_ok=True)
    env = dict(os.environ, OUT=d, SWEEP_RATES=rates, SWEEP_DURATION=str(duration), SWEEP_MIN_PROMPTS="8",
               SWEEP_PORT=str(port), SWEEP_SKIP_WHEELS="1",
               SWEEP_DEADLINE_S=str(int(deadline + 25)),  # the sweep script keeps 30 s for its stop
               SWEEP_WARMUP_PROMPTS="4" if smoke else "32",
               SERVE_EXTRA_ARGS=f"--data-parallel-size {n} " + os.environ.get("SERVE_EXTRA_ARGS", ""))
    if smoke:
        env.update(SWEEP_CONFIG="tiny", SWEEP_INPUT_LEN="4:40", SWEEP_OUTPUT_LEN="4:16")
    t0 = time.time()
    p = subprocess.Popen(["bash", os.path.join(HERE, "gpu_serve_sweep.sh")], env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=deadline + 30)
    except subprocess.TimeoutExpired:  # the whole group: the script's trap stops its server, then SIGKILL
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        rc = 124
    path = os.path.join(d, "serve_sweep.json")
    res = {"data_parallel_size": n, "exit_status": rc, "wall_s": round(time.time() - t0, 1), "runs": []}
    if os.path.exists(path):
        with open(path) as f:
            sweep = json.load(f)
        res["env"] = sweep.get("env")
        for r in sweep.get("runs", []):
            res["runs"].append({k: r.get(k) for k in (
                "request_rate", "num_requests", "completed", "failed", "duration", "request_throughput",
                "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")})
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvserve-dp"))
    ap.add_argument("--rates", default="64,96", help="request rates (requests/s), comma-separated")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
    ap.add_argument("--sizes", default="1,2", help="data-parallel sizes, measured in this order")
    ap.add_argument("--deadline", type=float, default=140.0, help="seconds for all sizes together")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny config on the CPU (plumbing check)")
    a = ap.parse_args()
    if a.cpu_smoke:  # a busy CPU starts servers slowly: room for that
        a.rates, a.duration, a.deadline = "2,4", 3.0, max(a.deadline, 900.0)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    sizes = [int(s) for s in a.sizes.split(",")]
    results = []
    for k, n in enumerate(sizes):
        left = a.deadline - (time.time() - t0)
        share = max(left / (len(sizes) - k), 20.0)
        results.append(run_size(n, a.out, a.rates, a.duration, share, a.cpu_smoke, a.port + k))
    by = {r["data_parallel_size"]: {run["request_rate"]: run for run in r["runs"]} for r in results}
    rows = []
    for rate in sorted({rt for d in by.values() for rt in d}):
        row = {"request_rate": rate}
        for n in sizes:
            run = by.get(n, {}).get(rate)
            if run:
                row[f"dp{n}"] = run
        base, top = row.get(f"dp{sizes[0]}"), row.get(f"dp{sizes[-1]}")
        if base and top and base.get("request_throughput"):
            row["sustained_rate_ratio"] = round(top["request_throughput"] / base["request_throughput"], 3)
        rows.append(row)
    summary = {"bench": "data_parallel_serving", "cpu_smoke": a.cpu_smoke, "rates": a.rates, "duration_s": a.duration,
               "sizes": sizes, "results": results, "by_rate": rows, "goal": "sustained rate DP=2 >= 1.8x DP=1"}
    with open(os.path.join(a.out, "dp.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    fmt = lambda x: "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))  # noqa: E731
    print("| rate | DP | completed | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | DP ratio |")
    print("|--|--|--|--|--|--|--|--|")
    for row in rows:
        for n in sizes:
            run = row.get(f"dp{n}")
            if run:
                ratio = row.get("sustained_rate_ratio") if n == sizes[-1] else None
                print(f"| {row['request_rate']} | {n} | {run['completed']} | {fmt(run['request_throughput'])} | "
                      f"{fmt(run['output_throughput'])} | {fmt(run['median_ttft_ms'])} | {fmt(run['p99_ttft_ms'])} | "
                      f"{fmt(ratio)} |")
    ok = all(r["runs"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
