"""CPU: host cost of prefix caching in the scheduler + KV cache manager, no model.

Drives ``Scheduler`` + ``KVCacheManager`` with a fake model (each request whose scheduled
tokens reach the end of its sequence "samples" one random token) and times only
``schedule()`` + ``update_from_output()`` with ``time.perf_counter``, caching on vs off,
interleaved repeats (medians reported). Workloads (all requests submitted at once, 128
output tokens, ignore_eos):

- ``nohit``: every prompt 2176 random tokens (W3 at 0% hits);
- ``mixed``: random prompt lengths in [100, 2176], random tokens (W1-like, 0% hits);
- ``w3``: one of 4 shared 2048-token prefixes + 128 unique tokens (W3).

Defaults mirror the W3 GPU run: 512 requests, token budget 8192, max_num_seqs 256,
block_size 16, 14043 KV blocks (24 GiB of Qwen3-0.6B bf16 KV). Overheads use CPU time
(``time.process_time``), which other jobs on a shared machine disturb less than wall time.
Prints a table; ``--out`` writes JSON. (Its ``--compare-git`` / ``--check-git`` lockstep
modes compared KV-cache module versions of the pre-"core seams" interface and were removed
with it; the figures recorded with them in BENCHMARKS.md stand for that code.)

    python3 benchmarks/prefix_cache_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

VOCAB = 50000


def workload(name: str, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts (token id lists) of workload ``name`` (nohit | mixed | w3)."""
    rng = random.Random(seed)
    rand = lambda k: [rng.randrange(VOCAB) for _ in range(k)]  # noqa: E731
    if name == "nohit":
        return [rand(2176) for _ in range(n)]
    if name == "mixed":
        return [rand(rng.randint(100, 2176)) for _ in range(n)]
    if name == "w3":
        prefixes = [rand(2048) for _ in range(4)]
        return [prefixes[i % 4] + rand(128) for i in range(n)]
    raise ValueError(f"unknown workload {name!r}")


def run_once(prompts: list[list[int]], caching: bool, ns) -> dict:
    """One full run to completion; host time of schedule + update, in seconds (wall, CPU)."""
    cfg = SchedulerConfig(max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.budget,
                          max_model_len=4096, enable_chunked_prefill=True, scheduling_policy="fcfs")
    s = Scheduler(cfg, KVCacheManager.for_blocks(ns.num_blocks, ns.block_size, caching))
    sp = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        s.add_request(Request(f"r{i}", p, sp, arrival_time=float(i)))
    rng = random.Random(1)
    pc, cpu = time.perf_counter, time.process_time
    steps, decode_only = [], []
    cpu_s = 0.0
    gc.collect()
    n_gc2 = gc.get_stats()[2]["collections"]
    while s.has_unfinished_requests():
        c0, t0 = cpu(), pc()
        sched = s.schedule()
        t1, c1 = pc(), cpu()
        # Sync scheduling: a request samples iff this schedule gave it a pending token.
        sampled = ModelRunnerOutput({rid: [rng.randrange(VOCAB)] for rid in sched.num_scheduled_tokens
                                     if s.requests[rid].num_pending_tokens})
        c2, t2 = cpu(), pc()
        s.update_from_output(sched, sampled)
        t3, c3 = pc(), cpu()
        dt = (t1 - t0) + (t3 - t2)
        cpu_s += (c1 - c0) + (c3 - c2)
        steps.append(dt)
        if all(n == 1 for n in sched.num_scheduled_tokens.values()):
            decode_only.append(dt)
    return dict(total_s=sum(steps), cpu_s=cpu_s, steps=len(steps), us_per_step=1e6 * sum(steps) / len(steps),
                median_us_per_step=1e6 * statistics.median(steps),
                decode_us_per_step=1e6 * statistics.median(decode_only) if decode_only else 0.0,
                num_decode_steps=len(decode_only), hits=s.prefix_cache_hits, queries=s.prefix_cache_queries,
                preemptions=s.num_preemptions, full_gcs=gc.get_stats()[2]["collections"] - n_gc2)


def _git(*args: str) -> str:
    import subprocess

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--workloads", default="nohit,mixed,w3")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=14043)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gpu-step-ms", type=float, default=26.7,
                    help="a realistic GPU step, for the overhead %% column (H100 W3 0%%-hits, caching "
                         "off: 20.7 s / 775 steps)")
    ap.add_argument("--out", default=None, help="write JSON here")
    ns = ap.parse_args()
    impls = {"tree": None}
    res = {}
    lines = [f"{'workload':<8} {'impl':<6} {'cache':<5} {'steps':>5} {'wall ms':>8} {'cpu ms':>7} {'us/step':>8} "
             f"{'decode us':>9} {'full gc':>7} {'hit %':>5} {'+us/step':>8} {'on/off':>7} {'of GPU step':>11}"]
    for w in ns.workloads.split(","):
        prompts = workload(w, ns.requests)
        runs = {(i, c): [] for i in impls for c in (True, False)}
        for _ in range(ns.repeats):  # interleaved: drift and neighbours hit all alike
            for name in impls:
                for caching in (True, False):
                    runs[(name, caching)].append(run_once(prompts, caching, ns))
        med = {k: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for k, rs in runs.items()}
        res[w] = {}
        for name in impls:
            on, off = med[(name, True)], med[(name, False)]
            extra_us = (on["cpu_s"] - off["cpu_s"]) * 1e6 / on["steps"]
            ratio = on["cpu_s"] / off["cpu_s"] - 1
            res[w][name] = dict(on=on, off=off, overhead_cpu=ratio, overhead_wall=on["total_s"] / off["total_s"] - 1,
                                extra_us_per_step=extra_us, of_gpu_step=extra_us / (1e3 * ns.gpu_step_ms))
            for caching, m in ((False, off), (True, on)):
                hit = 100 * m["hits"] / m["queries"] if m["queries"] else 0.0
                tail = (f"{extra_us:>8.1f} {100 * ratio:>6.1f}% {100 * extra_us / (1e3 * ns.gpu_step_ms):>10.2f}%"
                        if caching else "")
                lines.append(f"{w:<8} {name[:6]:<6} {'on' if caching else 'off':<5} {m['steps']:>5.0f} "
                             f"{1e3 * m['total_s']:>8.1f} {1e3 * m['cpu_s']:>7.1f} {m['us_per_step']:>8.1f} "
                             f"{m['decode_us_per_step']:>9.1f} {m['full_gcs']:>7.0f} {hit:>5.1f} {tail}")
        print("\n".join(lines[-2 * len(impls):]), flush=True)
    print("\n".join(lines))
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(dict(args=vars(ns), head=_git("rev-parse", "HEAD"), dirty=_git("status", "--short", "kvserve/core"),
                           cpu_cores=len(os.sched_getaffinity(0)), python=sys.version.split()[0],
                           results=res, table="\n".join(lines)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
