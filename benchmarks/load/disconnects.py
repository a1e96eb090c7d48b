"""Many clients hanging up at random points against a running ``kvserve serve``: before the
first token, mid-stream, during a non-streamed request, or never (the request completes).
Afterwards the server must hold nothing (the caller checks ``/metrics``).

    python benchmarks/load/disconnects.py --base-url http://127.0.0.1:8000 [--api-key KEY] [--clients 200]

Each client sends one completion or chat completion of 8 tokens (``ignore_eos``,
temperature 0.8); the plan of client i is drawn from ``random.Random(--seed)``: 30% hang up
before the first token (after 0-0.5 s), 55% after 1-6 stream events, 8% during a non-streamed
request (after 0-1.5 s), 7% read to the end. Prints the outcome counts and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

C, CH = "/v1/completions", "/v1/chat/completions"


def plans(n: int, seed: int = 1234) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            out.append(("before_first_token", rng.uniform(0.0, 0.5)))
        elif r < 0.85:
            out.append(("mid_stream", rng.randint(1, 6)))
        elif r < 0.93:
            out.append(("non_stream", rng.uniform(0.0, 1.5)))
        else:
            out.append(("complete", 0))
    return out


def run(base_url: str, api_key: str | None = None, clients: int = 200, seed: int = 1234) -> dict[str, int]:
    """Run ``clients`` concurrent clients; {outcome: count}. AssertionError on a non-200 stream."""
    import httpx

    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outcome: dict[str, int] = {}

    async def one(c: httpx.AsyncClient, i: int, plan) -> None:
        kind, arg = plan
        chat = i % 4 == 1
        body = {"max_tokens": 8, "ignore_eos": True, "stream": kind != "non_stream", "temperature": 0.8}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me about item {i}."}]
        else:
            body["prompt"] = f"Item {i} is"
        path = CH if chat else C

        async def go():
            if kind == "non_stream":
                await c.post(path, json=body)
                return
            async with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200, await r.aread()
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if kind == "mid_stream" and seen >= arg:
                            return  # leaving the block closes the connection mid-stream
            outcome["completed"] = outcome.get("completed", 0) + 1

        if kind in ("before_first_token", "non_stream"):
            try:
                await asyncio.wait_for(go(), timeout=arg)
                outcome["finished_before_hangup"] = outcome.get("finished_before_hangup", 0) + 1
            except asyncio.TimeoutError:
                outcome[kind] = outcome.get(kind, 0) + 1
        else:
            await go()
            if kind == "mid_stream":
                outcome[kind] = outcome.get(kind, 0) + 1

    async def main():
        limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, headers=auth, timeout=120, limits=limits) as c:
            await asyncio.gather(*(one(c, i, p) for i, p in enumerate(plans(clients, seed))))

    asyncio.run(main())
    return outcome


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    ns = p.parse_args(argv)
    t0 = time.monotonic()
    outcome = run(ns.base_url, ns.api_key, ns.clients, ns.seed)
    print(f"RELIABILITY disconnects clients={ns.clients} outcomes={outcome} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
