"""GPU memory under a hostile feature matrix: does ``--gpu-memory-utilization`` hold as a ceiling?

    python benchmarks/gpu_memory_stress.py --out DIR [--configs max-batch,long-fp8,spec,moe]
    python benchmarks/gpu_memory_stress.py --cpu-smoke --out /tmp/ms      # tiny model, the script runs

Each configuration runs in its own process (one engine per process), dummy weights, CUDA graphs
on, ``--gpu-memory-utilization U`` (0.85), a load that fills the KV cache for ``--seconds``:

- ``max-batch``: Llama-3.1-8B shape, ``max_num_seqs`` 512, 1-2.5K-token prompts sharing 512-token
  prefixes in groups of 64 (prefix caching, cascade attention), sampled outputs: preemption;
- ``long-fp8``: the 8B shape with FP8 KV, six 32K-token prompts beside 64 short ones (chunked
  prefill over long prefixes);
- ``spec``: the 8B shape with n-gram speculation (k=4) at ``max_num_seqs`` 256 (verify rows, the
  sampler's ``[rows, vocab]`` temporaries);
- ``moe``: the Qwen3-30B-A3B shape (fused-MoE workspaces), 256 sequences of 1-2K-token prompts.

A thread samples the device's used memory (``total - free`` from ``cudaMemGetInfo``, so the CUDA
context, NCCL and cuBLAS count too) every 10 ms. Recorded per configuration: the peak against
``U x total``, ``torch.cuda.max_memory_reserved``, requests finished / failed with
``finish_reason="error"`` (an OOM contained by the engine) / raised, preemptions. Pass: no OOM
anywhere and the peak <= ``U x total``. Writes ``memory_stress.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ("max-batch", "long-fp8", "spec", "moe")


class PeakSampler:
    """Device memory in use (bytes), sampled in a thread; ``peak`` is the largest sample."""

    def __init__(self, period_s: float = 0.01) -> None:
        import torch

        self.torch, self.period, self.peak = torch, period_s, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = self.torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(self.period)

    def __enter__(self) -> "PeakSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def _workload(name: str, smoke: bool, rng) -> tuple[list, list, dict]:
    """(prompts, sampling params, engine args) of one configuration."""
    from kvserve import SamplingParams

    def rand(n):
        return [rng.randrange(3, 20000 if not smoke else 200) for _ in range(n)]

    scale = 64 if smoke else 1
    if name == "max-batch":
        prefixes = [rand(512 // scale) for _ in range(8)]
        prompts = [prefixes[i % 8] + rand(rng.randint(500, 2000) // scale) for i in range(768 // (8 if smoke else 1))]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(64, 256) // (8 if smoke else 1),
                                 ignore_eos=True) for i in range(len(prompts))]
        args = dict(max_num_seqs=512, max_model_len=4096, enable_prefix_caching=True)
    elif name == "long-fp8":
        prompts = [rand(32000 // scale) for _ in range(6)] + [rand(rng.randint(100, 1000) // scale) for _ in range(64)]
        params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * len(prompts)
        args = dict(kv_cache_dtype="fp8_e4m3", max_model_len=34000, max_num_seqs=128)
    elif name == "spec":
        seg = [rand(64 // scale) for _ in range(16)]
        prompts = [sum((seg[(i + j) % 16] for j in range(12)), []) for i in range(384 // (8 if smoke else 1))]
        params = [SamplingParams(temperature=0, max_tokens=128 // (8 if smoke else 1), ignore_eos=True)] * len(prompts)
        args = dict(max_num_seqs=256, max_model_len=4096,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    elif name == "moe":
        prompts = [rand(rng.randint(1000, 2000) // scale) for _ in range(384 // (8 if smoke else 1))]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=128 // (8 if smoke else 1), ignore_eos=True)
                  for i in range(len(prompts))]
        args = dict(max_num_seqs=256, max_model_len=4096)
    else:
        raise ValueError(f"unknown configuration {name!r}: one of {CONFIGS}")
    return prompts, params, args


def _model(name: str, smoke: bool, tmp: str) -> str:
    import transformers

    if smoke:
        from gpu_tensor_parallel import SMOKE

        cfg = transformers.LlamaConfig(**dict(SMOKE, max_position_embeddings=40960))
    elif name == "moe":
        from gpu_moe import QWEN3_30B_A3B

        kw = {k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"}
        cfg = transformers.AutoConfig.for_model(QWEN3_30B_A3B["model_type"], **kw)
    else:
        from gpu_decode import LLAMA31_8B

        cfg = transformers.LlamaConfig(**LLAMA31_8B)
    path = os.path.join(tmp, "smoke" if smoke else name)
    cfg.save_pretrained(path)
    return path


LOG: list[str] = []  # the engine's start-up lines (its memory budget) of this process


class _Keep:
    def write(self, m: str) -> None:
        LOG.append(m.strip())

    def flush(self) -> None:
        pass


def one(name: str, smoke: bool, seconds: float, util: float) -> dict:
    """One configuration in this process (``NAME+expandable``: with PyTorch's expandable segments)."""
    import logging
    import random

    if name.endswith("+expandable"):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # before CUDA starts
        name = name[:-len("+expandable")]
    logging.getLogger("kvserve").addHandler(logging.StreamHandler(_Keep()))

    import torch

    from kvserve import LLM

    rng = random.Random(0)
    prompts, params, args = _workload(name, smoke, rng)
    path = _model(name, smoke, tempfile.mkdtemp())
    rec = dict(config=name + ("+expandable" if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") else ""),
               gpu_memory_utilization=util, requests=len(prompts), engine_args=dict(args))
    if smoke:
        args.update(device="cpu", dtype="float32", kv_cache_memory="64MiB")
    else:
        args.update(dtype="bfloat16", gpu_memory_utilization=util)
        total = torch.cuda.mem_get_info()[1]
        rec["budget_gib"] = round(util * total / 2**30, 2)
    t0 = time.perf_counter()
    sampler = PeakSampler() if not smoke else None
    finished = errors = 0
    try:
        if sampler:
            sampler.__enter__()
        llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, disable_log_stats=True, **args)
        rec["startup_s"] = round(time.perf_counter() - t0, 1)
        eng = llm.llm_engine
        rec["kv_blocks"] = eng.config.cache_config.num_blocks
        ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        t1 = time.perf_counter()
        while eng.has_unfinished_requests() and time.perf_counter() - t1 < seconds:
            for out in eng.step():
                if out.finished:
                    finished += 1
                    errors += out.outputs[0].finish_reason == "error"
        rec["load_s"] = round(time.perf_counter() - t1, 1)
        for rid in ids:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
        sched = eng.engine_core.scheduler
        rec["preemptions"] = sched.num_preemptions
        llm.shutdown()
        rec["raised"] = None
    except Exception as exc:  # noqa: BLE001 - an OOM that escaped is the finding
        rec["raised"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if sampler:
            sampler.__exit__()
    rec.update(finished=finished, finished_error=errors)
    if not smoke:
        rec["peak_used_gib"] = round(sampler.peak / 2**30, 2)
        rec["max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        rec["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rec["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        rec["memory_log"] = [m for m in LOG if "memory:" in m or "captured" in m][:8]
        rec["peak_within_budget"] = sampler.peak <= rec["budget_gib"] * 2**30
    oom = errors > 0 or (rec["raised"] is not None and "memory" in rec["raised"].lower())
    rec["oom"] = oom
    rec["pass"] = not oom and rec["raised"] is None and rec.get("peak_within_budget", True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/kvserve_memory_stress")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seconds", type=float, default=30.0, help="load seconds per configuration")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per configuration's process")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.cpu_smoke, a.seconds, a.gpu_memory_utilization)), flush=True)
        return
    os.makedirs(a.out, exist_ok=True)
    recs = []
    for name in a.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--seconds", str(a.seconds),
               "--gpu-memory-utilization", str(a.gpu_memory_utilization)] + (["--cpu-smoke"] if a.cpu_smoke else [])
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
            rec = json.loads(lines[-1]) if lines else dict(config=name, error=(r.stderr or r.stdout)[-2000:])
        except subprocess.TimeoutExpired:
            rec = dict(config=name, error="timed out")
        recs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "engine_args"}), flush=True)
        if not a.cpu_smoke:
            from gpu_equality import env

            meta = env()
        else:
            meta = {"device": "cpu-smoke"}
        json.dump(dict(runs=recs, **meta), open(os.path.join(a.out, "memory_stress.json"), "w"), indent=1)
    print("| config | requests finished / error | OOM | peak used GiB | budget GiB | max reserved / allocated GiB "
          "| pass |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        print(f"| {r['config']} | {r.get('finished', '-')} / {r.get('finished_error', '-')} | {r.get('oom', '-')} "
              f"| {r.get('peak_used_gib', '-')} | {r.get('budget_gib', '-')} | {r.get('max_reserved_gib', '-')} / "
              f"{r.get('max_allocated_gib', '-')} | {r.get('pass', r.get('error', '?')[:60])} |")
    for r in recs:
        for m in r.get("memory_log", []):
            print(f"  {r['config']}: {m[:300]}")


if __name__ == "__main__":
    main()
