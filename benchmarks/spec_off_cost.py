"""What speculation costs while it is off: an engine with EAGLE configured and the dynamic policy
(``"dynamic": true``) at batch sizes above its band (``dynamic_max_batch``, 32), where it drafts
nothing, against an engine without speculation. SmolLM2-135M shape, dummy bf16 weights, a random
EAGLE head (acceptance does not matter: nothing is drafted); 256 output tokens per request; each
configuration in its own process, the whole batch once as warm-up first.

Per configuration: output tok/s, decode steps, and the engine's own counters (patched in the child,
the engine carries no timers): steps run one at a time (``EngineCore._needs_host_tokens`` true: no
async overlap), steps that missed the decode CUDA graph (``CUDAGraphRunner.can_run`` false), drafts
proposed, and the host seconds in the proposer's hooks (``propose``, ``record_hidden_states``).

``--profile`` then refills the batch and, in steady decode, times each decode-graph replay on the
device (CUDA events around ``CUDAGraph.replay``) over ``--profile-steps`` x 2 steps, the host ms
per engine seam (``step_profile``'s seam timers) over as many, and runs
``--profile-steps`` steps under ``torch.profiler``: GPU busy / idle per step and the top kernels by
device time (``step_profile.kernel_table``), so two configurations' steps can be told apart by
what the device runs and by how long it waits for the host.

    PYTHONPATH=. python3 benchmarks/spec_off_cost.py --out $OUT/spec-off
    PYTHONPATH=. python3 benchmarks/spec_off_cost.py --batches 64 --profile \
        --configs none,eagle_dynamic,ngram_dynamic,eagle1_dynamic --out $OUT/spec-off   # the GPU part
    PYTHONPATH=. python3 benchmarks/spec_off_cost.py --batches 64 --rounds 4 --repeats 3 \
        --configs none,eagle_dynamic,ngram_dynamic --out $OUT/spec-off-rounds   # process-to-process spread
    PYTHONPATH=. python3 benchmarks/spec_off_cost.py --batches 64 --interleave --rounds 5 --repeats 2 \
        --configs none,eagle_dynamic,ngram_dynamic --out $OUT/spec-off-interleaved   # one process, alternating
    PYTHONPATH=. python3 benchmarks/spec_off_cost.py --cpu-smoke --profile --out /tmp/spec-off   # tiny, CPU

``--rounds`` repeats the configurations in alternating fresh processes: on the H200 machine one
process's host work can run ~1.5x slower than the next one's at every seam alike, so a single
process per configuration cannot tell a 0.5 ms per-step difference from that spread.
``--interleave`` removes the process from the comparison: every configuration's engine lives in
one process and their timed runs alternate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def graph_replay_ms(llm, steps: int, cuda: bool) -> dict | None:
    """Over ``steps`` engine steps: device ms of each CUDA-graph replay (CUDA events around
    ``torch.cuda.CUDAGraph.replay``: the decode graph; a drafting step's draft graphs too), the
    wall ms per step, and the host ms per step spent waiting for a step's result
    (``torch.cuda.Event.synchronize`` in ``AsyncModelRunnerOutput.get``: near 0 when the loop is
    bound by the host, most of the step when bound by the device)."""
    if not cuda:
        return None
    import torch

    evs, wait = [], [0.0]
    orig, orig_sync = torch.cuda.CUDAGraph.replay, torch.cuda.Event.synchronize

    def replay(self):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        orig(self)
        e.record()
        evs.append((s, e))

    def synchronize(self):
        t = time.perf_counter()
        try:
            return orig_sync(self)
        finally:
            wait[0] += time.perf_counter() - t

    eng = llm.llm_engine
    torch.cuda.CUDAGraph.replay, torch.cuda.Event.synchronize = replay, synchronize
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            eng.step()
    finally:
        torch.cuda.CUDAGraph.replay, torch.cuda.Event.synchronize = orig, orig_sync
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in evs)
    res = dict(replays=len(ms), wall_ms_per_step=round(wall * 1e3 / steps, 4),
               host_wait_ms_per_step=round(wait[0] * 1e3 / steps, 4))
    if ms:
        res.update(mean_ms=round(sum(ms) / len(ms), 4), median_ms=round(ms[len(ms) // 2], 4),
                   min_ms=round(ms[0], 4), max_ms=round(ms[-1], 4))
    return res


def host_seams(llm, steps: int) -> dict:
    """Host ms per step per engine seam over ``steps`` steps (``step_profile``'s exclusive seam
    timers, plus the proposer, the policy's step timing and the async-overlap check)."""
    from step_profile import host_profile, install_seams

    core = llm.llm_engine.engine_core
    timer = install_seams(llm)
    for obj, attr, name in ((core.model_runner, "propose", "proposer"), (core, "_time_step", "policy timing"),
                            (core, "_needs_host_tokens", "overlap check")):
        if hasattr(obj, attr):
            timer.wrap(obj, attr, name)
    try:
        r = host_profile(llm, timer, steps)
    finally:
        timer.restore()
    return {k: r[k] for k in ("step_ms", "step_ms_median", "host_ms", "buckets_ms", "seams_ms", "seams_cpu_ms")}


def profile_decode(llm, prompts: list, steps: int, out_dir: str, label: str, cuda: bool) -> dict:
    """Steady decode of ``prompts`` (a prefix hit: every step a decode): graph replay device times
    over ``2 * steps`` steps, then ``steps`` steps under ``torch.profiler`` (step_profile's kernel
    table: ms per step per kernel class, GPU busy / idle, top kernels)."""
    from step_profile import device_profile

    from kvserve import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=3 * steps + 16, ignore_eos=True)
    ids = [eng.add_request(None, p, sp) for p in prompts]
    for _ in range(6):  # the prefix-hit step and the first decodes (async scheduling settles)
        eng.step()
    res = {"graph_replay": graph_replay_ms(llm, 2 * steps, cuda)}
    res["host"] = host_seams(llm, 2 * steps)
    res.update(device_profile(llm, steps, out_dir, label))
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return res


def speculative_config(name: str, tmp: str, cfg: dict, smoke: bool) -> dict | None:
    """The ``speculative_config`` of a configuration name (none: no speculation)."""
    import transformers

    from kvserve.models.llama_eagle import save_random_eagle_head

    if name.startswith("eagle"):  # eagle_dynamic (k = 4), eagle1_dynamic (k = 1), eagle3_dynamic (k = 4)
        e3 = name.startswith("eagle3")
        head = os.path.join(tmp, "off-eagle3-head" if e3 else "off-eagle-head")
        save_random_eagle_head(head, transformers.LlamaConfig(**cfg), eagle3=e3,
                               draft_vocab_size=256 if smoke else 32000, seed=1, std=0.05)
        return {"method": "eagle3" if e3 else "eagle", "model": head,
                "num_speculative_tokens": 1 if name.startswith("eagle1") else 4, "dynamic": True}
    if name == "ngram_dynamic":  # stateless: no hidden states, no head
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "dynamic": True}
    return None


def interleaved(ns, path: str, cfg: dict, dev: str) -> dict:
    """Every configuration's engine alive in this one process, their timed runs alternating
    (``--rounds`` x ``--repeats`` each): the process's host speed is the same for all of them."""
    import torch

    from gpu_spec import _llm
    from kvserve import SamplingParams

    smoke = ns.cpu_smoke
    n_tok = 16 if smoke else 256
    names = [c.partition(":")[0] for c in ns.configs.split(",")]
    kw = dict(max_model_len=1024, max_num_seqs=64, kv_cache_memory="64MiB" if smoke else "8GiB")
    if smoke:
        kw["cpu_threads"] = 1
    llms = {n: _llm(path, dev, speculative_config=speculative_config(n, ns.tmp, cfg, smoke), **kw) for n in names}
    out = {}
    for b in ns.batches:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(3, 500, (64,), generator=g).tolist() for _ in range(b)]
        for llm in llms.values():  # warm-up: the batch once
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        runs: dict[str, list[float]] = {n: [] for n in names}
        drafts = {n: llms[n].llm_engine.stats.num_drafts for n in names}
        for _ in range(ns.rounds):
            for n, llm in llms.items():
                for _ in range(ns.repeats):
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True),
                                 use_tqdm=False)
                    runs[n].append(round(b * n_tok / (time.perf_counter() - t), 1))
        out[str(b)] = {n: dict(output_tok_s=sorted(v)[len(v) // 2], output_tok_s_runs=v,
                               drafts=llms[n].llm_engine.stats.num_drafts - drafts[n]) for n, v in runs.items()}
        if ns.host_calls:  # one more run each under cProfile: host ms per step per function
            for n, llm in llms.items():
                out[str(b)][n]["host_functions"] = profiled_run(llm, prompts, n_tok)
    for llm in llms.values():
        llm.shutdown()
    out["cpu"] = last_cpu()
    return out


def profiled_run(llm, prompts: list, n_tok: int) -> dict[str, list[float]]:
    """One timed run under cProfile: per function (file:name), [calls, own ms, cumulative ms]
    per decode step, for functions with at least 2 us of own time per step."""
    import cProfile
    import pstats

    from kvserve import SamplingParams

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True), use_tqdm=False)
    prof.disable()
    res: dict[str, list[float]] = {}
    for (f, line, name), (_, nc, tt, ct, _c) in pstats.Stats(prof).stats.items():
        k = f"{os.path.basename(f)}:{line}:{name.split(' at 0x')[0]}"
        r = res.setdefault(k, [0.0, 0.0, 0.0])
        r[0] += nc / n_tok
        r[1] += 1e3 * tt / n_tok
        r[2] += 1e3 * ct / n_tok
    return {k: [round(x, 4) for x in v] for k, v in res.items() if v[1] >= 0.002}


def child(ns) -> dict:
    import torch

    from gpu_spec import SMOLLM2_135M, TINY, _config_dir, _llm
    from kvserve import SamplingParams
    from kvserve.engine import engine_core
    from kvserve.worker import cuda_graphs

    smoke = ns.cpu_smoke
    dev = "cpu" if smoke else "cuda"
    cfg = dict(TINY, num_hidden_layers=4) if smoke else SMOLLM2_135M
    path = _config_dir(ns.tmp, "off-target", cfg)
    if ns.config == "interleave":
        return interleaved(ns, path, cfg, dev)
    spec = speculative_config(ns.config, ns.tmp, cfg, smoke)
    counts = {"sync_steps": 0, "graph_misses": 0, "graph_runs": 0, "proposer_s": 0.0}
    nh = engine_core.EngineCore._needs_host_tokens

    def needs(self):
        r = nh(self)
        counts["sync_steps"] += bool(r)
        return r

    engine_core.EngineCore._needs_host_tokens = needs
    cr = cuda_graphs.CUDAGraphRunner.can_run

    def can_run(self, inp):
        r = cr(self, inp)
        counts["graph_runs" if r else "graph_misses"] += 1
        return r

    cuda_graphs.CUDAGraphRunner.can_run = can_run
    kw = dict(max_model_len=1024, max_num_seqs=64, kv_cache_memory="64MiB" if smoke else "8GiB",
              async_scheduling=None if ns.async_scheduling == "default" else ns.async_scheduling == "on")
    if smoke:
        kw["cpu_threads"] = 1
    llm = _llm(path, dev, speculative_config=spec, **kw)
    prop = llm.llm_engine.engine_core.model_runner.proposer
    if prop is not None:
        for name in ("propose", "record_hidden_states"):
            fn = getattr(prop, name)

            def timed(*a, _fn=fn, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    counts["proposer_s"] += time.perf_counter() - t

            setattr(prop, name, timed)
    n_tok = 16 if smoke else 256
    out = {}
    for b in ns.batches:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(3, 500, (64,), generator=g).tolist() for _ in range(b)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        for k in counts:
            counts[k] = 0
        s0 = llm.llm_engine.stats.num_drafts
        if dev == "cuda":
            torch.cuda.synchronize()
        prof = None
        if ns.host_calls:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        dts = []
        for _ in range(ns.repeats):  # the same batch again: each run is 0.4-0.6 s on the H200
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True), use_tqdm=False)
            dts.append(time.perf_counter() - t)
        dt = sorted(dts)[len(dts) // 2]
        if prof is not None:
            prof.disable()
            import pstats

            calls: dict[str, float] = {}
            for (f, _, n), (_, nc, *_r) in pstats.Stats(prof).stats.items():
                k = f"{os.path.basename(f)}:{n.split(' at 0x')[0]}"  # no addresses: comparable across processes
                calls[k] = calls.get(k, 0.0) + nc / n_tok
        runs = len(dts)
        out[str(b)] = dict(output_tok_s=round(b * n_tok / dt, 1), wall_s=round(dt, 3),
                           output_tok_s_runs=[round(b * n_tok / x, 1) for x in dts],
                           drafts=llm.llm_engine.stats.num_drafts - s0,
                           proposer_ms_per_step=round(1e3 * counts["proposer_s"] / (n_tok * runs), 4),
                           **{k: v for k, v in counts.items() if k != "proposer_s"})
        if prof is not None:  # Python calls per step (cProfile; its timings are not kept: it slows the run)
            out[str(b)]["host_calls_per_step"] = {k: round(v, 2) for k, v in calls.items() if v >= 1}
        if ns.profile:  # on the CPU (smoke) no more than 8 steps: the code path, not a measurement
            steps = min(ns.profile_steps, 8) if smoke else ns.profile_steps
            out[str(b)]["profile"] = profile_decode(llm, prompts, steps, ns.tmp, f"{ns.config}-{b}", dev == "cuda")
    llm.shutdown()
    out["cpu"] = last_cpu()
    return out


def last_cpu() -> dict:
    """The CPU this process last ran on and how many it may use (per-process host speed varies)."""
    try:
        with open("/proc/self/stat") as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        cpu = None
    return {"last_cpu": cpu, "allowed": len(os.sched_getaffinity(0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/spec-off")
    ap.add_argument("--tmp", default="/tmp/kvserve-spec-off")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--configs", default="none,eagle_dynamic,none:off,eagle_dynamic:off",
                    help="NAME[:on|off]: none, eagle_dynamic (k=4), eagle1_dynamic (k=1), eagle3_dynamic (k=4), "
                         "ngram_dynamic (k=4); "
                         "async scheduling forced on/off (default: the engine's)")
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)  # child
    ap.add_argument("--async-scheduling", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--profile", action="store_true", help="graph replay device times and a torch.profiler "
                                                            "kernel table of steady decode steps per configuration")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per batch in each process (the median)")
    ap.add_argument("--interleave", action="store_true",
                    help="every configuration's engine in one process, their timed runs alternating")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations this many times, alternating, each in a fresh process")
    ap.add_argument("--host-calls", action="store_true", help="Python calls per step of the timed run (cProfile); "
                                                               "printed beside the first configuration's")
    ns = ap.parse_args()
    os.makedirs(ns.tmp, exist_ok=True)
    if ns.config:
        print("RESULT " + json.dumps(child(ns)), flush=True)
        return
    os.makedirs(ns.out, exist_ok=True)
    if ns.interleave:
        interleave_parent(ns)
        return
    recs = []
    for rnd, c in ((r, c) for r in range(ns.rounds) for c in ns.configs.split(",")):
        name, _, asy = c.partition(":")
        cmd = [sys.executable, __file__, "--config", name, "--async-scheduling", asy or "default", "--tmp", ns.tmp,
               "--batches", *map(str, ns.batches), "--profile-steps", str(ns.profile_steps),
               "--repeats", str(ns.repeats)] + \
            (["--cpu-smoke"] if ns.cpu_smoke else []) + (["--profile"] if ns.profile else []) + \
            (["--host-calls"] if ns.host_calls else [])
        rec = run_child(cmd, dict(config=name, async_scheduling=asy or "default", round=rnd))
        recs.append(rec)
        print(json.dumps(rec), flush=True)
        with open(os.path.join(ns.out, "spec_off_cost.json"), "w") as f:
            json.dump(recs, f, indent=1)
    print("\n| config | async | batch | tok/s | sync steps | graph misses / runs | drafts | proposer ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in recs:
        for b, x in r.get("batches", {}).items():
            print(f"| {r['config']} | {r['async_scheduling']} | {b} | {x['output_tok_s']} | {x['sync_steps']} | "
                  f"{x['graph_misses']} / {x['graph_runs']} | {x['drafts']} | {x['proposer_ms_per_step']} |")
        if "error" in r:
            print(f"| {r['config']} | error | {r['error'][-300:]!r} |")
    if ns.rounds > 1:
        print_rounds(recs)
    if ns.profile:
        print_profiles(recs)
    if ns.host_calls:
        print_host_calls(recs)
        with open(os.path.join(ns.out, "spec_off_cost.json"), "w") as f:
            json.dump(recs, f, indent=1)


def run_child(cmd: list[str], rec: dict) -> dict:
    """Run one child process; ``rec`` plus its seconds and its result (``batches``, ``cpu``) or
    the tail of its stderr (``error``)."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = [s for s in p.stdout.splitlines() if s.startswith("RESULT ")]
    rec["process_s"] = round(time.perf_counter() - t0, 1)
    if line:
        res = json.loads(line[-1][7:])
        rec["cpu"] = res.pop("cpu", None)
        rec["batches"] = res
    else:
        rec["error"] = p.stderr[-3000:]
    return rec


def interleave_parent(ns) -> None:
    """One child process with every configuration (``--interleave``): tok/s of each timed run."""
    cmd = [sys.executable, __file__, "--config", "interleave", "--configs", ns.configs, "--tmp", ns.tmp,
           "--batches", *map(str, ns.batches), "--rounds", str(ns.rounds), "--repeats", str(ns.repeats)] + \
        (["--cpu-smoke"] if ns.cpu_smoke else []) + (["--host-calls"] if ns.host_calls else [])
    rec = run_child(cmd, dict(mode="interleave", configs=ns.configs, rounds=ns.rounds, repeats=ns.repeats))
    print(json.dumps(rec), flush=True)
    with open(os.path.join(ns.out, "spec_off_interleaved.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print("\n| config | batch | tok/s per timed run (alternating with the others) | median | vs first | drafts |")
    print("|---|---|---|---|---|---|")
    for b, per in rec.get("batches", {}).items():
        first = None
        for n, x in per.items():
            first = first or x["output_tok_s"]
            print(f"| {n} | {b} | {', '.join(f'{v:,.0f}' for v in x['output_tok_s_runs'])} | "
                  f"{x['output_tok_s']:,.0f} | {x['output_tok_s'] / first:.3f}x | {x['drafts']} |")
        names = list(per)
        base = per[names[0]].get("host_functions")
        for n in names[1:] if base else []:
            cur = per[n].get("host_functions", {})
            tot = sum(v[1] for v in cur.values()) - sum(v[1] for v in base.values())
            diff = {k: cur.get(k, [0, 0, 0])[1] - base.get(k, [0, 0, 0])[1] for k in set(cur) | set(base)}
            top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:15]
            print(f"\n{n} vs {names[0]}, batch {b}, under cProfile: own host ms per step {tot:+.3f}; most: ")
            for k, v in top:
                print(f"  {v:+.4f} ms  calls {base.get(k, [0])[0]:.1f} -> {cur.get(k, [0])[0]:.1f}  {k}")


def print_rounds(recs: list[dict]) -> None:
    """Per configuration and batch: tok/s of each round's process, the median, and the ratio of
    medians to the first configuration's."""
    by: dict[tuple, list[float]] = {}
    for r in recs:
        for b, x in r.get("batches", {}).items():
            by.setdefault((r["config"], r["async_scheduling"], b), []).append(x["output_tok_s"])
    first = {}
    print("\n| config | async | batch | tok/s per process (round order) | median | vs first config |")
    print("|---|---|---|---|---|---|")
    for (c, a, b), v in by.items():
        med = sorted(v)[len(v) // 2]
        first.setdefault(b, med)
        print(f"| {c} | {a} | {b} | {', '.join(f'{x:,.0f}' for x in v)} | {med:,.0f} | {med / first[b]:.3f}x |")


def print_host_calls(recs: list[dict]) -> None:
    """Python calls per step beyond the first configuration's, per configuration and batch."""
    base = recs[0].get("batches", {}) if recs else {}
    for r in recs[1:]:
        for b, x in r.get("batches", {}).items():
            a, c = (base.get(b) or {}).get("host_calls_per_step", {}), x.get("host_calls_per_step", {})
            diff = {k: round(c.get(k, 0) - a.get(k, 0), 2) for k in set(a) | set(c)}
            diff = {k: v for k, v in diff.items() if abs(v) >= 0.5}
            x["extra_host_calls_per_step"] = round(sum(v for v in diff.values() if v > 0), 1)
            top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:8]
            print(f"\n{r['config']} batch {b}: {x['extra_host_calls_per_step']} Python calls per step beyond "
                  f"{recs[0]['config']}'s; most: " + ", ".join(f"{k} {v:+}" for k, v in top))


def print_profiles(recs: list[dict]) -> None:
    """Per configuration and batch: graph replay device ms, GPU busy / idle ms per step, the top kernels."""
    print("\n| config | async | batch | wall ms/step | host waits ms/step | graph replay device ms (median) | "
          "GPU busy ms/step | GPU idle ms/step (profiled) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in recs:
        for b, x in r.get("batches", {}).items():
            pr = x.get("profile") or {}
            g = pr.get("graph_replay") or {}
            print(f"| {r['config']} | {r['async_scheduling']} | {b} | {g.get('wall_ms_per_step')} | "
                  f"{g.get('host_wait_ms_per_step')} | {g.get('median_ms')} | {pr.get('gpu_busy_ms_per_step')} | "
                  f"{(pr.get('ms_per_step') or {}).get('host gaps (GPU idle)')} |")
    for r in recs:
        for b, x in r.get("batches", {}).items():
            h = (x.get("profile") or {}).get("host") or {}
            if h:
                print(f"\n{r['config']} ({r['async_scheduling']}), batch {b}: {h['step_ms']} ms/step, host "
                      f"{h['host_ms']} ms/step; seams (wall ms): " +
                      ", ".join(f"{k} {v}" for k, v in sorted(h["seams_ms"].items(), key=lambda kv: -kv[1])))
    for r in recs:
        for b, x in r.get("batches", {}).items():
            pr = x.get("profile") or {}
            if pr.get("top_kernels"):
                print(f"\n{r['config']} ({r['async_scheduling']}), batch {b}: top kernels, ms per step")
                for k in pr["top_kernels"][:12]:
                    print(f"  {k['ms_per_step']:8.4f}  {k['name'][:110]}")


if __name__ == "__main__":
    main()
