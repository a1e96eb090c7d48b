"""The verdict of ``benchmarks/load/soak_gpu.py`` on scripted runs (no server): lost requests,
blocks left after the drain, RSS / GPU growth and p99 drift each fail the soak; aborts by the
client and a flat run pass. (The script's 60 s ``--cpu-smoke`` runs outside CI.)"""

from __future__ import annotations

import copy

from tests.utils import load_benchmark

soak = load_benchmark("soak_gpu")


def _run(n=400, duration=100.0):
    recs = [dict(start=duration * i / n, ttft=0.1 + 0.001 * (i % 7), tpot=0.02, outcome="completed", error=None)
            for i in range(n)]
    recs[3]["outcome"] = "client_abort"
    samples = [dict(t=t, rss_mib=1000.0, gpu_mib=70000.0, kv_usage=0.5) for t in range(0, 101, 5)]
    return dict(rate=4.0, records=recs, samples=samples,
                idle={"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "frontend": 0.0})


def test_verdicts():
    ns = soak.parse_args(["--duration", "100", "--window-s", "20"])
    good = soak.analyse(ns, _run())
    assert good["passed"] and good["outcomes"]["client_abort"] == 1, good["checks"]

    lost = _run()
    lost["records"][5]["outcome"] = "failed"
    assert not soak.analyse(ns, lost)["checks"]["no_lost_requests"]

    leak = _run()
    leak["idle"]["kv_usage"] = 0.01  # blocks still held after the drain
    r = soak.analyse(ns, leak)
    assert not r["checks"]["idle_and_no_leaked_blocks"] and not r["passed"]

    grow = _run()
    for s in grow["samples"]:
        s["rss_mib"] += 20 * s["t"]
    assert not soak.analyse(ns, grow)["checks"]["rss_flat"]

    drift = copy.deepcopy(_run())
    for rec in drift["records"]:
        if rec["start"] >= 80:
            rec["ttft"] *= 1.5
    r = soak.analyse(ns, drift)
    assert not r["checks"]["p99_ttft_drift"] and r["checks"]["p99_tpot_drift"] and not r["passed"]
    assert r["latency"]["ttft"]["ratio"] > 1.4
    # --cpu-smoke reports drift without failing on it.
    smoke = soak.parse_args(["--cpu-smoke", "--duration", "100", "--window-s", "20"])
    assert smoke.shape == "tiny" and soak.analyse(smoke, drift)["passed"]
