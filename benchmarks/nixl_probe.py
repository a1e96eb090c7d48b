"""NIXL READ between two processes on one GPU: which UCX transport, and GB/s.

A producer process registers a CUDA "cache" (``[2, blocks, 16, 8, 128]`` bf16 per layer, 2
layers) with a ``NixlAgent``; the consumer process (this one) registers its own and READs all
blocks, three times, timing the last two. Run with ``UCX_PROTO_INFO=y`` to see UCX's choice;
``UCX_TLS`` to restrict it. Usage: python3 benchmarks/nixl_probe.py [--blocks N] [--device cuda|cpu]
[--producer-device cuda:1] (the producer's cache on another GPU: a READ over the GPUs' link)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time

import torch


def _producer(conn, blocks: int, device: str) -> None:
    from kvserve.kv_connector.p2p.nixl_transport import NixlAgent

    caches = {i: torch.randn(2, blocks, 16, 8, 128, device=device).to(torch.bfloat16) for i in range(2)}
    agent = NixlAgent("probe-prod", caches)
    conn.send(agent.descriptor())
    conn.send([c.float().sum().item() for c in caches.values()])
    while not conn.poll(0):
        agent.progress()
        time.sleep(1e-4)
    conn.recv()
    agent.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--producer-device", default=None, help="The producer's device (default: --device), e.g. "
                                                            "cuda:1 to READ across two GPUs.")
    a = ap.parse_args()
    from kvserve.kv_connector.p2p.nixl_transport import NixlAgent

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_producer, args=(there, a.blocks, a.producer_device or a.device))
    p.start()
    desc, md = here.recv()
    sums = here.recv()
    caches = {i: torch.zeros(2, a.blocks, 16, 8, 128, device=a.device, dtype=torch.bfloat16) for i in range(2)}
    agent = NixlAgent("probe-cons", caches)
    ids = list(range(a.blocks))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        n = agent.read(desc, md, [(ids, ids)], [[0, 1]], threading.Event(), 60.0)
        times.append(time.perf_counter() - t)
    ok = [abs(c.float().sum().item() - s) < 1e-3 * max(1.0, abs(s)) for c, s in zip(caches.values(), sums)]
    print(f"nixl probe: {a.producer_device or a.device} -> {a.device}, {n / 1e9:.3f} GB per READ, GB/s {[round(n / x / 1e9, 2) for x in times[1:]]}, "
          f"data ok {all(ok)}", flush=True)
    here.send("done")
    p.join(30)
    agent.close()


if __name__ == "__main__":
    main()
