"""Tensor parallelism on two GPUs (``nvidia-h200-x2``): tensor parallelism beside one GPU, in one call.

Measured, each printed as a JSON line and written to ``$OUT/tp_bench.json``:
- the ceilings: device-to-device copy bandwidth on GPU 0, NCCL all-reduce bus bandwidth over
  both GPUs (``torch.distributed``, 64 MiB bf16, bus bw = 2 (n-1)/n * bytes / time);
- Llama-3.1-8B shape, dummy bf16: W2 (batch-1 ms/token, 128-token prompt) and a W1-style
  throughput (256 requests) at TP=1 and TP=2 (mp executor), and TP=2 through a one-node Ray
  cluster started here (skipped without Ray);
- Llama-3.1-70B shape, dummy bf16, TP=2: KV capacity, batch-1 ms/token next to its roofline
  (weight bytes per GPU / measured copy bandwidth), decode throughput at batch 64.
Usage (repo root): OUT=<dir> python3 benchmarks/gpu_tensor_parallel.py [--skip-70b] [--skip-ray] [--skip-w1]

``--pp`` measures pipeline parallelism instead (part ``pp``, ``$OUT/pp_bench.json``): the 8B shape at
PP=2, TP=2 and TP=1, each engine in its own process: batch-1 ms/token and batch-64 tok/s.
``--cpu-smoke`` runs that at a toy shape on the CPU (checks the script, no figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode import LLAMA31_8B, _config_dir, decode_latency  # noqa: E402
from gpu_equality import env  # noqa: E402

LLAMA31_70B = dict(LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GPU 0)."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (time.perf_counter() - t0)


def _allreduce_rank(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(32 * 2**20, dtype=torch.bfloat16, device="cuda")  # 64 MiB
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 20
    if rank == 0:
        q.put(2 * (2 - 1) / 2 * x.numel() * 2 / dt)
    dist.destroy_process_group()


def allreduce_bus_bandwidth() -> float:
    import torch.multiprocessing as mp

    from kvserve.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    bw = q.get(timeout=120)
    for p in procs:
        p.join(60)
    return bw


def w2(path: str, tp: int, executor: str | None = None, **kw) -> dict:
    from kvserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096,
              tensor_parallel_size=tp, distributed_executor_backend=executor, disable_log_stats=True, **kw)
    startup = time.perf_counter() - t0
    decode_latency(llm, 128, 16, 1)
    ms = statistics.median(decode_latency(llm, 128, 256, 1)[8:])
    b64 = statistics.median(decode_latency(llm, 128, 64, 64)[4:])
    cfg = llm.llm_engine.config
    out = dict(tp=tp, executor=cfg.parallel_config.distributed_executor_backend, w2_ms_per_token=round(ms, 3),
               b64_ms_per_step=round(b64, 3), b64_tok_per_s=round(64 / b64 * 1e3, 1),
               kv_blocks_per_rank=cfg.cache_config.num_blocks, startup_s=round(startup, 1))
    llm.shutdown()
    return out


def w1(path: str, tp: int) -> dict:
    import numpy as np

    from kvserve import LLM, SamplingParams

    rng = np.random.default_rng(0)
    ins, outs = rng.integers(100, 1025, 256), rng.integers(100, 1025, 256)
    prompts = [rng.integers(0, 10000, n).tolist() for n in ins]
    params = [SamplingParams(temperature=0.6, max_tokens=int(n), ignore_eos=True) for n in outs]
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096,
              tensor_parallel_size=tp, gpu_memory_utilization=0.9, disable_log_stats=True)
    llm.generate([list(range(100))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in res)
    llm.shutdown()
    return dict(tp=tp, w1_output_tok_per_s=round(n / wall, 1), wall_s=round(wall, 2))


SMOKE = dict(vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, architectures=["LlamaForCausalLM"])


def decode_rate(llm, prompt_len: int, out_len: int, batch: int, vocab: int = 10000) -> tuple[float, float]:
    """``(ms per token of one request, output tok/s)`` while ``batch`` requests decode, from
    token counts over wall time: under pipeline parallelism an engine step returns one
    micro-batch (or nothing while the queue fills), so step intervals are not token times."""
    from kvserve import SamplingParams

    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    sp = SamplingParams(temperature=0, max_tokens=out_len * 4 + 64, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    ids = [eng.add_request(None, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), sp)
           for _ in range(batch)]
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        eng.step()  # prefill
    assert len(sched.running) == batch, (len(sched.running), batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    n0 = sum(r.num_output_tokens for r in sched.running)
    t0 = time.perf_counter()
    while sum(r.num_output_tokens for r in sched.running) - n0 < out_len * batch:
        eng.step()
    dt = time.perf_counter() - t0
    n = sum(r.num_output_tokens for r in sched.running) - n0
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return dt / (n / batch) * 1e3, n / dt


def pp_point(path: str, pp: int, tp: int, smoke: bool) -> dict:
    """One engine (this process): batch-1 ms/token and batch-64 decode tok/s at ``pp`` x ``tp``."""
    from kvserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model=path, load_format="dummy", dtype="float32" if smoke else "bfloat16", skip_tokenizer_init=True,
              max_model_len=512 if smoke else 4096, pipeline_parallel_size=pp, tensor_parallel_size=tp,
              kv_cache_memory="16MiB" if smoke else "16GiB", device="cpu" if smoke else "cuda",
              disable_log_stats=True)
    startup = time.perf_counter() - t0
    n1, nb, b = (8, 4, 8) if smoke else (64, 16, 64)
    plen = 16 if smoke else 128
    decode_rate(llm, plen, 4, 1)  # warm-up (kernels, first-step costs)
    ms1, _ = decode_rate(llm, plen, n1, 1)
    msb, tps = decode_rate(llm, plen, nb, b)
    cfg = llm.llm_engine.config
    out = dict(pp=pp, tp=tp, executor=cfg.parallel_config.distributed_executor_backend,
               batch1_ms_per_token=round(ms1, 3), batch=b, batch_ms_per_token=round(msb, 3),
               batch_tok_per_s=round(tps, 1), kv_blocks=cfg.cache_config.num_blocks, startup_s=round(startup, 1))
    llm.shutdown()
    return out


def pp_main(a) -> None:
    """PP=2 vs TP=2 vs TP=1, each in a child process (one engine per process, GPUs released between)."""
    e = {"device": "cpu-smoke"} if a.cpu_smoke else env()
    big = a.model == "70b"
    shape = SMOKE if a.cpu_smoke else LLAMA31_70B if big else LLAMA31_8B
    name = "smoke" if a.cpu_smoke else "llama-3.1-70b" if big else "llama-3.1-8b"
    path = _config_dir(a.tmp, name, shape, "LlamaConfig")
    recs = []
    # 70B's 141 GB of bf16 weights need both GPUs: PP=2 vs TP=2 only
    for pp, tp in ((2, 1), (1, 2)) if big else ((2, 1), (1, 2), (1, 1)):
        cmd = [sys.executable, __file__, "--one", f"{pp},{tp},{path}"] + (["--cpu-smoke"] if a.cpu_smoke else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.point_timeout)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        rec = json.loads(lines[-1]) if r.returncode == 0 and lines else \
            dict(pp=pp, tp=tp, error=(r.stderr or r.stdout)[-2000:])
        recs.append({"name": "smoke_pp" if a.cpu_smoke else f"{a.model}_pp", **rec, **e})
        if big and "batch1_ms_per_token" in rec:  # next to the weight-read floor of one GPU's half
            rec["floor_ms"] = recs[-1]["floor_ms"] = round(70.55e9 * 2 / 2 / 4.29e12 * 1e3, 3)
        json.dump(recs, open(os.path.join(a.out, "pp_bench.json"), "w"), indent=1)
        print(json.dumps({k: v for k, v in recs[-1].items() if k not in e}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-tp")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--skip-w1", action="store_true", help="No W1-style throughput rows (a shorter call).")
    ap.add_argument("--pp", action="store_true", help="Pipeline parallel only: 8B shape PP=2 vs TP=2 vs TP=1.")
    ap.add_argument("--model", choices=("8b", "70b"), default="8b", help="--pp: the Llama-3.1 shape.")
    ap.add_argument("--cpu-smoke", action="store_true", help="--pp at a toy shape on the CPU (checks the script).")
    ap.add_argument("--point-timeout", type=float, default=200, help="Seconds per --pp engine process.")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "pp,tp,path": one --pp engine, printed as JSON
    a = ap.parse_args()
    os.makedirs(a.tmp, exist_ok=True)
    if a.one:
        pp, tp, path = a.one.split(",", 2)
        print(json.dumps(pp_point(path, int(pp), int(tp), a.cpu_smoke)), flush=True)
        return
    if a.pp or a.cpu_smoke:
        os.makedirs(a.out, exist_ok=True)
        return pp_main(a)
    e, recs = env(), []

    def emit(name: str, r: dict) -> None:
        recs.append({"name": name, **r, **e})
        json.dump(recs, open(os.path.join(a.out, "tp_bench.json"), "w"), indent=1)
        print(json.dumps({"name": name, **r}), flush=True)

    copy_bw = copy_bandwidth()
    emit("copy_bandwidth", dict(bytes_per_s=round(copy_bw)))
    emit("nccl_allreduce_bus_bandwidth", dict(bytes_per_s=round(allreduce_bus_bandwidth())))
    p8 = _config_dir(a.tmp, "llama-3.1-8b", LLAMA31_8B, "LlamaConfig")
    for tp in (1, 2):
        emit("8b_decode", w2(p8, tp, kv_cache_memory="16GiB"))
    if not a.skip_ray:
        try:
            import ray  # noqa: F401

            emit("8b_decode_ray", w2(p8, 2, "ray", kv_cache_memory="16GiB"))
        except ImportError:
            print("ray not installed: skipped")
    for tp in () if a.skip_w1 else (1, 2):
        emit("8b_w1", w1(p8, tp))
    if not a.skip_70b:
        p70 = _config_dir(a.tmp, "llama-3.1-70b", LLAMA31_70B, "LlamaConfig")
        r = w2(p70, 2, gpu_memory_utilization=0.92)
        weight_bytes_per_gpu = 70.55e9 * 2 / 2
        # copy_bw is bytes read + written per second, the memory's rate: reading the weights once takes
        # weight bytes / copy_bw (the first call, commit e94ac0c, doubled it: 33.4 ms instead of 16.7)
        r["roofline_ms"] = round(weight_bytes_per_gpu / copy_bw * 1e3, 3)
        emit("70b_decode_tp2", r)


if __name__ == "__main__":
    main()
