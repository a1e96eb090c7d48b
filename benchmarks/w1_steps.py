"""Where W1's wall time goes, step by step: W1's requests (``workloads.py``: Qwen3-0.6B shape,
dummy bf16 weights, 256 requests of 100-1,024 prompt and output tokens, submitted at once) driven
through ``LLMEngine.step``, each step's wall time recorded with what the scheduler gave it
(running requests, decode rows, prefill tokens).

Steps are grouped by kind (with prefill tokens / decode only) and, for decode-only steps, by batch
size; per group: steps, wall seconds, share of the run, decode rows (one output token each) and decode rows per second. The
last line is the run if every decode-only step ran at the full batch's per-step time: the cost of
the tail (the run's last requests decoding at small batch), which no kernel speed-up removes.
With async scheduling a step's wall time is the host loop's (``step()`` returns when step N's
output is in and step N + 1 is launched), so the sum is the run's wall time.

    PYTHONPATH=. python3 benchmarks/w1_steps.py --out $OUT/w1-steps        # the GPU
    PYTHONPATH=. python3 benchmarks/w1_steps.py --tiny --out /tmp/w1-steps  # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BUCKETS = (1, 16, 64, 128, 192, 256)  # decode-only batch sizes: [1, 16), [16, 64), ... [256, ...)


def bucket(n: int) -> str:
    lo = max(b for b in BUCKETS if b <= n)
    hi = next((b for b in BUCKETS if b > n), None)
    return f"decode {lo}-{hi - 1}" if hi else f"decode {lo}+"


def main() -> None:
    import workloads

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (mechanics)")
    ap.add_argument("--tmp", default="/tmp/kvserve-w1-steps")
    a = ap.parse_args()
    a.kv_cache_dtype, a.engine_args = None, {}
    os.makedirs(a.out, exist_ok=True)
    from kvserve import SamplingParams

    s = (workloads.TINY_SIZES if a.tiny else workloads.SIZES)["w1"]
    _, out_lens, prompts, params = workloads.w1_requests(s)
    llm, args = workloads.make_llm("w1", a)
    llm.generate([list(range(100))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    seen: list = []
    orig = sched.schedule

    def schedule():
        out = orig()
        seen.append(out)
        return out

    sched.schedule = schedule
    for p, sp in zip(prompts, params):
        eng.add_request(None, p, sp)
    steps = []  # (wall s, scheduler outputs of this call)
    workloads._sync()
    t0 = time.perf_counter()
    n_out = 0
    while eng.has_unfinished_requests():
        seen.clear()
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        for so in seen:
            nst = so.num_scheduled_tokens
            if not nst:
                continue
            prefill = sum(v for v in nst.values() if v > 1)
            decodes = sum(1 for v in nst.values() if v == 1)
            steps.append(dict(wall_s=dt / len(seen), decodes=decodes, prefill_tokens=prefill))
        n_out += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    workloads._sync()
    wall = time.perf_counter() - t0
    sched.schedule = orig
    assert n_out == int(out_lens.sum()), (n_out, int(out_lens.sum()))
    groups: dict[str, dict] = {}
    for st in steps:
        key = "with prefill" if st["prefill_tokens"] else bucket(st["decodes"])
        g = groups.setdefault(key, dict(steps=0, wall_s=0.0, decode_rows=0))
        g["steps"] += 1
        g["wall_s"] += st["wall_s"]
        g["decode_rows"] += st["decodes"]
    full = [st for st in steps if not st["prefill_tokens"] and st["decodes"] >= BUCKETS[-1]]
    per_full = sum(st["wall_s"] for st in full) / len(full) if full else None
    decode_tokens = sum(st["decodes"] for st in steps if not st["prefill_tokens"])
    rest = sum(g["wall_s"] for k, g in groups.items() if k == "with prefill")
    ideal = rest + (decode_tokens / BUCKETS[-1]) * per_full if per_full else None
    res = dict(workload="W1 steps", output_tokens=n_out, wall_s=round(wall, 3),
               output_tok_per_s=round(n_out / wall, 1), steps=len(steps), engine_args=args,
               groups={k: dict(steps=g["steps"], wall_s=round(g["wall_s"], 3),
                               share=round(g["wall_s"] / wall, 3), decode_rows=g["decode_rows"],
                               ms_per_step=round(1e3 * g["wall_s"] / g["steps"], 3),
                               rows_per_s=round(g["decode_rows"] / g["wall_s"], 1) if g["wall_s"] else None)
                       for k, g in sorted(groups.items())},
               full_batch_ms_per_step=round(1e3 * per_full, 3) if per_full else None,
               tail_free_tok_per_s=round(n_out / ideal, 1) if ideal else None,
               per_step=[[round(1e3 * st["wall_s"], 3), st["decodes"], st["prefill_tokens"]] for st in steps],
               **workloads.environment())
    with open(os.path.join(a.out, "w1_steps.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"W1: {res['output_tok_per_s']:,} out tok/s, {wall:.2f} s, {len(steps)} steps")
    print("| steps | count | wall s | share | decode rows | ms/step | rows/s |\n|---|---|---|---|---|---|---|")
    for k, g in res["groups"].items():
        print(f"| {k} | {g['steps']} | {g['wall_s']} | {g['share']:.1%} | {g['decode_rows']} | "
              f"{g['ms_per_step']} | {g['rows_per_s']} |")
    if ideal:
        print(f"every decode-only step at the full batch's {res['full_batch_ms_per_step']} ms: "
              f"{res['tail_free_tok_per_s']:,} out tok/s (the tail's cost)")
    llm.shutdown()


if __name__ == "__main__":
    main()
