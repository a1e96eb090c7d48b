"""Soak test of a running ``kvserve serve``: steady streaming load for N minutes while sampling
the server's resident memory and KV-cache usage.

    python benchmarks/load/soak.py --minutes 10 --base-url http://127.0.0.1:8000 [--api-key KEY] [--pid PID]

* ``--concurrency`` clients loop on streaming completions / chat completions (``ignore_eos``,
  ``--max-tokens`` tokens each); every 10th request hangs up mid-stream on purpose.
* Every ``--sample-s`` seconds it records the API process's RSS
  (``process_resident_memory_bytes`` from ``/metrics``), with ``--pid`` the RSS of that
  process and all its children (engine core included, via psutil), and the engine gauges.
* It prints one table row per sample, then a verdict. Exit status 1 if, after the warm-up
  (the first ``--warmup-frac`` of the run), RSS grew by more than ``--max-rss-growth-pct``
  percent (last-quarter median vs. first post-warm-up median), if any request failed with
  5xx / a transport error, if nothing was streamed at all, or if the engine is not idle
  (running = waiting = KV usage = 0) within 30 s after the load stops.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Optional


def _metric(text: str, name: str) -> Optional[float]:
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def _tree_rss(pid: int) -> Optional[int]:
    try:
        import psutil
    except ImportError:
        return None
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send (default: none: the server's)")
    p.add_argument("--pid", type=int, default=None, help="server PID: also sample RSS of it + children (psutil)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--warmup-frac", type=float, default=0.3)
    p.add_argument("--max-rss-growth-pct", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def soak(ns: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    duration = ns.minutes * 60.0
    t_start = time.monotonic()
    t_end = t_start + duration
    rng = random.Random(ns.seed)
    counts = {"ok": 0, "hangup": 0, "429": 0, "4xx": 0, "5xx": 0, "transport": 0, "tokens": 0}
    samples: list[dict] = []

    async def client(c: httpx.AsyncClient, k: int) -> None:
        i = 0
        while time.monotonic() < t_end:
            i += 1
            chat = rng.random() < 0.5
            hang = i % 10 == 0
            body = {"max_tokens": ns.max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.8}
            if ns.model:
                body["model"] = ns.model
            words = " ".join(rng.choice(["cache", "block", "token", "page", "prefix", "decode"])
                             for _ in range(rng.randint(4, 60)))
            if chat:
                body["messages"] = [{"role": "user", "content": f"Client {k} #{i}: {words}"}]
            else:
                body["prompt"] = f"Client {k} #{i}: {words}"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            try:
                async with c.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        key = "429" if r.status_code == 429 else ("5xx" if r.status_code >= 500 else "4xx")
                        counts[key] += 1
                        await asyncio.sleep(0.5)
                        continue
                    n = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            n += 1
                            counts["tokens"] += 1
                            if '"error"' in line:
                                counts["5xx"] += 1
                            if hang and n >= 3:
                                break
                    counts["hangup" if hang else "ok"] += 1
            except httpx.HTTPError:
                counts["transport"] += 1
                await asyncio.sleep(0.5)

    async def sampler(c: httpx.AsyncClient) -> None:
        while True:
            try:
                text = (await c.get("/metrics")).text
            except httpx.HTTPError:
                text = ""
            samples.append({
                "t": time.monotonic() - t_start,
                "api_rss": _metric(text, "process_resident_memory_bytes"),
                "tree_rss": _tree_rss(ns.pid) if ns.pid else None,
                "running": _metric(text, "kvserve:num_requests_running"),
                "waiting": _metric(text, "kvserve:num_requests_waiting"),
                "kv": _metric(text, "kvserve:kv_cache_usage_perc"),
                "done": dict(counts),
            })
            if time.monotonic() >= t_end:
                return
            await asyncio.sleep(ns.sample_s)

    limits = httpx.Limits(max_connections=ns.concurrency + 4)
    async with httpx.AsyncClient(base_url=ns.base_url, headers=headers, timeout=120, limits=limits) as c:
        clients = [asyncio.create_task(client(c, k)) for k in range(ns.concurrency)]
        await sampler(c)
        # Time is up: requests still streaming are hung up on (one more disconnect test).
        for t in clients:
            t.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        # After the load: the engine must drain to idle.
        idle, deadline = False, time.monotonic() + 30
        final = ""
        while time.monotonic() < deadline:
            final = (await c.get("/metrics")).text
            if (_metric(final, "kvserve:num_requests_running") == 0 and _metric(final, "kvserve:num_requests_waiting") == 0
                    and _metric(final, "kvserve:kv_cache_usage_perc") == 0):
                idle = True
                break
            await asyncio.sleep(0.2)
    return {"samples": samples, "counts": counts, "idle_after": idle, "elapsed": time.monotonic() - t_start}


def _growth(samples: list[dict], key: str, warmup_frac: float, duration: float) -> Optional[tuple[float, float, float]]:
    """(baseline, end, growth %): median of the first quarter after warm-up vs. the last quarter."""
    post = [s[key] for s in samples if s["t"] >= warmup_frac * duration and s[key] is not None]
    if len(post) < 4:
        return None
    q = max(1, len(post) // 4)
    base, end = statistics.median(post[:q]), statistics.median(post[-q:])
    return base, end, 100.0 * (end - base) / base


def report(ns: argparse.Namespace, res: dict) -> int:
    mib = 1024 * 1024
    print(f"{'t_s':>6} {'api_rss_MiB':>11} {'tree_rss_MiB':>12} {'running':>7} {'waiting':>7} {'kv_%':>6} "
          f"{'done':>6} {'hangup':>6} {'chunks':>7} {'429':>4} {'5xx':>4}")
    for s in res["samples"]:
        d = s["done"]
        fmt = lambda v, scale=1.0, spec=".1f": "-" if v is None else format(v / scale, spec)  # noqa: E731
        print(f"{s['t']:6.1f} {fmt(s['api_rss'], mib):>11} {fmt(s['tree_rss'], mib):>12} "
              f"{fmt(s['running'], 1, '.0f'):>7} {fmt(s['waiting'], 1, '.0f'):>7} {fmt(s['kv'], 0.01):>6} "
              f"{d['ok']:6d} {d['hangup']:6d} {d['tokens']:7d} {d['429']:4d} {d['5xx']:4d}")
    c = res["counts"]
    duration = ns.minutes * 60.0
    fails = []
    for key in ("api_rss", "tree_rss"):
        g = _growth(res["samples"], key, ns.warmup_frac, duration)
        if g is None:
            continue
        base, end, pct = g
        print(f"{key}: {base / mib:.1f} MiB after warm-up -> {end / mib:.1f} MiB at the end ({pct:+.1f}%, "
              f"limit {ns.max_rss_growth_pct:.0f}%)")
        if pct > ns.max_rss_growth_pct:
            fails.append(f"{key} grew {pct:.1f}%")
    print(f"requests: {c['ok']} completed, {c['hangup']} hung up on purpose, {c['429']} got 429, "
          f"{c['4xx']} other 4xx, {c['5xx']} 5xx/error events, {c['transport']} transport errors; "
          f"{c['tokens']} streamed chunks in {res['elapsed']:.0f} s; idle afterwards: {res['idle_after']}")
    if c["5xx"] or c["transport"]:
        fails.append("5xx or transport errors")
    if c["tokens"] == 0:
        fails.append("no progress: nothing was streamed")
    if not res["idle_after"]:
        fails.append("engine not idle after the load")
    print("SOAK " + ("FAIL: " + "; ".join(fails) if fails else "PASS"))
    return 1 if fails else 0


def main(argv=None) -> int:
    ns = parse_args(argv)
    return report(ns, asyncio.run(soak(ns)))


if __name__ == "__main__":
    sys.exit(main())
