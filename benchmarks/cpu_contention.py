"""CPU: decode tok/s (batch 1, default model) idle vs. with a busy competing process pinned
to one core, per OpenMP wait policy and --cpu-threads. Prints a table and writes JSON.

    OMP_NUM_THREADS= python benchmarks/cpu_contention.py --out contention.json

Each configuration runs in a fresh process (the wait policy is read when torch loads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
from kvserve import LLM, SamplingParams
llm = LLM(kv_cache_memory="64MiB", max_model_len=512, disable_log_stats=True, cpu_threads=int(sys.argv[1]))
sp = SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True)
llm.generate(["Warm up"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
open(sys.argv[3], "w").write("ready")
while not os.path.exists(sys.argv[3] + ".go"):
    time.sleep(0.05)
t = time.perf_counter()
out = llm.generate(["The history of the printing press"], sp, use_tqdm=False)
dt = time.perf_counter() - t
print(json.dumps({"tok_s": len(out[0].outputs[0].token_ids) / dt}))
"""


def run(policy: str, threads: int, busy: bool, tokens: int, tmp: str) -> float:
    env = dict(os.environ, OMP_WAIT_POLICY=policy, HF_HUB_OFFLINE="1")
    env.pop("OMP_NUM_THREADS", None)
    flag = os.path.join(tmp, f"ready-{policy}-{threads}-{busy}")
    for p in (flag, flag + ".go"):
        if os.path.exists(p):
            os.remove(p)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(threads), str(tokens), flag], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while not os.path.exists(flag):
        if child.poll() is not None:
            raise RuntimeError("benchmark child died")
        time.sleep(0.1)
    hog = None
    if busy:  # a competing busy process on core 0
        hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"])
        time.sleep(0.5)
    open(flag + ".go", "w").close()
    out, _ = child.communicate(timeout=900)
    if hog is not None:
        hog.kill()
        hog.wait()
    return json.loads(out.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="ACTIVE:2,PASSIVE:2,PASSIVE:1",
                    help="comma-separated POLICY:THREADS")
    a = ap.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in a.configs.split(","):
            policy, threads = cfg.split(":")
            idle = run(policy, int(threads), False, a.tokens, tmp)
            busy = run(policy, int(threads), True, a.tokens, tmp)
            rows.append({"omp_wait_policy": policy, "cpu_threads": int(threads), "idle_tok_s": idle,
                         "busy_tok_s": busy, "ratio": busy / idle})
            print(json.dumps(rows[-1]), flush=True)
    rec = {"cores": os.cpu_count(), "load_avg": os.getloadavg(), "tokens": a.tokens, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    print(f"{'policy':>8} {'threads':>7} {'idle tok/s':>10} {'busy tok/s':>10} {'busy/idle':>9}")
    for r in rows:
        print(f"{r['omp_wait_policy']:>8} {r['cpu_threads']:>7} {r['idle_tok_s']:>10.1f} {r['busy_tok_s']:>10.1f} "
              f"{r['ratio']:>9.2f}")


if __name__ == "__main__":
    main()
