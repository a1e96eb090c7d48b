"""The custom all-reduce on two GPUs (``nvidia-h200-x2``) beside NCCL, in one call.

``--part allreduce``: latency per call of NCCL, the custom one-shot and two-shot kernels, and
torch's symmetric-memory ops (``torch.ops.symm_mem.one_shot_all_reduce`` /
``two_shot_all_reduce_``, when present), bf16 at 8 KB ... 4 MB, eager and replayed in a CUDA
graph (2 ranks, one process each); every result checked against NCCL's; and the fused
all-reduce + residual add + RMSNorm (one kernel) against NCCL + the fused add/norm kernel at
the 8B hidden size, 1 and 16 rows. Writes ``$OUT/allreduce.json``.

``--part tp``: Llama-3.1-8B shape, dummy bf16, batch-1 ms/token (128-token prompt, W2's
method) at TP=1, TP=2 with the custom all-reduce, TP=2 with NCCL only
(``KVSERVE_ALL_REDUCE=nccl``), each engine in its own process; greedy tokens of the two TP=2
runs compared. Writes ``$OUT/tp_ar.json``.

``--cpu-smoke``: tiny shapes on the CPU (gloo, no custom kernels), to check the script runs.
NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NCCL_NVLS_ENABLE=0``
are set in every process started here).

Usage (repo root): OUT=<dir> python3 benchmarks/gpu_all_reduce.py --part allreduce|tp [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 4 << 20]
SMOKE_SIZES = [8 << 10, 64 << 10]


# -- all-reduce latency ---------------------------------------------------------------------

def _time_eager(fn, iters: int, cuda: bool) -> float:
    """µs per call, back to back (the host's launch cost included)."""
    for _ in range(5):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _time_graph(fn, per_graph: int, replays: int) -> float:
    """µs per call replayed from one CUDA graph of ``per_graph`` calls (no launch cost)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * per_graph) * 1e6


class _Rows(list):
    """Rows also appended to a JSON-lines file as they come (a part cut at its limit keeps them)."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        if path:
            open(path, "w").close()

    def append(self, row) -> None:
        super().append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def _ar_rank(rank: int, world: int, port: int, smoke: bool, out_dir: str, q) -> None:
    import torch.distributed as dist

    from kvserve.distributed import custom_all_reduce as car

    cuda = not smoke
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.group.WORLD
    rows = _Rows(os.path.join(out_dir, "allreduce_rows.jsonl") if rank == 0 else None)
    c = None
    reason = car.unavailable_reason(dev, world)
    if reason is None:  # a buffer for the largest size: measured past the engine's cut-over
        c = car.CustomAllReduce(group, dev, max_bytes=max(SIZES))
    elif rank == 0:
        print("custom all-reduce unavailable:", reason, flush=True)
    torch_ops = {}
    if cuda:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(max(SIZES) // 2, dtype=torch.bfloat16, device=dev)
            symm_mem.rendezvous(buf, group)
            ops = torch.ops.symm_mem
            gname = group.group_name
            if hasattr(ops, "one_shot_all_reduce"):
                torch_ops["torch_one_shot"] = lambda x: ops.one_shot_all_reduce(buf[:x.numel()].copy_(x), "sum", gname)
            if hasattr(ops, "two_shot_all_reduce_"):
                def two(x):
                    b = buf[:x.numel()].copy_(x)
                    ops.two_shot_all_reduce_(b, "sum", gname)
                    return b
                torch_ops["torch_two_shot"] = two
        except Exception as e:  # noqa: BLE001 - reported, the rest still measured
            if rank == 0:
                print("torch symm_mem ops unavailable:", repr(e), flush=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = SMOKE_SIZES if smoke else SIZES
    srcs, refs = {}, {}
    for nbytes in sizes:
        g = torch.Generator(device=dev).manual_seed(rank)
        srcs[nbytes] = torch.randn(nbytes // dtype.itemsize, generator=g, device=dev).to(dtype)
        refs[nbytes] = srcs[nbytes].clone()
        dist.all_reduce(refs[nbytes])
    # Impl by impl (ours first, torch's ops last), so a failing one costs only its own rows.
    impls = {"nccl": lambda x: dist.all_reduce(x)}
    if c is not None:
        impls["custom_one_shot"] = lambda x: c.all_reduce(x, "one_shot")
        impls["custom_two_shot"] = lambda x: c.all_reduce(x, "two_shot")
    impls.update(torch_ops)
    for name, op in impls.items():
        if name.startswith("torch") and c is not None:
            for r in _fused_rows(c, dev):
                rows.append(r)
            _check_rows(c, rows)
        for nbytes in sizes:
            row = dict(impl=name, bytes=nbytes)
            x = srcs[nbytes].clone()
            fn = (lambda op=op, x=x: op(x))
            try:
                res = fn()
                res = x if res is None else res
                if cuda:
                    torch.cuda.synchronize()
                # fp32 single rounding vs NCCL: equal for 2 ranks (one add), close otherwise
                row["max_abs_diff_vs_nccl"] = float((res.float() - refs[nbytes].float()).abs().max())
                if c is not None and int(c.err.item()):
                    row["error"] = "barrier timed out"
                    rows.append(row)
                    break
                row["eager_us"] = round(_time_eager(fn, 20 if smoke else 100, cuda), 2)
                if cuda:
                    row["graph_us"] = round(_time_graph(fn, 50, 10), 2)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            rows.append(row)
    if c is not None and not torch_ops:
        for r in _fused_rows(c, dev):
            rows.append(r)
        _check_rows(c, rows)
    if rank == 0:
        q.put(list(rows))
    dist.barrier()
    dist.destroy_process_group()


def _check_rows(c, rows) -> None:
    try:
        c.check()
        rows.append(dict(impl="custom_barrier_errors", value=0))
    except RuntimeError as e:
        rows.append(dict(impl="custom_barrier_errors", value=1, error=str(e)))


def _fused_rows(c, dev) -> list[dict]:
    """Fused all-reduce + add + RMSNorm vs NCCL + the fused add/norm kernel, hidden 4096."""
    import torch.distributed as dist

    from kvserve.layers import fused

    out = []
    for t in (1, 16):
        g = torch.Generator(device=dev).manual_seed(c.rank + 10)
        x = torch.randn(t, 4096, generator=g, device=dev).to(torch.bfloat16)
        res = torch.randn(t, 4096, generator=torch.Generator(device=dev).manual_seed(3), device=dev).to(torch.bfloat16)
        w = (torch.randn(4096, generator=torch.Generator(device=dev).manual_seed(4), device=dev) * 0.1 + 1).to(torch.bfloat16)
        y = x.clone()

        def unfused():  # the model's unfused path: in-place NCCL on the matmul output, then add + norm
            dist.all_reduce(y)
            return fused.rms_norm(y, w, 1e-5, res)

        def fused_one():
            return c.all_reduce_add_rms_norm(x, res, w, 1e-5)

        want, want_res = unfused()
        got, got_res = fused_one()
        torch.cuda.synchronize()
        row = dict(impl="fused_add_rms_norm", rows=t, bytes=x.numel() * 2,
                   max_abs_diff_normed=float((got.float() - want.float()).abs().max()),
                   max_abs_diff_residual=float((got_res.float() - want_res.float()).abs().max()))
        for name, fn in (("unfused", unfused), ("fused", fused_one)):
            row[f"{name}_graph_us"] = round(_time_graph(fn, 50, 10), 2)
        out.append(row)
    return out


def part_allreduce(out_dir: str, smoke: bool) -> None:
    import torch.multiprocessing as mp

    from kvserve.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ar_rank, args=(r, 2, port, smoke, out_dir, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=300)
    for p in procs:
        p.join(60)
    env = _env(smoke)
    json.dump(dict(rows=rows, **env), open(os.path.join(out_dir, "allreduce.json"), "w"), indent=1)
    print("| impl | bytes | eager µs | graph µs | max diff vs NCCL |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "bytes" in r and "eager_us" in r:
            print(f"| {r['impl']} | {r['bytes']} | {r['eager_us']} | {r.get('graph_us', '-')} | "
                  f"{r['max_abs_diff_vs_nccl']} |")
        elif r["impl"] == "fused_add_rms_norm":
            print(f"| fused AR+add+RMSNorm rows={r['rows']} | {r['bytes']} | - | {r['fused_graph_us']} "
                  f"(unfused {r['unfused_graph_us']}) | {r['max_abs_diff_normed']} |")


# -- 8B batch-1 decode at TP=1 / TP=2 custom / TP=2 NCCL --------------------------------------

def _one_decode(path: str, tp: int, smoke: bool) -> dict:
    from kvserve import LLM, SamplingParams

    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory="8MiB") if smoke else dict(
        dtype="bfloat16", load_format="dummy", max_model_len=1024, kv_cache_memory="4GiB", max_num_seqs=8)
    t0 = time.perf_counter()
    llm = LLM(model=path, skip_tokenizer_init=True, tensor_parallel_size=tp, disable_log_stats=True, **kw)
    startup = time.perf_counter() - t0
    prompt = list(range(1, 129))
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    out_len = 16 if smoke else 256
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    eng = llm.llm_engine
    eng.add_request(None, prompt, sp)
    eng.step()  # the prefill
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stamps = [time.perf_counter()]
    while eng.has_unfinished_requests():
        eng.step()
        stamps.append(time.perf_counter())
    steps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])][8:-1] or [0.0]
    cfg = eng.config
    prof = _profile_decode(llm, prompt, 4 if smoke else 32) if os.environ.get("KVSERVE_TORCH_PROFILER_DIR") else None
    llm.shutdown()
    return dict(tp=tp, all_reduce=os.environ.get("KVSERVE_ALL_REDUCE", "custom") if tp > 1 else "-",
                ms_per_token=round(statistics.median(steps), 3), startup_s=round(startup, 1),
                executor=cfg.parallel_config.distributed_executor_backend, greedy_tokens=list(tokens),
                **({"profile": prof} if prof else {}))


#: kernel name pieces -> the bucket a decode step's device time is reported in (first match wins)
KERNEL_BUCKETS = (
    ("all-reduce", ("all_reduce", "allreduce", "nccl", "one_shot", "two_shot", "_ar_", "cross_device")),
    ("attention", ("attn", "attention", "decode_kernel", "_fwd_", "paged")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitk", "matmul", "_mm_", "int4pack", "cublas")),
    ("norm", ("norm",)),
    ("rotary", ("rotary", "rope")),
    ("sampling", ("argmax", "topk", "top_k", "softmax", "sample", "gumbel", "exponential")),
    ("copies", ("copy", "memcpy", "memset", "cat", "fill", "index")),
)


def _bucket(name: str) -> str:
    low = name.lower()
    for b, keys in KERNEL_BUCKETS:
        if any(k in low for k in keys):
            return b
    return "other"


def _profile_decode(llm, prompt: list[int], steps: int) -> list[dict]:
    """``steps`` batch-1 decode steps under torch.profiler on every rank: device ms per step by
    bucket, the top kernels (``LLM.start_profile`` / ``stop_profile``)."""
    from kvserve import SamplingParams

    eng = llm.llm_engine
    # Worker calls go between steps, none in flight: the profile spans the whole request, whose
    # one-token prompt makes its first step as small as a decode step.
    llm.start_profile()
    eng.add_request(None, prompt[:1], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    n = steps
    ranks = llm.stop_profile()
    out = []
    for r in ranks:
        # aten:: / cuda runtime rows are host-side ops whose device time is their kernels' again
        kern = [k for k in r["top"] if not k["name"].startswith(("aten::", "cuda", "Memcpy", "Memset"))
                or k["name"].startswith(("Memcpy", "Memset"))]
        by: dict[str, float] = {}
        for k in kern:
            by[_bucket(k["name"])] = by.get(_bucket(k["name"]), 0.0) + k["device_us"]
        out.append(dict(rank=r["rank"], steps=n, wall_ms_per_step=round(r["wall_ms"] / max(n, 1), 3),
                        device_ms_per_step={b: round(v / 1e3 / max(n, 1), 4) for b, v in sorted(by.items())},
                        top=[dict(k, us_per_step=round(k["device_us"] / max(n, 1), 2)) for k in kern[:15]]))
    return out


def part_tp(out_dir: str, tmp: str, smoke: bool, deadline: float) -> None:
    os.makedirs(tmp, exist_ok=True)
    if smoke:
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          architectures=["LlamaForCausalLM"])
        path = os.path.join(tmp, "tiny-llama")
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    else:
        from gpu_decode import LLAMA31_8B, _config_dir

        path = _config_dir(tmp, "llama-3.1-8b", LLAMA31_8B, "LlamaConfig")
    t_end = time.monotonic() + deadline
    rows = []
    # Custom first: the figure the target is about; NCCL next; TP=1 last.
    runs = ((2, "custom"), (2, "nccl"), (1, "custom"))
    for i, (tp, ar) in enumerate(runs):
        # Each later engine keeps ~35 s (an 8B start-up is ~25 s), so a hang costs one row.
        left = t_end - time.monotonic() - 35 * (len(runs) - 1 - i)
        if left < 20:
            rows.append(dict(tp=tp, all_reduce=ar, skipped="deadline"))
            continue
        f = os.path.join(tmp, f"tp{tp}_{ar}.json")
        env = dict(os.environ, KVSERVE_ALL_REDUCE=ar,
                   KVSERVE_TORCH_PROFILER_DIR=os.path.join(out_dir, f"profile_tp{tp}_{ar}"))
        cmd = [sys.executable, os.path.abspath(__file__), "--one-decode", path, "--tp", str(tp), "--json-out", f]
        if smoke:
            cmd.append("--cpu-smoke")
        try:
            r = subprocess.run(cmd, env=env, timeout=left, capture_output=True, text=True)
            if r.returncode == 0:
                rows.append(json.load(open(f)))
            else:
                rows.append(dict(tp=tp, all_reduce=ar, error=(r.stderr or r.stdout)[-1500:]))
        except subprocess.TimeoutExpired:
            rows.append(dict(tp=tp, all_reduce=ar, error="timed out"))
    by = {(r["tp"], r["all_reduce"]): r for r in rows}
    a, b = by.get((2, "custom"), {}), by.get((2, "nccl"), {})
    summary = {}
    if "greedy_tokens" in a and "greedy_tokens" in b:
        ta, tb = a["greedy_tokens"], b["greedy_tokens"]
        summary["tp2_custom_vs_nccl_tokens_equal"] = ta == tb
        summary["tp2_custom_vs_nccl_common_prefix"] = next((i for i, (u, v) in enumerate(zip(ta, tb)) if u != v),
                                                           min(len(ta), len(tb)))
    t1 = next((r for r in rows if r.get("tp") == 1 and "ms_per_token" in r), None)
    for r in rows:
        if t1 and "ms_per_token" in r and r["tp"] == 2:
            r["vs_tp1"] = round(r["ms_per_token"] / t1["ms_per_token"], 3) if t1["ms_per_token"] else None
    json.dump(dict(rows=rows, **summary, **_env(smoke)), open(os.path.join(out_dir, "tp_ar.json"), "w"), indent=1)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("greedy_tokens", "profile")}), flush=True)
        for pr in r.get("profile", []):
            print(f"  TP={r['tp']} {r['all_reduce']} rank {pr['rank']}: device ms/step {pr['device_ms_per_step']}, "
                  f"wall {pr['wall_ms_per_step']} ms/step", flush=True)
    print(json.dumps(summary))
    print("| config | ms/token | vs TP=1 | start-up s |")
    print("|---|---|---|---|")
    for r in rows:
        name = f"TP={r['tp']}" + (f" {r['all_reduce']}" if r["tp"] > 1 else "")
        print(f"| {name} | {r.get('ms_per_token', r.get('error', r.get('skipped', '?'))[:60])} | "
              f"{r.get('vs_tp1', '-')} | {r.get('startup_s', '-')} |")


def _env(smoke: bool) -> dict:
    import triton

    return dict(device=torch.cuda.get_device_name() if not smoke else "cpu", torch=torch.__version__,
                triton=triton.__version__, commit=os.environ.get("KVSERVE_COMMIT") or _git(),
                cpu_smoke=smoke, command=" ".join([sys.executable] + sys.argv))


def _git() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["allreduce", "tp"], help="what to measure")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-ar")
    ap.add_argument("--deadline", type=float, default=140, help="seconds for --part tp (all three engines)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (gloo), to check the script")
    ap.add_argument("--one-decode", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one_decode:
        json.dump(_one_decode(a.one_decode, a.tp, a.cpu_smoke), open(a.json_out, "w"))
        return
    if not a.part:
        ap.error("--part is required")
    os.makedirs(a.out, exist_ok=True)
    if a.part == "allreduce":
        part_allreduce(a.out, a.cpu_smoke)
    else:
        part_tp(a.out, a.tmp, a.cpu_smoke, a.deadline)


if __name__ == "__main__":
    main()
