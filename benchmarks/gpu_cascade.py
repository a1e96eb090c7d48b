"""Cascade attention on a GPU: the kernels alone, and W3 with cascade on vs off.

- ``kernel``: one decode step of 512 requests over 4 shared 2,048-token prefixes + 128-token
  suffixes, Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head size 128, 16-token
  blocks): the per-request decode kernel vs cascade (prefix once per group + suffix + merge),
  microseconds per layer, effective GB/s (the KV bytes every request attends to / time) and
  the bytes actually distinct; bf16 and fp8_e4m3 KV; the max difference between the two.
- ``w3``: ``benchmarks/workloads.py --workload w3`` with prefix caching on, cascade on then off
  (``--enable-cascade-attention``), each in its own process, then prefix caching off once;
  prints the caching on/off ratio against the 4x target.

Usage::

    PYTHONPATH=. python3 benchmarks/gpu_cascade.py --out DIR [--parts kernel,w3]
    PYTHONPATH=. python3 benchmarks/gpu_cascade.py --out DIR --cpu-smoke   # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
T_START = time.perf_counter()


def _timed(fn, iters: int, cuda: bool) -> float:
    """Mean microseconds of ``fn()`` over ``iters`` calls (after 3 warm-ups)."""
    import torch

    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000.0 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def kernel(a: argparse.Namespace) -> list[dict]:
    import numpy as np
    import torch

    from kvserve.attention.kv_format import kv_format_for
    from kvserve.attention.kv_quant import quantize_pages
    from kvserve.attention.triton import decode_attention
    from kvserve.attention.triton.cascade import plan_cascade, plan_to_device, rows_per_item
    from kvserve.core.kv_cache_spec import get_kv_format

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if a.cpu_smoke:
        reqs, groups, prefix, suffix, heads, hkv, d, bs, iters = 8, 2, 32, 8, 4, 2, 32, 4, 1
        dtypes = ["float32", "fp8_e4m3"]
    else:
        reqs, groups, prefix, suffix, heads, hkv, d, bs, iters = 512, 4, 2048, 128, 16, 8, 128, 16, 20
        dtypes = ["bfloat16", "fp8_e4m3"]
    qdt = torch.float32 if a.cpu_smoke else torch.bfloat16
    pb, sb = prefix // bs, -(-suffix // bs)
    num_blocks = 1 + groups * pb + reqs * sb
    bt = np.zeros((reqs, pb + sb), dtype=np.int64)
    for r in range(reqs):
        g = r % groups
        bt[r, :pb] = 1 + g * pb + np.arange(pb)
        bt[r, pb:] = 1 + groups * pb + r * sb + np.arange(sb)
    lens = np.full(reqs, prefix + suffix)
    t0 = time.perf_counter()
    host = plan_cascade(bt, lens, reqs, bs, rows_per_item(heads, hkv), min_shared_blocks=2 if a.cpu_smoke else None)
    plan_ms = (time.perf_counter() - t0) * 1e3
    plan = plan_to_device(host, rows_per_item(heads, hkv), dev)
    bt_t = torch.from_numpy(bt).to(torch.int32).to(dev)
    sl = torch.from_numpy(lens).to(torch.int32).to(dev)
    qsl = torch.arange(reqs + 1, dtype=torch.int32, device=dev)
    q = torch.randn(reqs, heads, d, device=dev).to(qdt)
    from kvserve.attention.triton.cascade import CascadePlan, max_items

    z = torch.zeros(max_items(reqs, plan.rows_per_item), dtype=torch.int32, device=dev)
    empty = CascadePlan(prefix_lens=torch.zeros_like(sl), suffix_block_tables=bt_t, suffix_seq_lens=sl,
                        members=z[:1], item_first=z, item_count=z, rows_per_item=plan.rows_per_item,
                        max_prefix_len=int(lens.max()), max_suffix_len=int(lens.max()))
    from kvserve.attention.triton.cascade import cascade_decode_attention

    rows = []
    for name in dtypes:
        fmt = kv_format_for(name, d)
        raw = torch.randn(2, num_blocks, bs, hkv, d, device=dev)
        cache = quantize_pages(raw, get_kv_format(name)) if fmt.kernel_code else raw.to(getattr(torch, name))
        del raw
        out_a, out_b = torch.empty_like(q), torch.empty_like(q)
        scale = d ** -0.5

        def per_request():
            decode_attention(q, cache, bt_t, sl, qsl, reqs, int(lens.max()), scale, out=out_a, kv_format=fmt)

        def casc():
            cascade_decode_attention(q, cache, bt_t, plan, qsl, reqs, scale, out_b, kv_format=fmt)

        def casc_empty():  # a captured graph's step without groups: no items, whole sequences as suffixes
            cascade_decode_attention(q, cache, bt_t, empty, qsl, reqs, scale, out_b, kv_format=fmt)

        us_a, us_b = _timed(per_request, iters, cuda), _timed(casc, iters, cuda)
        diff = (out_a.float() - out_b.float()).abs().max().item()
        us_e = _timed(casc_empty, iters, cuda)
        tok_bytes = cache[:, 1].numel() * cache.element_size() // bs  # both halves, every KV head, per token
        logical = int(lens.sum()) * tok_bytes
        distinct = (groups * prefix + reqs * suffix) * tok_bytes
        row = dict(kv_cache_dtype=name, requests=reqs, groups=groups, prefix_len=prefix, suffix_len=suffix,
                   heads=heads, kv_heads=hkv, head_size=d, block_size=bs, per_request_us=round(us_a, 1),
                   cascade_us=round(us_b, 1), speedup=round(us_a / us_b, 2),
                   per_request_effective_gbps=round(logical / us_a / 1e3, 1),
                   cascade_effective_gbps=round(logical / us_b / 1e3, 1),
                   cascade_distinct_gbps=round(distinct / us_b / 1e3, 1), max_abs_diff=diff,
                   plan_host_ms=round(plan_ms, 3), items=plan.max_items, no_groups_plan_us=round(us_e, 1),
                   no_groups_overhead=round(us_e / us_a, 3))
        rows.append(row)
        print(f"| kernel {name} | per-request {us_a:.1f} us ({row['per_request_effective_gbps']} GB/s eff.) | "
              f"cascade {us_b:.1f} us ({row['cascade_effective_gbps']} GB/s eff., "
              f"{row['cascade_distinct_gbps']} GB/s distinct) | {row['speedup']}x | diff {diff:.2e} | "
              f"empty plan {us_e:.1f} us ({row['no_groups_overhead']}x) |", flush=True)
    return rows


def w3(a: argparse.Namespace, rec: dict) -> dict:
    """Prefix caching on with cascade on, then off, then prefix caching off: one process each
    (the figures are printed and saved as each arrives, in case the part's time runs out)."""
    res = rec["w3"] = {}
    runs = [("cascade_on", "on", True), ("cascade_off", "on", False), ("caching_off", "off", None)]
    last = 0.0
    for key, caching, casc in runs:
        path = os.path.join(a.out, f"w3_{key}.json")
        cmd = [sys.executable, os.path.join(HERE, "workloads.py"), "--workload", "w3", "--prefix-caching", caching,
               "--out", path]
        if casc is not None:
            cmd += ["--engine-arg", f"enable_cascade_attention={json.dumps(casc)}"]
        if a.cpu_smoke:
            cmd += ["--tiny"]
        t0 = time.perf_counter()
        if a.deadline and t0 - T_START + last > a.deadline:  # it would not finish: leave the time to the next part
            print(f"w3 {key}: skipped ({t0 - T_START:.0f} s gone, the last run took {last:.0f} s, deadline "
                  f"{a.deadline} s)", flush=True)
            continue
        rc = subprocess.run(cmd, stdout=sys.stderr).returncode
        last = time.perf_counter() - t0
        if rc != 0:
            print(f"w3 {key}: rc={rc}", flush=True)
            continue
        res[key] = json.loads(open(path).readline())[f"caching_{caching}"]
        print(f"| w3 {key.replace('_', ' ')} | wall {res[key]['wall_s']} s | mean TTFT {res[key]['mean_ttft_s']} s | "
              f"process {time.perf_counter() - t0:.0f} s |", flush=True)
        if key == "cascade_off" and "cascade_on" in res:
            res["cascade_gain"] = round(res["cascade_off"]["wall_s"] / res["cascade_on"]["wall_s"], 3)
            print(f"| w3 cascade on vs off (caching on) | {res['cascade_gain']}x |", flush=True)
        _save(a, rec)
    off = res.get("caching_off", {}).get("wall_s")
    for key in ("cascade_on", "cascade_off"):
        if key in res and off:
            res[f"speedup_{key}"] = round(off / res[key]["wall_s"], 3)
            print(f"| w3 caching on/off, {key.replace('_', ' ')} | {off} s / {res[key]['wall_s']} s | "
                  f"{res[f'speedup_{key}']}x (target 4x) |", flush=True)
    return res


def _save(a: argparse.Namespace, rec: dict) -> None:
    with open(os.path.join(a.out, "cascade.json"), "w") as f:
        json.dump(rec, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for cascade.json and the W3 records")
    ap.add_argument("--parts", default="kernel,w3", help="comma-separated: kernel, w3")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start: skip a W3 run that would end past it (the last run's time)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.cpu_smoke and "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    rec = {}
    parts = a.parts.split(",")
    if "kernel" in parts:
        rec["kernel"] = kernel(a)
        _save(a, rec)
    if "w3" in parts:
        w3(a, rec)
    _save(a, rec)


if __name__ == "__main__":
    main()
