"""Soak of ``kvserve serve`` at a fixed request rate with a hostile mix, and the checks that
show nothing leaks over a long run.

    python benchmarks/load/soak_gpu.py --duration 540 --out DIR                 # GPU, 8B shape
    python benchmarks/load/soak_gpu.py --cpu-smoke --out DIR                    # 60 s, tiny model, CPU
    python benchmarks/load/soak_gpu.py --base-url http://127.0.0.1:8000 --pid PID --rate 8 --duration 600

Without ``--base-url`` it starts its own server: Llama-3.1-8B shape (``--shape llama31-8b``,
dummy bf16 weights, no tokenizer) or the tiny one; ``--serve-args`` adds flags (e.g.
``"--kv-cache-dtype fp8_e4m3"``, a speculative config). Phases:

1. Calibration (``--rate auto``): a closed loop of ``--calib-concurrency`` clients on the same
   mix for ``--calib-s`` seconds; the sustained rate is the completions per second, and the
   soak runs at ``--load-frac`` (0.8) of it.
2. The soak: Poisson arrivals at that rate for ``--duration`` seconds. Each request streams
   token ids (``--stream-frac`` of them; the rest are unary) with prompts of random tokens:
   ``--long-frac`` long (``--long-len``), the rest short (``--short-len``); ``--prefix-frac``
   of them start with one of ``--num-prefixes`` shared prefixes (``--prefix-len``); output
   ``--output-len`` tokens, ``ignore_eos``. ``--disconnect-frac`` of the streams hang up
   after a random number of chunks and ``--abort-frac`` of the requests are cancelled by the
   client before their first token. Long prompts at this rate keep the KV cache full, so
   the scheduler preempts.
3. Drain: after the last arrival, wait for every request, then for the engine to go idle.

Every ``--sample-s`` seconds it records ``/metrics`` (running, waiting, KV cache usage,
preemptions, CPU-tier usage when there is one), the server's RSS (process tree, psutil) and
the GPU's used memory (nvidia-smi). Checks (``checks`` in the JSON; exit status 1 when one
fails): every request completed or was aborted by its client (``lost == 0``); after the
drain the engine is idle and the KV cache usage (and CPU tier's in-flight blocks) back to
0 (``leaked blocks``); RSS and GPU memory after the warm-up (first ``--warmup-frac``) flat
within ``--rss-bound-mib`` / ``--gpu-bound-mib``; p99 TTFT and TPOT of the last
``--window-s`` within ``--drift`` (10%) of the first window after the warm-up (reported,
not failing, with ``--cpu-smoke``: a shared CPU's noise is larger than the bound).

Writes ``soak.json`` (settings, server command, samples, per-window latencies, checks) and,
with matplotlib, ``soak.png`` (RSS, GPU memory, KV usage and p99 TTFT over time) into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

SHAPES = {
    "llama31-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2),
    "tiny": dict(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kvserve_soak", help="output directory")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="60 s on the CPU with the tiny model (sizes scaled down; drift reported only)")
    p.add_argument("--base-url", default=None, help="a running server (else one is started)")
    p.add_argument("--pid", type=int, default=None, help="the running server's PID (RSS of its process tree)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama31-8b")
    p.add_argument("--serve-args", default="", help="more `kvserve serve` flags for the started server")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--duration", type=float, default=540.0, help="seconds of arrivals")
    p.add_argument("--rate", default="auto", help="requests/s, or auto: --load-frac of the calibrated rate")
    p.add_argument("--load-frac", type=float, default=0.8)
    p.add_argument("--calib-s", type=float, default=45.0)
    p.add_argument("--calib-concurrency", type=int, default=64)
    p.add_argument("--short-len", default="64:512", help="LO:HI prompt tokens of short prompts")
    p.add_argument("--long-len", default="2048:6144", help="LO:HI prompt tokens of long prompts")
    p.add_argument("--long-frac", type=float, default=0.15)
    p.add_argument("--output-len", default="32:256", help="LO:HI output tokens")
    p.add_argument("--prefix-frac", type=float, default=0.3)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--stream-frac", type=float, default=0.9)
    p.add_argument("--disconnect-frac", type=float, default=0.1)
    p.add_argument("--abort-frac", type=float, default=0.05)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--warmup-frac", type=float, default=0.15)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--drift", type=float, default=0.10)
    p.add_argument("--rss-bound-mib", type=float, default=256.0)
    p.add_argument("--gpu-bound-mib", type=float, default=512.0)
    p.add_argument("--idle-timeout", type=float, default=90.0)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    if ns.cpu_smoke:
        smoke = dict(shape="tiny", duration=60.0, calib_s=8.0, calib_concurrency=4, short_len="8:48",
                     long_len="300:480", long_frac=0.3, output_len="4:24", prefix_len=64, max_model_len=512, sample_s=2.0,
                     window_s=15.0, rss_bound_mib=128.0)
        for k, v in smoke.items():
            if getattr(ns, k) == p.get_default(k):
                setattr(ns, k, v)
    return ns


def _span(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(":"))
    return lo, hi


def metric(text: str, name: str) -> Optional[float]:
    """Sum of the samples of ``name`` in Prometheus text (None when absent)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except ValueError:
                pass
    return total if found else None


def tree_rss_mib(pid: Optional[int]) -> Optional[float]:
    if pid is None:
        return None
    try:
        import psutil

        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20
    except Exception:  # noqa: BLE001 - psutil missing or the process gone
        return None


def gpu_used_mib() -> Optional[float]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def p99(xs: list[float]) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


class Mix:
    """Draws requests: prompt token ids, output length, stream, hang-up and abort choices."""

    def __init__(self, ns, vocab: int) -> None:
        self.ns, self.rng = ns, random.Random(ns.seed)
        self.vocab = min(vocab, 32000)
        self.prefixes = [[self.rng.randrange(3, self.vocab) for _ in range(ns.prefix_len)]
                         for _ in range(ns.num_prefixes)]

    def draw(self) -> dict:
        ns, r = self.ns, self.rng
        lo, hi = _span(ns.long_len if r.random() < ns.long_frac else ns.short_len)
        n = r.randint(lo, hi)
        prompt = []
        if r.random() < ns.prefix_frac:
            prompt = list(r.choice(self.prefixes))
        prompt += [r.randrange(3, self.vocab) for _ in range(max(1, n - len(prompt)))]
        prompt = prompt[: ns.max_model_len - _span(ns.output_len)[1] - 1]
        stream = r.random() < ns.stream_frac
        return dict(prompt=prompt, max_tokens=r.randint(*_span(ns.output_len)), stream=stream,
                    hang_up_after=r.randint(1, 8) if stream and r.random() < ns.disconnect_frac else None,
                    abort_s=r.uniform(0.0, 0.05) if r.random() < ns.abort_frac else None)


async def one_request(client, url: str, model: str, req: dict, t0: float) -> dict:
    """Send one request; returns its record (``outcome``: completed | client_abort | failed)."""
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "ignore_eos": True,
            "temperature": 0.0, "stream": req["stream"]}
    rec = dict(start=time.monotonic() - t0, prompt_len=len(req["prompt"]), ttft=None, tpot=None, outcome="failed",
               error=None)
    start = time.monotonic()

    async def run() -> None:
        if not req["stream"]:
            r = await client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            n = r.json()["usage"]["completion_tokens"]
            rec["ttft"] = time.monotonic() - start
            rec["outcome"] = "completed" if n == req["max_tokens"] else "failed"
            return
        times = []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = str(obj["error"])[:200]
                    return
                if obj.get("choices"):
                    times.append(time.monotonic())
                    if req["hang_up_after"] is not None and len(times) >= req["hang_up_after"]:
                        rec["outcome"] = "client_abort"  # hang up mid-stream
                        return
            if times:
                rec["ttft"] = times[0] - start
                if len(times) > 1:
                    rec["tpot"] = (times[-1] - times[0]) / (len(times) - 1)
            rec["outcome"] = "completed" if done else "failed"
            if not done:
                rec["error"] = "stream ended without [DONE]"

    task = asyncio.ensure_future(run())
    try:
        if req["abort_s"] is not None:
            done, _ = await asyncio.wait({task}, timeout=req["abort_s"])
            if not done:
                task.cancel()
                rec["outcome"] = "client_abort"
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return rec
        await task
    except Exception as exc:  # noqa: BLE001 - a transport failure is a lost request
        rec["outcome"], rec["error"] = "failed", f"{type(exc).__name__}: {exc}"[:200]
    rec["latency"] = time.monotonic() - start
    return rec


async def sampler(client, url: str, pid, t0: float, samples: list, stop: asyncio.Event, every: float) -> None:
    while True:
        s = dict(t=time.monotonic() - t0, rss_mib=tree_rss_mib(pid), gpu_mib=gpu_used_mib())
        try:
            text = (await client.get(url + "/metrics", timeout=10)).text
            for k, name in (("running", "kvserve:num_requests_running"), ("waiting", "kvserve:num_requests_waiting"),
                            ("kv_usage", "kvserve:kv_cache_usage_perc"), ("preemptions", "kvserve:num_preemptions_total"),
                            ("tier_usage", "kvserve:kv_tier_cpu_usage_perc"),
                            ("frontend", "kvserve:frontend_unfinished_requests"),
                            ("server_rss_mib", "process_resident_memory_bytes")):
                s[k] = metric(text, name)
            if s["server_rss_mib"] is not None:
                s["server_rss_mib"] /= 2**20
        except Exception as exc:  # noqa: BLE001
            s["error"] = f"{type(exc).__name__}"
        samples.append(s)
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def calibrate(client, url, model, mix: Mix, ns) -> float:
    """Completions per second of a closed loop of ``calib_concurrency`` clients (no aborts)."""
    end = time.monotonic() + ns.calib_s
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < end:
            req = dict(mix.draw(), hang_up_after=None, abort_s=None)
            rec = await one_request(client, url, model, req, 0.0)
            if rec["outcome"] == "completed":
                done += 1

    t = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(ns.calib_concurrency)))
    return done / (time.monotonic() - t)


async def soak(ns, url: str, pid) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        info = (await client.get(url + "/v1/models")).json()["data"][0]
        model = info["id"]
        mix = Mix(ns, SHAPES[ns.shape]["vocab_size"])
        calibrated = None
        if ns.rate == "auto":
            calibrated = await calibrate(client, url, model, mix, ns)
            rate = max(0.2, ns.load_frac * calibrated)
        else:
            rate = float(ns.rate)
        print(f"soak: {ns.duration:.0f} s at {rate:.2f} req/s"
              + (f" ({ns.load_frac:.0%} of the calibrated {calibrated:.2f} req/s)" if calibrated else ""), flush=True)
        samples: list = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        samp = asyncio.ensure_future(sampler(client, url, pid, t0, samples, stop, ns.sample_s))
        rng = random.Random(ns.seed + 1)
        tasks = []
        t_next = 0.0
        while t_next < ns.duration:
            delay = t0 + t_next - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one_request(client, url, model, mix.draw(), t0)))
            t_next += rng.expovariate(rate)
        records = await asyncio.gather(*tasks)
        t_load = time.monotonic() - t0
        # Drain: the engine goes idle and the KV cache empties.
        idle, end = None, time.monotonic() + ns.idle_timeout
        while time.monotonic() < end:
            text = (await client.get(url + "/metrics")).text
            idle = {k: metric(text, n) for k, n in (("running", "kvserve:num_requests_running"),
                                                   ("waiting", "kvserve:num_requests_waiting"),
                                                   ("kv_usage", "kvserve:kv_cache_usage_perc"),
                                                   ("frontend", "kvserve:frontend_unfinished_requests"))}
            if not any(v for v in idle.values() if v is not None):
                break
            await asyncio.sleep(1.0)
        stop.set()
        await samp
    return dict(rate=rate, calibrated_rate=calibrated, load_s=t_load, records=records, samples=samples, idle=idle)


def analyse(ns, res: dict) -> dict:
    recs, samples = res["records"], res["samples"]
    outcomes = {k: sum(r["outcome"] == k for r in recs) for k in ("completed", "client_abort", "failed")}
    warm = ns.warmup_frac * ns.duration
    first = (warm, warm + ns.window_s)
    last = (ns.duration - ns.window_s, ns.duration)

    def window(lo, hi, key):
        return [r[key] for r in recs if r["outcome"] == "completed" and r[key] is not None and lo <= r["start"] < hi]

    lat = {}
    for key in ("ttft", "tpot"):
        a, b = p99(window(*first, key)), p99(window(*last, key))
        lat[key] = dict(first_p99=a, last_p99=b, ratio=(b / a if a and b else None),
                        all_p50=statistics.median([r[key] for r in recs if r.get(key)] or [0]))
    # Per window: the p99s beside the window's mix (long prompts drive TPOT's tail), so a
    # first-vs-last difference can be told apart from a trend.
    long_lo = _span(ns.long_len)[0]
    windows = []
    t = 0.0
    while t < ns.duration:
        done = [r for r in recs if r["outcome"] == "completed" and t <= r["start"] < t + ns.window_s]
        windows.append(dict(start_s=t, completed=len(done), long=sum(r.get("prompt_len", 0) >= long_lo for r in done),
                            p99_ttft=p99([r["ttft"] for r in done if r["ttft"] is not None]),
                            p99_tpot=p99([r["tpot"] for r in done if r["tpot"] is not None])))
        t += ns.window_s
    after = [s for s in samples if s["t"] >= warm]

    def growth(key):
        xs = [s[key] for s in after if s.get(key) is not None]
        if len(xs) < 4:
            return None
        q = max(1, len(xs) // 4)
        return statistics.median(xs[-q:]) - statistics.median(xs[:q])

    rss_g, gpu_g = growth("rss_mib") if any(s.get("rss_mib") for s in after) else growth("server_rss_mib"), \
        growth("gpu_mib")
    idle = res["idle"] or {}
    tier_end = samples[-1].get("tier_usage") if samples else None
    checks = {
        "no_lost_requests": outcomes["failed"] == 0,
        "idle_and_no_leaked_blocks": bool(idle) and not any(v for v in idle.values() if v is not None),
        "rss_flat": rss_g is None or rss_g <= ns.rss_bound_mib,
        "gpu_memory_flat": gpu_g is None or gpu_g <= ns.gpu_bound_mib,
    }
    for key in ("ttft", "tpot"):
        r = lat[key]["ratio"]
        checks[f"p99_{key}_drift"] = r is None or r <= 1.0 + ns.drift
    hard = [k for k in checks if not (ns.cpu_smoke and k.startswith("p99_"))]
    errors = sorted({r["error"] for r in recs if r["outcome"] == "failed" and r["error"]})[:10]
    return dict(outcomes=outcomes, requests=len(recs), latency=lat, windows=windows, rss_growth_mib=rss_g, gpu_growth_mib=gpu_g,
                idle_after_drain=idle, tier_usage_end=tier_end, checks=checks,
                passed=all(checks[k] for k in hard), failing_errors=errors,
                preemptions=(samples[-1].get("preemptions") if samples else None))


def write_config(shape: str) -> str:
    import transformers

    d = os.path.join(tempfile.mkdtemp(prefix="kvserve_soak_"), shape)
    transformers.LlamaConfig(**SHAPES[shape]).save_pretrained(d)
    return d


def start_server(ns) -> tuple[subprocess.Popen, str, list[str], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = write_config(ns.shape)
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model, "--load-format", "dummy",
           "--skip-tokenizer-init", "--max-model-len", str(ns.max_model_len), "--port", str(port),
           "--disable-access-log", "--uvicorn-log-level", "warning", "--shutdown-timeout", "10"]
    if ns.cpu_smoke:
        # 2048 tokens of KV for 16 sequences of up to 504 tokens: the long prompts preempt.
        cmd += ["--dtype", "float32", "--kv-cache-memory", "1MiB", "--max-num-seqs", "16"]
    else:
        cmd += ["--dtype", "bfloat16"]
    cmd += ns.serve_args.split()
    os.makedirs(ns.out, exist_ok=True)
    log_path = os.path.join(ns.out, "server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    end = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"the server did not start within 600 s; see {log_path}")
        time.sleep(1)
    return proc, url, cmd, log_path


def stop_server(proc: subprocess.Popen) -> Optional[int]:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait(30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.wait(10)


def plot(ns, res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s = res["samples"]
    fig, ax = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    t = [x["t"] for x in s]
    for a, key, label in ((ax[0], "rss_mib", "server RSS (MiB)"), (ax[1], "gpu_mib", "GPU used (MiB)"),
                          (ax[2], "kv_usage", "KV cache usage")):
        a.plot(t, [x.get(key) if x.get(key) is not None else float("nan") for x in s])
        a.set_ylabel(label)
    done = sorted((r["start"], r["ttft"]) for r in res["records"] if r["outcome"] == "completed" and r["ttft"])
    ax[3].scatter([d[0] for d in done], [d[1] for d in done], s=2)
    ax[3].set_ylabel("TTFT (s)")
    ax[3].set_xlabel("seconds")
    fig.suptitle(f"soak {ns.shape}: {res['rate']:.2f} req/s for {ns.duration:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ns = parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    proc, cmd, log_path = None, None, None
    url, pid = ns.base_url, ns.pid
    if url is None:
        proc, url, cmd, log_path = start_server(ns)
        pid = proc.pid
    try:
        res = asyncio.run(soak(ns, url, pid))
    finally:
        rc = stop_server(proc) if proc is not None else None
    summary = analyse(ns, res)
    summary["server_exit_status"] = rc
    out = dict(settings=vars(ns), server_command=cmd, rate=res["rate"], calibrated_rate=res["calibrated_rate"],
               load_s=res["load_s"], **summary, samples=res["samples"])
    with open(os.path.join(ns.out, "soak.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(ns.out, "soak_requests.json"), "w") as f:
        json.dump(res["records"], f)
    plot(ns, res, os.path.join(ns.out, "soak.png"))
    lat = summary["latency"]
    print("| check | value | pass |\n|--|--|--|")
    print(f"| requests | {summary['requests']} ({summary['outcomes']}) | {summary['checks']['no_lost_requests']} |")
    print(f"| idle after drain | {summary['idle_after_drain']} | {summary['checks']['idle_and_no_leaked_blocks']} |")
    print(f"| RSS growth MiB | {summary['rss_growth_mib']} | {summary['checks']['rss_flat']} |")
    print(f"| GPU growth MiB | {summary['gpu_growth_mib']} | {summary['checks']['gpu_memory_flat']} |")
    for k in ("ttft", "tpot"):
        print(f"| p99 {k} first/last window (s) | {lat[k]['first_p99']} / {lat[k]['last_p99']} "
              f"(x{lat[k]['ratio']}) | {summary['checks'][f'p99_{k}_drift']} |")
    print(f"| rate req/s | {res['rate']:.2f} (calibrated {res['calibrated_rate']}) | |")
    print(f"| preemptions | {summary['preemptions']} | |")
    if summary["failing_errors"]:
        print("errors:", summary["failing_errors"])
    print("PASS" if summary["passed"] else "FAIL")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
