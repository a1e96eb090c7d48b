"""Disaggregated prefill/decode on one GPU: KV transfer cost of ``P2PKVConnector``.

A producer and a consumer engine in one process (the Llama-3.1-8B shape, dummy bf16 weights,
``--enforce-eager``), ``--transport tcp`` (loopback TCP between host memory) or ``nixl`` (NIXL
READs cache to cache; UCX picks the wire: run with ``UCX_PROTO_INFO=y`` to see it). Per prompt
length: the producer's prefill (prompt KV + first token), the consumer's time to its first
token with the KV pulled from the producer (the transfer + one token computed) beside the
consumer computing the prompt itself, the bytes moved and the pull's GB/s (the whole pull:
connect, handshake, transfer, release). The ceilings measured in the same run: pinned
device-to-host copy, device-to-device copy (bytes copied per second) and a loopback TCP socket
between two threads.

Usage (repo root): python3 benchmarks/pd_transfer.py --out $OUT [--transport nixl] [--cpu-smoke];
``python3 benchmarks/pd_transfer.py --ucx-summary LOG``: the UCX transports of the remote-memory
READs in the log of a run made with ``UCX_PROTO_INFO=y``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode import LLAMA31_8B, _config_dir  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=32000, max_position_embeddings=4096)


def tcp_loopback_bw(nbytes: int = 1 << 30) -> float:
    """Bytes per second through one loopback TCP connection (sender and receiver threads)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    chunk = bytearray(8 << 20)

    def send():
        with socket.create_connection(("127.0.0.1", port)) as c:
            left = nbytes
            while left > 0:
                n = min(left, len(chunk))
                c.sendall(memoryview(chunk)[:n])
                left -= n

    t = threading.Thread(target=send)
    conn, _ = srv.accept() if False else (None, None)
    t.start()
    conn, _ = srv.accept()
    buf = bytearray(8 << 20)
    got, t0 = 0, time.perf_counter()
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    dt = time.perf_counter() - t0
    t.join()
    conn.close()
    srv.close()
    return got / dt


def d2h_bw() -> float | None:
    if not torch.cuda.is_available():
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize()
    return 5 * x.numel() / (time.perf_counter() - t0)


def d2d_bw() -> float | None:
    """Bytes per second of a 1 GiB device-to-device copy on the current GPU."""
    if not torch.cuda.is_available():
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 10 * x.numel() / (time.perf_counter() - t0)


def ucx_read_summary(log_path: str) -> list[str]:
    """From a ``UCX_PROTO_INFO=y`` log, the distinct ``remote memory read`` protocols and
    their per-size-range ``description: transport/device`` choices (what a NIXL READ used)."""
    import re

    out, op, rows = [], None, []
    row = re.compile(r"^\|\s*([0-9][^|]*?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|$")

    def flush():
        if op and "remote memory read" in op:
            line = f"{op}: " + "; ".join(f"{r} {d} {c}" for r, d, c in rows)
            if line not in out:
                out.append(line)

    for raw in open(log_path, errors="replace"):
        text = re.sub(r"^\[[^]]*\] \[[^]]*\]\s*", "", raw.rstrip())
        if re.search(r"cfg#\d+", text):
            flush()
            op, rows = None, []
        elif op is None and text.startswith("|") and "Range" not in text and text.count("|") == 2:
            op = text.strip("| ").strip()
        elif op is not None and (m := row.match(text)):
            rows.append(m.groups())
    flush()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--lens", default="1024,4096,8192")
    ap.add_argument("--transport", choices=["tcp", "nixl"], default="tcp")
    ap.add_argument("--ucx-summary", metavar="LOG", help="print the UCX READ transports in LOG and exit")
    a = ap.parse_args()
    if a.ucx_summary:
        print("\n".join(ucx_read_summary(a.ucx_summary)) or "no 'remote memory read' in the UCX_PROTO_INFO log")
        return
    from kvserve import LLM, SamplingParams

    smoke = a.cpu_smoke
    lens = [64, 200] if smoke else [int(x) for x in a.lens.split(",")]
    os.makedirs(a.out, exist_ok=True)
    recs = []

    def add(r):
        recs.append(r)
        print(json.dumps(r), flush=True)
        json.dump(recs, open(os.path.join(a.out, f"pd_transfer_{a.transport}.json"), "w"), indent=1)

    add(dict(part="ceilings", transport=a.transport,
             tcp_loopback_GBps=round(tcp_loopback_bw(1 << 28 if smoke else 1 << 30) / 1e9, 2),
             d2h_pinned_GBps=round((d2h_bw() or 0) / 1e9, 2), d2d_copy_GBps=round((d2d_bw() or 0) / 1e9, 2)))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        path = _config_dir(tmp, "m", TINY if smoke else LLAMA31_8B, "LlamaConfig")
        common = dict(model=path, load_format="dummy", dtype="float32" if smoke else "bfloat16",
                      skip_tokenizer_init=True, max_model_len=max(lens) + 64, enforce_eager=True,
                      disable_log_stats=True, kv_cache_memory="64MiB" if smoke else "12GiB")

        def role(r):
            return {"kv_connector": "P2PKVConnector", "kv_role": r,
                    "kv_connector_extra_config": {"kv_port": 0, "transport": a.transport}}

        prod = LLM(kv_transfer_config=role("kv_producer"), **common)
        cons = LLM(kv_transfer_config=role("kv_consumer"), enable_prefix_caching=False, **common)
        g = torch.Generator().manual_seed(0)
        greedy = dict(temperature=0, ignore_eos=True)
        warm = torch.randint(3, 20000, (64,), generator=g).tolist()
        prod.generate([warm], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        cons.generate([warm], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        wstats = cons.llm_engine.engine_core.scheduler.connector.get_stats
        # The consumer's NIXL agent (in-process worker): the READs alone, without the control.
        agent = getattr(cons.llm_engine.engine_core.model_runner.kv_connector.worker, "nixl", None)
        for L in lens:
            for rep in range(3):
                ids = torch.randint(3, 20000, (L,), generator=g).tolist()
                t0 = time.perf_counter()
                out = prod.generate([ids], SamplingParams(max_tokens=1, extra_args={
                    "kv_transfer_params": {"do_remote_decode": True}}, **greedy), use_tqdm=False)[0]
                t_prefill = time.perf_counter() - t0
                params = out.kv_transfer_params
                s0 = dict(wstats())
                r0 = (agent.read_bytes, agent.read_seconds) if agent is not None else (0, 0.0)
                t0 = time.perf_counter()
                got = cons.generate([ids], SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params},
                                                          **greedy), use_tqdm=False)[0]
                t_pull = time.perf_counter() - t0
                s1 = dict(wstats())
                rb, rs = (agent.read_bytes - r0[0], agent.read_seconds - r0[1]) if agent is not None else (0, 0.0)
                t0 = time.perf_counter()
                own = cons.generate([ids], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)[0]
                t_own = time.perf_counter() - t0
                nbytes = s1.get("kv_transfer_bytes", 0) - s0.get("kv_transfer_bytes", 0)
                secs = s1.get("kv_transfer_seconds", 0) - s0.get("kv_transfer_seconds", 0)
                if rep:  # the first of each length warms the allocator and kernels
                    add(dict(part="transfer", transport=a.transport, prompt_tokens=L,
                             producer_prefill_ms=round(t_prefill * 1e3, 1),
                             consumer_ttft_with_transfer_ms=round(t_pull * 1e3, 1),
                             consumer_ttft_recompute_ms=round(t_own * 1e3, 1), transfer_bytes=int(nbytes),
                             transfer_s=round(secs, 4), transfer_GBps=round(nbytes / secs / 1e9, 2) if secs else None,
                             nixl_read_s=round(rs, 5) if agent is not None else None,
                             nixl_read_GBps=round(rb / rs / 1e9, 2) if rs else None,
                             same_first_token=got.outputs[0].token_ids == own.outputs[0].token_ids,
                             load_failures=s1.get("load_failures", 0)))
        prod.shutdown()
        cons.shutdown()


if __name__ == "__main__":
    main()
