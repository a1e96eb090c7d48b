"""CPU: host cost of the CPU tier's scheduler half per step, no model (zero reuse).

Drives ``Scheduler`` + ``KVCacheManager`` with a fake model (as ``prefix_cache_overhead.py``)
on random prompts (no reuse at all: the tier only stores), with and without the
``OffloadingConnector`` scheduler role, interleaved repeats, medians of CPU time
(``time.process_time``). The worker half's copies are not included (they run off the critical
path; see ``kv_tiers.py`` for end-to-end figures).

    python3 benchmarks/kv_tier_overhead.py [--requests 256] [--repeats 3] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from types import SimpleNamespace

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.kv_connector import KVConnectorRole
from kvserve.kv_connector.offloading import OffloadingConnector
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

VOCAB = 50000


def run_once(prompts, tier: bool, ns) -> dict:
    cfg = SchedulerConfig(max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.budget, max_model_len=4096,
                          enable_chunked_prefill=True, scheduling_policy="fcfs")
    kv = KVCacheManager.for_blocks(ns.num_blocks, 16, True)
    conn = None
    if tier:
        bpb = kv.kv_cache_config.bytes_per_block
        config = SimpleNamespace(cache_config=CacheConfig(kv_offloading_size=ns.tier_blocks * bpb / 2**30),
                                 scheduler_config=cfg, model_config=ModelConfig(model="bench", dtype="float32"))
        conn = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv.kv_cache_config)
    s = Scheduler(cfg, kv, conn)
    sp = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        s.add_request(Request(f"r{i}", p, sp, arrival_time=float(i)))
    rng = random.Random(1)
    cpu = time.process_time
    total, steps, decode = 0.0, 0, []
    while s.has_unfinished_requests():
        c0 = cpu()
        sched = s.schedule()
        c1 = cpu()
        out = ModelRunnerOutput({rid: [rng.randrange(VOCAB)] for rid in sched.num_scheduled_tokens
                                 if s.requests[rid].num_pending_tokens})
        c2 = cpu()
        s.update_from_output(sched, out)
        dt = (c1 - c0) + (cpu() - c2)
        total += dt
        steps += 1
        if all(n == 1 for n in sched.num_scheduled_tokens.values()):
            decode.append(dt)
    return dict(cpu_s=total, steps=steps, us_per_step=1e6 * total / steps,
                decode_us_per_step=1e6 * statistics.median(decode) if decode else 0.0,
                stored=conn.get_stats()["blocks_stored"] if conn else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=14043)
    ap.add_argument("--tier-blocks", type=int, default=50000)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(ns.prompt_len)] for _ in range(ns.requests)]
    runs = {False: [], True: []}
    for _ in range(ns.repeats):
        for tier in (False, True):
            runs[tier].append(run_once(prompts, tier, ns))
    med = {t: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for t, rs in runs.items()}
    res = dict(args=vars(ns), off=med[False], tier=med[True],
               extra_us_per_step=med[True]["us_per_step"] - med[False]["us_per_step"],
               extra_decode_us_per_step=med[True]["decode_us_per_step"] - med[False]["decode_us_per_step"])
    print(json.dumps(res, indent=1))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
