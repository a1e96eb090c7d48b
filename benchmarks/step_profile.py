"""Where a large-batch decode step's time goes: host seams (CPU or CUDA) and a kernel table (CUDA).

Two measurements:

* ``--device cpu``: a tiny random Llama, ``max_num_seqs`` 512 / 1024, every request decoding
  with a long context; the engine's host time per decode step split at its seams: scheduler
  (``schedule`` / ``update_from_output``), input preparation (``InputBatch.apply`` / ``prepare``,
  the backend's attention metadata, the graph runner's packed copy), the forward, logits,
  sampling, the step's output read-back and output processing. The seams are wrapped from
  here (``SeamTimer``), so the engine carries no timers of its own.
* ``--device cuda``: the Llama-3.1-8B shape with dummy weights at batch 512 (and 1024 if the
  KV cache holds it) x ~2K context: the same host seams, then a few decode steps under
  ``torch.profiler``: ms per step in GEMMs, attention, norms / activations / rotary, sampling,
  other kernels, and GPU idle (host gaps), against the roofline (weights + KV bytes at
  4.29 TB/s, FLOPs at ~780 TFLOP/s).

Prefill is not what is measured: the prompts' forward passes are skipped (``skip_prefill``:
the model returns zeros for steps with prefill tokens; the KV blocks are still allocated and
the decode steps read a full context), so a batch of 512 x 2K starts in seconds.

Usage:
    PYTHONPATH=. python3 benchmarks/step_profile.py --device cpu --batch 512 1024 --out /tmp/sp
    PYTHONPATH=. python3 benchmarks/step_profile.py --device cuda --batch 512 1024 --out $OUT/step-profile
    PYTHONPATH=. python3 benchmarks/step_profile.py --cpu-smoke      # tiny, seconds: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HBM_BYTES_PER_S = 4.29e12  # H200 spec-sheet bandwidth (4.8 TB/s) as measured by a device copy
DENSE_FLOPS_PER_S = 780e12  # H200 bf16 dense tensor-core rate reachable by cuBLAS (~989 peak)

LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
)
TINY = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
    tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
)

# Seam -> the bucket it is reported in.
BUCKETS = {
    "schedule": "scheduler", "update_from_output": "scheduler",
    "batch.apply": "input prep", "batch.prepare": "input prep", "attn.prepare": "input prep",
    "attn.build": "input prep", "graph.run": "input prep", "block_ops": "input prep",
    "graph.prepare": "input prep", "graph.copy": "input prep", "graph.replay": "input prep",
    "model.forward": "forward", "compute_logits": "logits",
    "sampler.launch": "sampling", "runner._sample": "sampling",
    "output.get": "output", "engine._update": "output", "output_processor": "output",
    "gpu wait": "gpu wait", "step": "other",
}


class SeamTimer:
    """Wraps callables (an instance attribute or a bound method) with timers.

    Times are exclusive: a seam called inside another is subtracted from the outer one, so
    the seams of a step add up to the step's time. ``totals`` holds wall seconds per seam
    (``perf_counter``), ``cpu`` the calling thread's CPU seconds (``thread_time``: what the
    host work costs on a machine shared with other processes, where wall time is inflated).
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # (wall, cpu) spent in children of each open seam
        self._undo: list = []
        self.enabled = True

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            if not self.enabled:
                return fn(*a, **kw)
            self._stack.append([0.0, 0.0])
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                cw, cc = self._stack.pop()
                self.totals[name] += dt - cw
                self.cpu[name] += dc - cc
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][0] += dt
                    self._stack[-1][1] += dc

        had = attr in vars(obj) if hasattr(obj, "__dict__") else False
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, fn if had else None))

    def reset(self) -> None:
        self.totals.clear()
        self.cpu.clear()
        self.calls.clear()

    def restore(self) -> None:
        for obj, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)
        self._undo.clear()


def install_seams(llm) -> SeamTimer:
    """Time the engine's seams (see ``BUCKETS``) on this ``LLM``'s objects only."""
    from kvserve.worker import runner_output

    eng = llm.llm_engine
    core = eng.engine_core
    runner = core.model_runner
    t = SeamTimer()
    t.wrap(eng, "step", "step")
    t.wrap(core.scheduler, "schedule", "schedule")
    t.wrap(core.scheduler, "update_from_output", "update_from_output")
    t.wrap(core, "_update", "engine._update")
    t.wrap(eng.output_processor, "apply_outputs", "output_processor")
    t.wrap(eng.output_processor, "process", "output_processor")
    t.wrap(runner.input_batch, "apply", "batch.apply")
    t.wrap(runner.input_batch, "prepare", "batch.prepare")
    t.wrap(runner.attn_builder, "prepare", "attn.prepare")
    t.wrap(runner.attn_builder, "build", "attn.build")
    t.wrap(runner, "run_block_ops", "block_ops")
    t.wrap(runner, "_sample", "runner._sample")
    t.wrap(runner.sampler, "launch", "sampler.launch")
    t.wrap(runner.model, "forward", "model.forward")
    t.wrap(runner.model, "compute_logits", "compute_logits")
    if runner.graph_runner is not None:  # graph.run: the packing; its parts below are their own seams
        from kvserve.worker import cuda_graphs

        t.wrap(runner.graph_runner, "run", "graph.run")
        t.wrap(runner.graph_runner.builder, "prepare_for_replay", "graph.prepare")
        t.wrap(cuda_graphs, "to_device", "graph.copy")
        if runner.device.type == "cuda":
            t.wrap(torch.cuda.CUDAGraph, "replay", "graph.replay")
    t.wrap(runner_output.AsyncModelRunnerOutput, "get", "output.get")
    if torch.cuda.is_available() and runner.device.type == "cuda":
        t.wrap(torch.cuda.Event, "synchronize", "gpu wait")
    return t


@contextmanager
def skip_prefill(runner, all_steps: bool = False):
    """Steps that carry prefill tokens skip the model (zeros out; KV blocks are allocated but
    not written): a long-context batch starts without its prompts' forward passes. With
    ``all_steps`` decode steps skip it too (the host seams alone, CPU only)."""
    model = runner.model
    fwd = model.forward
    own = "forward" in vars(model)  # e.g. a SeamTimer wrapper, put back after
    hidden = runner.config.model_config.hf_config.hidden_size
    pw = runner.piecewise_runner

    def forward(input_ids, positions):
        if all_steps or input_ids.shape[0] > runner.config.scheduler_config.max_num_seqs:
            return torch.zeros(input_ids.shape[0], hidden, dtype=runner.dtype, device=input_ids.device)
        return fwd(input_ids, positions)

    model.forward = forward
    runner.piecewise_runner = None
    try:
        yield
    finally:
        if own:
            model.forward = fwd
        else:
            del model.forward
        runner.piecewise_runner = pw


def fill_batch(llm, batch: int, context: int, out_len: int, seed: int = 0) -> list[str]:
    """Add ``batch`` greedy requests of ``context`` prompt tokens; step (prefill skipped) until
    every running request decodes. Returns the request ids."""
    from kvserve import SamplingParams

    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    vocab = eng.config.model_config.hf_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    ids = [eng.add_request(None, torch.randint(3, vocab, (context,), generator=g).tolist(), sp)
           for _ in range(batch)]
    with skip_prefill(eng.engine_core.model_runner):
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            eng.step()
            if not sched.running and not sched.waiting:
                break
    for _ in range(2):  # the first decode steps (async scheduling settles)
        eng.step()
    return ids


def drain(llm, ids: list[str]) -> None:
    eng = llm.llm_engine
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()


def host_profile(llm, timer: SeamTimer, steps: int) -> dict:
    """Time ``steps`` engine steps of the running batch; per seam and bucket ms per step."""
    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    running = len(sched.running)
    timer.reset()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    per = {k: v / steps * 1e3 for k, v in sorted(timer.totals.items())}
    per_cpu = {k: v / steps * 1e3 for k, v in sorted(timer.cpu.items())}
    buckets: dict[str, float] = defaultdict(float)
    buckets_cpu: dict[str, float] = defaultdict(float)
    for k, v in per.items():
        buckets[BUCKETS.get(k, "other")] += v
        buckets_cpu[BUCKETS.get(k, "other")] += per_cpu[k]
    step_ms = sum(walls) / steps * 1e3
    device = eng.engine_core.model_runner.device.type
    # Host time: the step minus what the host spends waiting for (or, on the CPU, running) the model.
    if device == "cuda":
        host = step_ms - buckets.get("gpu wait", 0.0)
    else:
        host = step_ms - buckets.get("forward", 0.0) - buckets.get("logits", 0.0)
    compute = ("forward", "logits", "gpu wait")
    host_cpu = sum(v for k, v in buckets_cpu.items() if k not in compute)
    return dict(host_cpu_ms=round(host_cpu, 3),
                buckets_cpu_ms={k: round(v, 3) for k, v in sorted(buckets_cpu.items())},
                seams_cpu_ms={k: round(v, 3) for k, v in per_cpu.items()},
                running=running, steps=steps, step_ms=round(step_ms, 3),
                step_ms_median=round(statistics.median(walls) * 1e3, 3), host_ms=round(host, 3),
                buckets_ms={k: round(v, 3) for k, v in sorted(buckets.items())},
                seams_ms={k: round(v, 3) for k, v in per.items()})


def print_host(label: str, r: dict) -> None:
    print(f"\n{label}: {r['running']} running, {r['step_ms']:.2f} ms/step (median {r['step_ms_median']:.2f}), "
          f"host {r['host_ms']:.2f} ms/step wall, {r['host_cpu_ms']:.2f} ms/step CPU time")
    print(f"  {'':<12} {'wall ms':>9} {'CPU ms':>9}")
    for k, v in r["buckets_ms"].items():
        print(f"  {k:<12} {v:9.3f} {r['buckets_cpu_ms'].get(k, 0.0):9.3f}")
    print("  seams (CPU ms): " + ", ".join(f"{k} {v:.3f}" for k, v in r["seams_cpu_ms"].items()))


# ---- CUDA: kernel table ------------------------------------------------------------------

KERNEL_CLASSES = [  # (class, substrings of the kernel name, lower case), first match wins
    ("sampling", ("argmax", "softmax", "topk", "sort", "exponential", "multinomial", "cumsum")),
    ("attention", ("decode", "attn", "attention", "flash", "paged", "kv_store", "store_kv", "reshape_and_cache",
                   "prefill")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "matmul", "cublas", "scaled_mm", "splitk", "wgmma")),
    ("norm/act/rope", ("rms", "norm", "silu", "gelu", "act_and_mul", "rotary", "rope", "swiglu")),
]


def classify(name: str) -> str:
    n = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in n for k in keys):
            return cls
    return "other kernels"


def kernel_table(trace_path: str, steps: int) -> dict:
    """From a chrome trace: ms per step per kernel class, GPU busy / idle, top kernels."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not ks:
        return {}
    ks.sort(key=lambda e: e["ts"])
    per_cls: dict[str, float] = defaultdict(float)
    per_name: dict[str, float] = defaultdict(float)
    busy, end = 0.0, None
    for e in ks:
        cls = classify(e["name"]) if e["cat"] == "kernel" else "other kernels"
        per_cls[cls] += e["dur"]
        per_name[e["name"][:120]] += e["dur"]
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or s >= end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    us = 1e-3 / steps
    table = {k: round(v * us, 3) for k, v in sorted(per_cls.items(), key=lambda kv: -kv[1])}
    table["host gaps (GPU idle)"] = round((span - busy) * us, 3)
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:25]
    return dict(ms_per_step=table, gpu_span_ms_per_step=round(span * us, 3), gpu_busy_ms_per_step=round(busy * us, 3),
                top_kernels=[{"name": n, "ms_per_step": round(v * us, 3), "class": classify(n)} for n, v in top])


def _check_kernel_table() -> None:
    """The smoke run's check of the trace arithmetic on a made-up trace (2 steps, 10 us idle)."""
    ev = [dict(cat="kernel", name="nvjet_tst_128x256_gemm", ts=0, dur=30),
          dict(cat="kernel", name="_paged_decode_kernel", ts=20, dur=20),  # overlaps the GEMM by 10
          dict(cat="kernel", name="at::native::reduce_kernel<ArgMaxOps>", ts=50, dur=10),
          dict(cat="cpu_op", name="aten::mm", ts=0, dur=100)]
    path = os.path.join(tempfile.mkdtemp(prefix="step-profile-"), "t.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": ev}, f)
    t = kernel_table(path, 2)
    assert t["ms_per_step"] == {"gemm": 0.015, "attention": 0.01, "sampling": 0.005,
                                "host gaps (GPU idle)": 0.005}, t
    assert t["gpu_span_ms_per_step"] == 0.03 and t["gpu_busy_ms_per_step"] == 0.025, t


def roofline(runner, batch: int, ctx: float) -> dict:
    """Bytes and FLOPs of one decode step of ``batch`` requests at mean context ``ctx``."""
    model = runner.model
    # Decode gathers only the batch's embedding rows: the input embedding is left out (unless tied).
    read = [p for name, p in model.named_parameters()
            if not (name.endswith("embed_tokens.weight") and getattr(model, "lm_head", None) is not None)]
    weight_bytes = sum(p.numel() * p.element_size() for p in read)
    n_params = sum(p.numel() for p in read)
    kv_bytes = int(runner.kv_cache_config.bytes_per_token * batch * ctx)
    hf = runner.config.model_config.hf_config
    head_dim = getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    attn_flops = 4 * batch * ctx * hf.num_attention_heads * head_dim * hf.num_hidden_layers
    flops = 2 * n_params * batch + attn_flops
    mem_ms = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
    flop_ms = flops / DENSE_FLOPS_PER_S * 1e3
    return dict(weight_bytes=weight_bytes, kv_bytes=kv_bytes, flops=flops, bytes_ms=round(mem_ms, 3),
                flops_ms=round(flop_ms, 3), roofline_ms=round(max(mem_ms, flop_ms), 3),
                sum_ms=round(mem_ms + flop_ms, 3))


def device_profile(llm, steps: int, out_dir: str, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    eng = llm.llm_engine
    cuda = eng.engine_core.model_runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        wall = (time.perf_counter() - t0) / steps * 1e3
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"trace-{label}.json")
    prof.export_chrome_trace(path)
    res = kernel_table(path, steps)
    res["wall_ms_per_step_profiled"] = round(wall, 3)
    try:
        os.remove(path)  # large; the table keeps what matters
    except OSError:
        pass
    return res


def print_kernels(label: str, k: dict, roof: dict) -> None:
    print(f"\n{label}: kernel time per decode step (torch.profiler), GPU span {k.get('gpu_span_ms_per_step')} ms, "
          f"busy {k.get('gpu_busy_ms_per_step')} ms")
    for cls, ms in k.get("ms_per_step", {}).items():
        print(f"  {cls:<22} {ms:8.3f} ms")
    print(f"  roofline: weights {roof['weight_bytes'] / 1e9:.2f} GB + KV {roof['kv_bytes'] / 1e9:.2f} GB -> "
          f"{roof['bytes_ms']:.2f} ms at {HBM_BYTES_PER_S / 1e12:.2f} TB/s; {roof['flops'] / 1e12:.1f} TFLOP -> "
          f"{roof['flops_ms']:.2f} ms at {DENSE_FLOPS_PER_S / 1e12:.0f} TFLOP/s")
    for t in k.get("top_kernels", [])[:12]:
        print(f"    {t['ms_per_step']:8.3f} ms  [{t['class']}] {t['name'][:100]}")


def print_summary(res: dict) -> None:
    """One Markdown row per batch (the GPU run's headline)."""
    cols = ["gemm", "attention", "norm/act/rope", "sampling", "other kernels", "host gaps (GPU idle)"]
    print("\n| batch | context | running | ms/step | host ms (wall) | host ms (CPU) | "
          + " | ".join(cols) + " | roofline ms (bytes, FLOPs) |")
    print("|" + "---|" * (7 + len(cols)))
    for e in res["results"]:
        if "host" not in e:
            print(f"| {e['batch']} | - | - | {e.get('skipped', '')} |" + " |" * (3 + len(cols)))
            continue
        h, k, r = e["host"], e.get("kernels", {}).get("ms_per_step", {}), e.get("roofline")
        roof = f"{r['bytes_ms']}, {r['flops_ms']}" if r else "-"
        print(f"| {e['batch']} | {e['context']} | {e['max_running']} | {h['step_ms']} | {h['host_ms']} | "
              f"{h['host_cpu_ms']} | " + " | ".join(str(k.get(c, "-")) for c in cols) + f" | {roof} |")


# ---- driver ------------------------------------------------------------------------------

def make_llm(device: str, shape: dict, max_num_seqs: int, max_model_len: int, a) -> object:
    import transformers

    from kvserve import LLM

    tmp = tempfile.mkdtemp(prefix="step-profile-")
    path = os.path.join(tmp, "config")
    transformers.LlamaConfig(**shape).save_pretrained(path)
    kw = dict(model=path, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=max_num_seqs,
              max_model_len=max_model_len, disable_log_stats=True, async_scheduling=not a.no_async,
              enable_prefix_caching=False)
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if device == "cuda":
        kw.update(dtype="bfloat16", gpu_memory_utilization=a.gpu_memory_utilization, kv_cache_dtype=a.kv_cache_dtype)
    else:
        kw.update(dtype="float32", device="cpu", kv_cache_memory=a.kv_cache_memory, cpu_threads=1)
    return LLM(**kw)


def run(a) -> dict:
    device = "cpu" if a.cpu_smoke else a.device
    shape = TINY if device == "cpu" else LLAMA31_8B
    batches = sorted(a.batch)
    budget = a.max_num_batched_tokens or 8192

    def out_len(b: int, ctx: int) -> int:  # early requests decode while later ones prefill: still running after
        return a.steps * 3 + 16 + b * ctx // budget + 16

    max_len = a.context + out_len(max(batches), a.context) + 64
    llm = make_llm(device, shape, max(batches), max_len, a)
    eng = llm.llm_engine
    runner = eng.engine_core.model_runner
    timer = install_seams(llm)
    kv_tokens = min(g.num_blocks for g in runner.kv_cache_config.groups) * runner.block_size
    res = dict(device=device, shape="llama-3.1-8b" if shape is LLAMA31_8B else "tiny-llama", context=a.context,
               steps=a.steps, async_scheduling=eng.config.async_scheduling, kv_cache_dtype=a.kv_cache_dtype,
               kv_tokens=kv_tokens, torch=torch.__version__, results=[])
    graphs = getattr(runner.graph_runner, "sizes", None)
    if graphs:
        res["decode_graph_sizes"] = len(graphs)
    for b in batches:
        ctx = a.context
        if kv_tokens:  # shorten the context where the KV cache cannot hold b x context
            per_req = int(kv_tokens * 0.95) // b
            fit = per_req - out_len(b, min(a.context, per_req)) - runner.block_size
            if fit < 64:
                print(f"batch {b}: the KV cache ({kv_tokens} tokens) does not hold it; skipped")
                res["results"].append(dict(batch=b, skipped=f"KV cache holds {kv_tokens} tokens"))
                continue
            ctx = min(ctx, fit)
        timer.enabled = False
        ids = fill_batch(llm, b, ctx, out_len=out_len(b, ctx), seed=b)
        timer.enabled = True
        if a.skip_forward:
            with skip_prefill(runner, all_steps=True):
                host = host_profile(llm, timer, a.steps)
        else:
            host = host_profile(llm, timer, a.steps)
        label = f"batch {b} x {ctx} ({device})"
        print_host(label, host)
        entry = dict(batch=b, context=ctx, max_running=host["running"], host=host)
        if device == "cuda" or a.cpu_smoke:  # the smoke run walks this path too (no kernels on the CPU)
            timer.enabled = False
            k = device_profile(llm, a.profile_steps, a.out or tempfile.gettempdir(), f"b{b}")
            roof = roofline(runner, host["running"], ctx + a.steps * 1.5)
            print_kernels(label, k, roof)
            entry.update(kernels=k, roofline=roof)
            timer.enabled = True
        res["results"].append(entry)
        drain(llm, ids)
    timer.restore()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per request (shortened to fit the KV)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed per batch")
    ap.add_argument("--profile-steps", type=int, default=5, help="decode steps under torch.profiler (CUDA)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="CPU KV cache size")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-async", action="store_true", help="async scheduling off")
    ap.add_argument("--skip-forward", action="store_true",
                    help="CPU: decode steps skip the model too (zeros out): the host seams alone, quickly")
    ap.add_argument("--out", default=None, help="directory for step_profile.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks that the script runs")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.batch, a.context, a.steps, a.profile_steps = [8, 16], 40, 3, 2
        _check_kernel_table()
    res = run(a)
    print_summary(res)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "step_profile.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
