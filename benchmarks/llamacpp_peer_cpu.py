"""CPU: ``kvserve serve`` vs llama.cpp's ``llama-server`` on the same GGUF and requests.

For each round and each kvserve configuration (default flags, ``--dtype bfloat16``,
``--quantization gguf``) it starts ``kvserve serve`` on a free port and runs ``kvserve bench
serve --peer llama.cpp`` on each workload: kvserve's run, then llama-server's (started by the
bench on the default GGUF, ``-np`` = the concurrency, ``-t --threads``) with the same requests,
so the two alternate on a shared machine. Load averages (``os.getloadavg``) are recorded
before and after every bench call. Workloads (random token-id prompts, ``ignore_eos``):

* ``1stream``: 256-token prompts, 128 outputs, one at a time (TTFT, TPOT);
* ``64streams``: 32-512 in / 32-512 out, 64 in flight (output tok/s).

    PYTHONPATH=$PWD python benchmarks/llamacpp_peer_cpu.py --llama-server PATH \\
        --out benchmarks/results/llamacpp_peer_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONFIGS = {"default": [], "bf16": ["--dtype", "bfloat16"], "gguf": ["--quantization", "gguf"]}
KEYS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "median_e2el_ms",
        "completed", "failed", "duration_s", "total_output_tokens")


def workloads(ns) -> dict[str, list[str]]:
    return {
        "1stream": ["--input-len", "256", "--output-len", "128", "--num-prompts", str(ns.one_stream_prompts),
                    "--max-concurrency", "1"],
        "64streams": ["--input-len", "32:512", "--output-len", "32:512", "--num-prompts", str(ns.many_prompts),
                      "--max-concurrency", "64"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workloads", default="1stream,64streams")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--one-stream-prompts", type=int, default=4)
    ap.add_argument("--many-prompts", type=int, default=64)
    ap.add_argument("--raw-dir", default="/tmp/llamacpp_peer_cpu", help="each bench call's own JSON")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    from kvserve.bench.llamacpp_peer import PeerServer, find_llama_server
    from kvserve.entrypoints import cli
    from kvserve.router.launch import free_port

    binary = find_llama_server(ns.llama_server)
    os.makedirs(ns.raw_dir, exist_ok=True)
    wls = workloads(ns)
    rows = []
    out_doc = dict(args=vars(ns), llama_server=binary, rows=rows)
    for rnd in range(ns.rounds):
        for cfg in ns.configs.split(","):
            port = free_port()
            argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port),
                    "--disable-access-log", "--uvicorn-log-level", "warning", *CONFIGS[cfg]]
            with PeerServer(f"kvserve-{cfg}", argv, port, log_path=os.path.join(ns.raw_dir, f"serve_{cfg}.log")) as ours:
                for wl in ns.workloads.split(","):
                    raw = os.path.join(ns.raw_dir, f"r{rnd}_{cfg}_{wl}.json")
                    load0, t0 = os.getloadavg(), time.time()
                    rc = cli.main(["bench", "serve", "--base-url", ours.url, "--dataset", "random", *wls[wl],
                                   "--peer", "llama.cpp", "--peer-threads", str(ns.threads), "--llama-server", binary,
                                   "--disable-tqdm", "--save-result", raw])
                    load1 = os.getloadavg()
                    res = json.load(open(raw))
                    o, p = res["runs"][0], res["peer"]["runs"][0]
                    row = dict(round=rnd, config=cfg, kvserve_flags=" ".join(CONFIGS[cfg]), workload=wl, rc=rc,
                               started=time.strftime("%H:%M:%S", time.gmtime(t0)),
                               loadavg_before=[round(x, 2) for x in load0], loadavg_after=[round(x, 2) for x in load1],
                               kvserve={k: o.get(k) for k in KEYS}, llamacpp={k: p.get(k) for k in KEYS},
                               speedup=res["speedup_vs_peer"][0], llama_server_argv=res["peer"]["argv"],
                               llama_server_version=res["peer"]["version"], raw=raw)
                    rows.append(row)
                    print(json.dumps({k: row[k] for k in ("round", "config", "workload", "loadavg_before",
                                                          "loadavg_after", "speedup")}), flush=True)
                    if ns.out:  # after every call: an interrupted run keeps what it finished
                        with open(ns.out, "w") as f:
                            json.dump(out_doc, f, indent=1)
    print(f"\n| round | kvserve | workload | kvserve out tok/s | llama.cpp out tok/s | ratio | kvserve TTFT p50 | "
          f"llama.cpp TTFT p50 | kvserve TPOT p50 | llama.cpp TPOT p50 | load before/after |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        k, p = r["kvserve"], r["llamacpp"]
        print(f"| {r['round']} | {r['config']} | {r['workload']} | {k['output_throughput']:.1f} | "
              f"{p['output_throughput']:.1f} | {r['speedup']['output_throughput']:.2f}x | {k['median_ttft_ms']:.1f} | "
              f"{p['median_ttft_ms']:.1f} | {k['median_tpot_ms']:.2f} | {p['median_tpot_ms']:.2f} | "
              f"{r['loadavg_before'][0]:.1f}/{r['loadavg_after'][0]:.1f} |")


if __name__ == "__main__":
    main()
