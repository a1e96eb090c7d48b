"""Disaggregated prefill/decode vs colocated replicas on the same GPUs, behind ``kvserve router``.

Two deployments, one after the other, each started by ``kvserve
launch`` on this machine's GPUs (one GPU per worker, ``--worker-gpus auto``):

- ``pd``: ``--prefill 1 --decode 1`` (``P2PKVConnector``, ``--kv-transport nixl``: the decode
  worker READs the prompt's KV from the prefill worker's GPU);
- ``colocated``: ``--prefill 0 --decode 0 --replicas 2`` (data parallelism).

Both serve the Llama-3.1-8B shape with dummy bf16 weights and no tokenizer (token-id prompts),
routed ``least_loaded``. One mixed workload (``--long-frac`` of the requests are long
prompts with short outputs, the rest chats; random token ids, random order, seed 0) is sent
through ``kvserve bench serve`` at each ``--rates`` (Poisson arrivals, ``--burstiness``,
``--duration`` seconds of arrivals per rate; the same requests in the same order for both
deployments). Per rate: goodput (requests/s meeting every SLO) and SLO attainment (share of
requests meeting it) under two SLOs fixed before the run (``--slo``: the target TTFT <= 1 s,
TPOT <= 25 ms; ``--tight-slo``: TTFT <= 1 s, TPOT <= 15 ms), TTFT/TPOT/ITL percentiles, and
from ``/metrics`` the router's phase latencies (prefill leg, decode leg's first token: the time
from prefill done to the first decode token) and the decode worker's KV pulls (bytes, seconds:
GB/s). Ceilings measured in the same call: device-to-device copy on GPU 0, GPU 0 -> GPU 1 peer
copy, NCCL all-reduce bus bandwidth.

Usage (repo root, a machine with 2 GPUs; server wheels on PYTHONPATH):
    python3 benchmarks/pd_goodput.py --out $OUT [--rates 6,12,18,24] [--duration 20] [--modes pd,colocated]
    python3 benchmarks/pd_goodput.py --cpu-smoke --out /tmp/pdg   # tiny model on the CPU, tcp/nixl DRAM
    four GPUs: --modes pd-1x3,pd-2x2,colocated-4 (a mode per split; see ``launch_args``)
Writes ``$OUT/pd_goodput.json`` (env, commands, ceilings, one record per mode x rate) and the
bench JSON per run; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, max_position_embeddings=4096, architectures=["LlamaForCausalLM"])


def make_workload(path: str, n: int, long_frac: float, long_in: tuple[int, int], long_out: tuple[int, int],
                  chat_in: tuple[int, int], chat_out: tuple[int, int], vocab: int, seed: int = 0) -> dict:
    """``n`` requests as JSONL (``{"prompt": [ids], "output_len": k}``) in random order; returns counts."""
    rng = random.Random(seed)
    kinds = {"long": 0, "chat": 0}
    with open(path, "w") as f:
        for _ in range(n):
            long = rng.random() < long_frac
            lo_hi_in, lo_hi_out = (long_in, long_out) if long else (chat_in, chat_out)
            kinds["long" if long else "chat"] += 1
            ids = [rng.randrange(vocab) for _ in range(rng.randint(*lo_hi_in))]
            f.write(json.dumps({"prompt": ids, "output_len": rng.randint(*lo_hi_out)}) + "\n")
    return kinds


def _peer_copy(src: int, dst: int) -> float:
    """GPU ``src`` -> GPU ``dst`` copy of 1 GiB, bytes per second."""
    import torch

    x = torch.empty(2**30, dtype=torch.uint8, device=f"cuda:{src}")
    y = torch.empty(2**30, dtype=torch.uint8, device=f"cuda:{dst}")
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    bw = x.numel() * 10 / (time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return bw


def ceilings() -> dict:
    """Copy and link ceilings of this machine's GPUs (bytes per second): device copy on GPU 0, the
    peer copy of every ordered pair of GPUs, NCCL all-reduce over the first two."""
    import torch

    from gpu_tensor_parallel import allreduce_bus_bandwidth, copy_bandwidth

    out = {"d2d_copy_bytes_per_s": copy_bandwidth()}
    n = torch.cuda.device_count()
    if n >= 2:
        out["peer_copy_bytes_per_s"] = _peer_copy(0, 1)
        out["peer_access"] = torch.cuda.can_device_access_peer(0, 1)
        if n > 2:
            out["peer_copy_pairs_bytes_per_s"] = {f"{i}->{j}": round(_peer_copy(i, j)) for i in range(n)
                                                  for j in range(n) if i != j}
        out["nccl_allreduce_bus_bytes_per_s"] = allreduce_bus_bandwidth()
    return out


def scrape(url: str) -> dict[str, float]:
    """Prometheus text of ``url/metrics`` as {name{labels}: value}, plus {name: sum over its labels}."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, val = line.rpartition(" ")
            try:
                v = float(val)
            except ValueError:
                continue
            out[name] = v
            if "{" in name:
                base = name.split("{", 1)[0]
                out[base] = out.get(base, 0.0) + v
    return out


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def phase_means(after: dict, before: dict) -> dict:
    """Mean seconds of each router phase between two scrapes."""
    out = {}
    for phase in ("prefill", "transfer_wait", "decode_first_token", "total"):
        k = f'kvserve_router:phase_latency_seconds_{{}}{{{{phase="{phase}"}}}}'
        n = _delta(after, before, k.format("count"))
        if n:
            out[phase] = {"count": int(n), "mean_ms": round(1e3 * _delta(after, before, k.format("sum")) / n, 2)}
    return out


def transfer_stats(after: dict, before: dict) -> dict:
    """KV pulls between two scrapes of one worker: count, bytes, seconds, GB/s of the whole pulls."""
    b = _delta(after, before, "kvserve:kv_transfer_bytes_total")
    s = _delta(after, before, "kvserve:kv_transfer_seconds_sum")
    n = _delta(after, before, "kvserve:kv_transfer_seconds_count")  # one observation per step's pulls
    return {"pulls": int(_delta(after, before, "kvserve:kv_transfer_requests_total")), "bytes": int(b), "seconds": round(s, 4), "mean_pull_ms": round(1e3 * s / n, 3) if n else None,
            "gb_per_s": round(b / s / 1e9, 2) if s else None,
            "failures": int(_delta(after, before, "kvserve:kv_transfer_failures_total"))}


def slo_stats(per_request: list[dict], slo: dict[str, float], duration: float) -> dict:
    """Goodput (req/s) and attainment of one SLO over a run's per-request records (times in s)."""
    def ok(r: dict) -> bool:
        if not r.get("success", True):
            return False
        return all(r.get(f"{k}_s") is None or r[f"{k}_s"] * 1e3 <= ms for k, ms in slo.items())

    met = sum(ok(r) for r in per_request)
    return {"slo_ms": slo, "met": met, "attainment": round(met / max(len(per_request), 1), 4),
            "goodput_req_per_s": round(met / duration, 3) if duration else None}


def launch_args(mode: str, transport: str) -> list[str]:
    """``kvserve launch`` flags of a mode: ``pd`` (1 prefill + 1 decode), ``pd-PxD`` (P prefill + D
    decode workers, e.g. ``pd-1x3``), ``colocated`` (2 replicas) or ``colocated-N`` (N replicas).
    Raises ValueError for another name."""
    kind, _, size = mode.partition("-")
    if kind == "pd":
        p, _, d = (size or "1x1").partition("x")
        return ["--prefill", str(int(p)), "--decode", str(int(d)), "--kv-transport", transport]
    if kind == "colocated":
        return ["--prefill", "0", "--decode", "0", "--replicas", str(int(size or 2))]
    raise ValueError(f"unknown mode {mode!r}: pd, pd-PxD, colocated or colocated-N")


def sum_transfers(stats: list[dict]) -> dict:
    """One record for the KV pulls of several decode workers (GB/s: all bytes over all pull seconds)."""
    if len(stats) == 1:
        return stats[0]
    keys = ("pulls", "bytes", "failures")
    out: dict = {k: sum(s[k] for s in stats) for k in keys}
    secs = sum(s["seconds"] for s in stats)
    out["seconds"] = round(secs, 4)
    out["gb_per_s"] = round(out["bytes"] / secs / 1e9, 2) if secs else None
    out["per_worker_gb_per_s"] = [s["gb_per_s"] for s in stats]
    return out


class Deployment:
    """``kvserve launch`` in its own process group; ``stop()`` is SIGTERM, then SIGKILL."""

    def __init__(self, args: list[str], log: str, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "launch", *args, "--port", str(port)]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"not ready within {timeout:.0f} s")

    def workers(self) -> list[dict]:
        import httpx

        return httpx.get(self.url + "/workers", timeout=10).json()["workers"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def bench(url: str, data: str, n: int, rate: float, burstiness: float, save: str, slo: str, warmups: int,
          timeout: float) -> dict:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "serve", "--base-url", url,
           "--dataset", "jsonl", "--dataset-path", data, "--num-prompts", str(n), "--request-rate", str(rate),
           "--burstiness", str(burstiness), "--goodput", *slo.split(), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--num-warmups", str(warmups), "--save-result", save,
           "--save-detailed", "--disable-tqdm"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"bench serve failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    with open(save) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--modes", default="pd,colocated", help="pd, pd-PxD, colocated, colocated-N (comma-separated).")
    ap.add_argument("--rates", default="6,12,18,24", help="Request rates, req/s.")
    ap.add_argument("--duration", type=float, default=20.0, help="Seconds of arrivals per rate.")
    ap.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of inter-arrival times (1: Poisson).")
    ap.add_argument("--long-frac", type=float, default=0.25)
    ap.add_argument("--long-in", default="4096:8192")
    ap.add_argument("--long-out", default="16:64")
    ap.add_argument("--chat-in", default="128:1024")
    ap.add_argument("--chat-out", default="128:512")
    ap.add_argument("--slo", default="ttft:1000 tpot:25")
    ap.add_argument("--tight-slo", default="ttft:1000 tpot:15")
    ap.add_argument("--transport", default="nixl", choices=("tcp", "nixl"))
    ap.add_argument("--engine-args", default="", help="More flags for every worker.")
    ap.add_argument("--deadline", type=float, default=540.0, help="Seconds for the whole script; rates are skipped "
                                                                  "to stay inside it.")
    ap.add_argument("--cpu-smoke", action="store_true", help="Tiny random model on the CPU (a dry run).")
    a = ap.parse_args()
    t_start = time.monotonic()
    os.makedirs(a.out, exist_ok=True)
    rng_pair = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    rates = [float(r) for r in a.rates.split(",")]
    modes = a.modes.split(",")
    tmp = tempfile.mkdtemp(prefix="kvserve-pdg-")
    if a.cpu_smoke:
        import transformers

        model = os.path.join(tmp, "tiny")
        transformers.LlamaConfig(**TINY).save_pretrained(model)
        vocab, max_len = TINY["vocab_size"], 2048
        engine = ["--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "1024"]
        for k in ("long_in", "long_out", "chat_in", "chat_out"):
            lo, hi = rng_pair(getattr(a, k))
            setattr(a, k, f"{max(1, lo // 16)}:{max(2, hi // 16)}")
    else:
        from gpu_decode import LLAMA31_8B, _config_dir

        model = _config_dir(tmp, "llama31-8b", LLAMA31_8B, "LlamaConfig")
        vocab, max_len = 10000, 8192 + 1024
        engine = []
    engine = [model, "--load-format", "dummy", "--dtype", "bfloat16", "--skip-tokenizer-init",
              "--max-model-len", str(max_len), *engine,
              *a.engine_args.split()]
    # One file per rate (seed = its index): no prompt repeats across rates, so neither deployment
    # gets prefix-cache hits from an earlier rate's requests; both deployments get the same file.
    data, kinds = {}, {}
    for ri, rate in enumerate(rates):
        data[rate] = os.path.join(tmp, f"mixed_r{ri}.jsonl")
        kinds[f"{rate:g}"] = make_workload(data[rate], int(rate * a.duration) + 1, a.long_frac, rng_pair(a.long_in),
                                           rng_pair(a.long_out), rng_pair(a.chat_in), rng_pair(a.chat_out), vocab,
                                           seed=ri)
    warm = os.path.join(tmp, "warm.jsonl")
    make_workload(warm, 8, 0.5, rng_pair(a.long_in), (4, 8), rng_pair(a.chat_in), (4, 8), vocab, seed=1000)
    result: dict = {"command": " ".join([sys.executable] + sys.argv), "engine_args": engine[1:],
                    "workload": {"long_chat_per_rate": kinds, "long_in": a.long_in, "long_out": a.long_out,
                                 "chat_in": a.chat_in, "chat_out": a.chat_out, "long_frac": a.long_frac,
                                 "duration_s": a.duration, "burstiness": a.burstiness},
                    "slos": {"target": a.slo, "tight": a.tight_slo}, "runs": []}
    if not a.cpu_smoke:
        from gpu_equality import env

        result["env"] = env()
        result["ceilings"] = ceilings()
        print(json.dumps({"ceilings": result["ceilings"]}), flush=True)
    json_path = os.path.join(a.out, "pd_goodput.json")
    port = 18000
    for mi, mode in enumerate(modes):
        launch = launch_args(mode, a.transport)
        launch += ["--policy", "least_loaded", "--log-dir", os.path.join(a.out, f"workers_{mode}"), *engine]
        dep = Deployment(launch, os.path.join(a.out, f"launch_{mode}.txt"), port + mi)
        rec_mode = {"mode": mode, "launch": dep.cmd[3:]}
        try:
            rec_mode["ready_s"] = round(dep.wait_ready(300 if not a.cpu_smoke else 180), 1)
            workers = dep.workers()
            rec_mode["workers"] = [{k: w.get(k) for k in ("url", "pool")} for w in workers]
            bench(dep.url, warm, 8, float("inf"), 1.0, os.path.join(tmp, f"warm_{mode}.json"), a.slo, 0, 300)
            for ri, rate in enumerate(rates):
                left = a.deadline - (time.monotonic() - t_start)
                # what this mode's remaining rates may use, leaving the later modes their share
                share = left / (len(modes) - mi) if ri == 0 else left - (len(modes) - mi - 1) * 60
                if share < a.duration + 30:
                    print(json.dumps({"mode": mode, "rate": rate, "skipped": "deadline"}), flush=True)
                    continue
                n = int(rate * a.duration) + 1
                before = {w["url"]: scrape(w["url"]) for w in workers}
                r_before = scrape(dep.url)
                # per-request detail (every ITL) runs to MBs per rate: keep it out of the results
                save = os.path.join(tmp, f"bench_{mode}_r{rate:g}.json")
                res = bench(dep.url, data[rate], n, rate, a.burstiness, save, a.slo, 0, max(60.0, share))
                after = {w["url"]: scrape(w["url"]) for w in workers}
                r_after = scrape(dep.url)
                run = res["runs"][0]
                per = run.get("per_request", [])
                rec = {"mode": mode, "rate": rate, "requests": n, "completed": run["completed"],
                       "failed": run["failed"], "duration_s": round(run["duration_s"], 2),
                       "output_tok_per_s": round(run["output_throughput"], 1),
                       "target_slo": slo_stats(per, _slo(a.slo), run["duration_s"]),
                       "tight_slo": slo_stats(per, _slo(a.tight_slo), run["duration_s"]),
                       **{k: round(run[k], 2) for k in sorted(run) if k.endswith("_ms")
                          and isinstance(run[k], (int, float))
                          and any(k.startswith(p) for p in ("mean_", "median_", "p90_", "p99_"))},
                       "phases": phase_means(r_after, r_before),
                       "transfers": {"decode": sum_transfers([transfer_stats(after[w["url"]], before[w["url"]])
                                                              for w in workers if w["pool"] == "decode"])}}
                result["runs"].append(rec)
                print(json.dumps(rec), flush=True)
                with open(json_path, "w") as f:
                    json.dump(result, f, indent=1)
        except Exception as exc:  # keep what ran; say what broke
            rec_mode["error"] = repr(exc)
            print(json.dumps({"mode": mode, "error": repr(exc)}), flush=True)
        finally:
            dep.stop()
        result.setdefault("modes", []).append(rec_mode)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    print_table(result)


def _slo(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (kv.split(":") for kv in text.split())}


def print_table(result: dict) -> None:
    print("\n| mode | rate | ok/sent | goodput target SLO (attain.) | goodput tight SLO (attain.) | TTFT p50/p99 ms "
          "| TPOT p50/p99 ms | ITL p99 ms | prefill leg / prefill done -> first decode token ms | KV pull GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        ph = r.get("phases", {})
        tr = r.get("transfers", {}).get("decode", {})
        print(f"| {r['mode']} | {r['rate']:g} | {r['completed']}/{r['requests']} "
              f"| {r['target_slo']['goodput_req_per_s']} ({r['target_slo']['attainment']:.0%}) "
              f"| {r['tight_slo']['goodput_req_per_s']} ({r['tight_slo']['attainment']:.0%}) "
              f"| {r.get('median_ttft_ms')}/{r.get('p99_ttft_ms')} | {r.get('median_tpot_ms')}/{r.get('p99_tpot_ms')} "
              f"| {r.get('p99_itl_ms')} | {ph.get('prefill', {}).get('mean_ms', '-')} / "
              f"{ph.get('transfer_wait', {}).get('mean_ms', '-')} | {tr.get('gb_per_s', '-')} |")


if __name__ == "__main__":
    main()
