"""GPU: the Triton W4A16 GEMM (``triton_w4a16``) alone, and INT4 / AWQ / GPTQ engines at the Llama-3.1-8B shape.

Parts:

* ``gemm`` — the GEMM at M = 1, 16, 64, 256 for the 8B projections (qkv 4096->6144, o 4096->4096,
  gate_up 4096->28672, down 14336->4096), group 128, in three zero-point layouts (``int4``: float
  minima, ``awq``: integer zeros, ``gptq``: symmetric), beside bf16 ``F.linear`` (cuBLAS) and tinygemm
  (``_weight_int4pack_mm``) and, from M = 64, AWQ dequantized + cuBLAS (``awq_dense``: the path above
  ``MAX_M``). Per call: us, GB/s of weight bytes and its fraction of the measured device
  copy bandwidth (read + write bytes / s of a 1 GiB copy), speed-up over bf16 and (AWQ) over tinygemm.
  CUDA-graph replay of copies cycled past L2 (>= 256 MB). ``--sweep``: before measuring a (shape, M), time
  a handful of ``triton_w4a16.Config`` candidates (``sweep_configs``, AWQ layout; ``--sweep-s`` seconds in
  all) and measure with the fastest; the last record (``tuned``) and the ``TUNED (...)`` console lines are
  the best per (M bucket, N, K), to paste into ``triton_w4a16.TUNED``.
* ``offline`` — offline throughput, ISL/OSL 1000/1000 (``--offline-n`` requests, ignore_eos, greedy),
  dummy weights, one child process per format (bf16, fp8, int4, ...): output tok/s.

W2 (batch-1 decode) per format runs through ``workloads.py --workload w2 --engine-arg quantization=...``
(benchmarks/gpu/run.sh, part ``int4-w2``). JSON records to ``--out/w4a16.json``; a table last.

    PYTHONPATH=. python3 benchmarks/gpu_w4a16.py --out $OUT --parts gemm[,offline] [--sweep] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
MS = (1, 16, 64, 256)


def _time(fns, device: str, iters: int = 20) -> float:
    from gpu_weight_quant import _time as t

    return t(fns, device, iters)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device copy (read + write) of 1 GiB (CPU smoke: 64 MiB)."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = _time([lambda: b.copy_(a)], device, 10)
    return 2 * n / (ms / 1e3)


def _layouts(w: torch.Tensor, device: str, with_ref: bool = False):
    """``name -> (callable(x), weight bytes)`` for one dense weight ``w`` ``[N, K]`` (bf16), and ``"ref"``:
    ``name -> float32 dequantized weight`` (the reference; only ``with_ref``)."""
    from kvserve.layers.quantization import triton_w4a16 as tw
    from kvserve.layers.quantization.group_quant import GroupQuantWeight, quantize_groupwise
    from kvserve.layers.quantization.kernels import quantize_int4

    out = {"ref": {}}
    n, k = w.shape
    i4 = quantize_int4(w.float(), 128)
    if with_ref:  # the kernel rounds scales / minima to bf16 as stored here
        out["ref"]["int4"] = (i4.q.float() * i4.scale.bfloat16().float().repeat_interleave(128, 1)
                              + i4.min.bfloat16().float().repeat_interleave(128, 1))
    packed = tw.pack(i4.q, 4).to(device)
    s = i4.scale.t().contiguous().to(device, torch.bfloat16)
    m = i4.min.t().contiguous().to(device, torch.bfloat16)
    out["int4"] = (lambda x, c=None, a=(packed, s, m): tw.gemm(x, a[0], a[1], a[2], n, 128, 4, tw.ZP_FLOAT, config=c),
                   packed.numel() * 4 + s.numel() * 2 + m.numel() * 2)
    for name, sym in (("awq", False), ("gptq", True)):
        g: GroupQuantWeight = quantize_groupwise(w.float(), 4, 128, sym)
        pq = tw.pack(g.q, 4).to(device)
        sc = g.scale.t().contiguous().to(device, torch.float16)
        z = None if sym else g.zero.t().contiguous().to(device, torch.uint8)
        zp = tw.ZP_SYM if sym else tw.ZP_INT
        if with_ref:
            g.scale = g.scale.half().float()
            out["ref"][name] = g.dequantize()
        out[name] = (lambda x, c=None, a=(pq, sc, z, zp): tw.gemm(x, a[0], a[1], a[2], n, 128, 4, a[3], config=c),
                     pq.numel() * 4 + sc.numel() * 2 + (z.numel() if z is not None else 0))
        if name == "awq":  # the M > MAX_M path (dequantize, then cuBLAS), for the cut-over
            out["awq_dense"] = (lambda x, c=None, a=(pq, sc, z, zp): F.linear(
                x, tw.dequantize(a[0], a[1], a[2], n, k, 128, 4, a[3], x.dtype)), out[name][1])
            if with_ref:
                out["ref"]["awq_dense"] = out["ref"]["awq"]
    if device == "cuda":  # tinygemm, the int4 kernel before the W4A16 GEMM
        q = i4.q.to(device)
        tp = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        sz = torch.stack([i4.scale, i4.min + 8 * i4.scale], -1).transpose(0, 1).contiguous().to(device,
                                                                                               torch.bfloat16)
        out["tinygemm"] = (lambda x, c=None, a=(tp, sz): torch.ops.aten._weight_int4pack_mm(x, a[0], 128, a[1]),
                           tp.numel() * tp.element_size() + sz.numel() * 2)
    return out


def sweep_configs(m: int, n: int, k: int) -> list:
    """A handful of ``triton_w4a16.Config`` candidates for one shape (few distinct compiles: the constexpr
    part repeats across shapes, only ``split`` is per shape), the table's current choice first."""
    from kvserve.layers.quantization import triton_w4a16 as tw

    C = tw.Config
    if m == 1:
        tiles = [C(1, 128, 1, 1, 4, 3), C(1, 128, 2, 1, 4, 1), C(1, 64, 1, 1, 4, 3), C(1, 256, 1, 1, 8, 3),
                 C(1, 128, 1, 1, 4, 4), C(1, 128, 2, 1, 4, 3),
                 C(16, 64, 1, 1, 4, 3), C(16, 128, 1, 1, 8, 3)]  # tensor cores at M = 1 (padded to 16)
    elif m <= 16:
        tiles = [C(16, 64, 1, 1, 4, 2), C(16, 128, 1, 1, 4, 2), C(16, 64, 2, 1, 4, 2), C(16, 128, 2, 1, 8, 2)]
    elif m <= 64:
        tiles = [C(64, 64, 1, 1, 4, 2), C(32, 128, 1, 1, 4, 2), C(64, 128, 1, 1, 8, 2)]
    else:
        tiles = [C(64, 128, 1, 1, 8, 2), C(128, 128, 1, 1, 8, 2), C(128, 64, 1, 1, 4, 2)]
    out = [tw.gemm_config(m, n, k)]
    for t in tiles:
        base = tw.auto_split(m, n, k, 4, t)
        for sp in sorted({base, max(1, base // 2), base * 2} if base > 1 else {1}):
            c = t._replace(split=sp)
            if c not in out:
                out.append(c)
    return out


def _best(layouts, x, n: int, k: int, m: int, deadline: float, device: str = "cuda") -> tuple:
    """Time ``sweep_configs`` (AWQ layout, CUDA-graph replay cycled past L2) until ``deadline``
    (time.monotonic()); returns (best Config, records)."""
    from kvserve.layers.quantization import triton_w4a16 as tw

    args = [L["awq"][0].__defaults__[-1] for L in layouts]
    recs, best = [], None
    for cfg in sweep_configs(m, n, k):
        if time.monotonic() > deadline and best is not None:
            break
        try:
            t = _time([lambda a=a: tw.gemm(x, a[0], a[1], a[2], n, 128, 4, a[3], config=cfg) for a in args],
                      device, 10 if device == "cuda" else 1)
        except Exception as e:  # a configuration the compiler or the GPU rejects (shared memory, registers)
            recs.append(dict(part="sweep", n=n, k=k, m=m, cfg=list(cfg), error=repr(e)[:160]))
            continue
        recs.append(dict(part="sweep", n=n, k=k, m=m, cfg=list(cfg), us=round(t * 1e3, 2)))
        if best is None or t < best[1]:
            best = (cfg, t)
    return (best[0] if best else None), recs


def gemm_part(device: str, smoke: bool, sweep: bool, copy_bw: float, emit, sweep_s: float = 90.0) -> None:
    """Per shape and M: (``sweep``, CUDA) time ``sweep_configs`` and keep the fastest, then measure every
    layout with it beside bf16 and tinygemm (each with its relative error against the float dequantized
    reference: a GPU correctness check). The sweep shares ``sweep_s`` seconds over the Ms (M = 1 the most;
    a candidate list is compiled once per M, at its first shape); past it the table's configuration is used.
    Ends with a ``tuned`` record: the best per (M bucket, N, K), ready for ``triton_w4a16.TUNED``."""
    from kvserve.layers.quantization import triton_w4a16 as tw

    shapes = {"tiny": (256, 512)} if smoke else SHAPES
    ms_list = (1, 16) if smoke else MS
    built = {}  # every shape's weights up front: M is the outer loop (a sweep's compiles serve all shapes)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        ncopy = 1 if device != "cuda" else max(1, min(16, -(-(256 << 20) // (n * k * 2))))
        nl = 1 if device != "cuda" else max(1, min(16, -(-(256 << 20) // (n * k // 2))))
        built[name] = ([w] + [w.clone() for _ in range(ncopy - 1)],
                       [_layouts(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02, device, i == 0)
                        for i in range(nl)])
    t0 = time.monotonic()
    share = [0.4, 0.2, 0.2, 0.2][: len(ms_list)]  # of sweep_s per M, cumulative (time left over carries on)
    tuned = {}
    tuned_rec = dict(part="tuned", table={})  # filled in as the sweep goes (a time limit keeps what is done)
    if sweep:
        emit(tuned_rec)
    for mi, m in enumerate(ms_list):
        deadline = t0 + (sweep_s if not smoke else 0.0) * sum(share[: mi + 1]) / sum(share)
        for name, (n, k) in shapes.items():
            dense, layouts = built[name]
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            cfg = tw.gemm_config(m, n, k)
            if sweep:  # CPU smoke: the first candidate only
                best, recs = _best(layouts, x, n, k, m, deadline, device)
                for r in recs:
                    emit(r)
                cfg = best or cfg
                tuned[(tw.m_bucket(m), n, k)] = cfg
                tuned_rec["table"][f"{tw.m_bucket(m)},{n},{k}"] = list(cfg)
                print(f"TUNED ({tw.m_bucket(m)}, {n}, {k}): Config{tuple(cfg)},", flush=True)
            bf16_ms = _time([lambda d=d: F.linear(x, d) for d in dense], device, 3 if smoke else 20)
            rec = dict(part="gemm", shape=name, n=n, k=k, m=m, cfg=list(cfg), bf16_us=round(bf16_ms * 1e3, 2))
            for lay in layouts[0]:
                if lay == "ref" or (lay == "awq_dense" and m < 64 and not smoke):
                    continue
                fns = [lambda L=L: L[lay][0](x, cfg) for L in layouts]
                try:
                    t = _time(fns, device, 3 if smoke else 20)
                    ref = layouts[0]["ref"].get(lay)
                    if ref is not None:
                        y = layouts[0][lay][0](x, cfg).float()
                        want = x.float() @ ref.T
                        rec[f"{lay}_rel_err"] = float(f"{((y - want).norm() / want.norm()).item():.2e}")
                except Exception as e:  # one layout failing must not hide the others
                    rec[f"{lay}_error"] = repr(e)[:200]
                    continue
                nb = layouts[0][lay][1]
                rec[f"{lay}_us"] = round(t * 1e3, 2)
                rec[f"{lay}_gb_s"] = round(nb / t / 1e6, 1)
                rec[f"{lay}_of_copy_bw"] = round(nb / (t / 1e3) / copy_bw, 3)
                rec[f"{lay}_speedup_vs_bf16"] = round(bf16_ms / t, 2)
            if "tinygemm_us" in rec and "awq_us" in rec:
                rec["awq_speedup_vs_tinygemm"] = round(rec["tinygemm_us"] / rec["awq_us"], 2)
            emit(rec)
    del built
    if device == "cuda":
        torch.cuda.empty_cache()
    if tuned:
        print("TUNED table (triton_w4a16.TUNED):")
        for (b, n, k), c in tuned.items():
            print(f"TUNED ({b}, {n}, {k}): Config{tuple(c)},")


def offline_one(fmt: str, n: int, isl: int, osl: int, smoke: bool) -> dict:
    """One engine (this process): ``n`` requests of ``isl`` random prompt ids and ``osl`` output tokens."""
    import numpy as np

    from gpu_decode import LLAMA31_8B, _config_dir
    from gpu_weight_quant import TINY

    from kvserve import LLM, SamplingParams

    path = _config_dir("/tmp/kvserve-w4a16", "tiny" if smoke else "llama-3.1-8b", TINY if smoke else LLAMA31_8B,
                       "LlamaConfig")
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", quantization=None if fmt == "bf16" else fmt,
              skip_tokenizer_init=True, device="cpu" if smoke else "cuda", max_model_len=isl + osl + 16,
              disable_log_stats=True, max_num_seqs=n if not smoke else 4,
              **({"kv_cache_memory": "32MiB"} if smoke else {}))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000 if not smoke else 500, isl).tolist() for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=osl, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    return dict(part="offline", format=fmt, requests=n, isl=isl, osl=osl, wall_s=round(wall, 2),
                output_tok_s=round(n * osl / wall, 1), total_tok_s=round(n * (isl + osl) / wall, 1),
                preemptions=llm.llm_engine.stats.num_preemptions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="gemm", help="gemm,offline")
    ap.add_argument("--sweep", action="store_true", help="gemm part: tune the GEMM configuration per shape first")
    ap.add_argument("--sweep-s", type=float, default=90.0, help="gemm part: seconds for the whole sweep")
    ap.add_argument("--formats", default="bf16,fp8,int4", help="offline part: engine formats")
    ap.add_argument("--offline-n", type=int, default=256, help="offline part: requests")
    ap.add_argument("--offline-deadline", type=float, default=1e9, help="offline part: skip formats after this many s")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: offline_one for this format
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ns = ap.parse_args()
    smoke = ns.cpu_smoke
    device = "cpu" if smoke else "cuda"
    isl, osl = (16, 8) if smoke else (1000, 1000)
    if ns.one:
        print("RESULT " + json.dumps(offline_one(ns.one, 4 if smoke else ns.offline_n, isl, osl, smoke)), flush=True)
        return
    os.makedirs(ns.out, exist_ok=True)
    records: list[dict] = []

    def emit(r: dict) -> None:
        records.append(r)
        print(json.dumps(r), flush=True)
        with open(os.path.join(ns.out, "w4a16.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", records=records), f,
                          indent=1)

    parts = ns.parts.split(",")
    if "gemm" in parts:
        if smoke:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        bw = copy_bandwidth(device)
        emit(dict(part="copy", copy_gb_s=round(bw / 1e9, 1)))
        gemm_part(device, smoke, ns.sweep, bw, emit, ns.sweep_s)
    if "offline" in parts:
        t0 = time.monotonic()
        for fmt in ns.formats.split(","):
            if time.monotonic() - t0 > ns.offline_deadline:
                emit(dict(part="offline", format=fmt, error="skipped: deadline"))
                continue
            cmd = [sys.executable, __file__, "--one", fmt] + (["--cpu-smoke"] if smoke else []) + \
                  ["--offline-n", str(ns.offline_n)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = [s for s in p.stdout.splitlines() if s.startswith("RESULT ")]
            emit(json.loads(line[-1][7:]) if line else dict(part="offline", format=fmt, error=p.stderr[-400:]))
    print("\npart     figure")
    for r in records:
        if r["part"] == "gemm":
            cols = [f"{lay} {r[lay + '_us']} us ({r[lay + '_of_copy_bw']:.0%} bw, x{r[lay + '_speedup_vs_bf16']}"
                    f"{', err ' + str(r[lay + '_rel_err']) if lay + '_rel_err' in r else ''})"
                    for lay in ("int4", "awq", "gptq", "tinygemm", "awq_dense") if lay + "_us" in r]
            print(f"gemm     {r['shape']:<8} m={r['m']:<4} bf16 {r['bf16_us']} us | " + " | ".join(cols)
                  + f" | cfg {tuple(r['cfg'])}")
        elif r["part"] == "offline":
            print(f"offline  {r['format']:<6} " + (r.get("error") or f"{r['output_tok_s']} out tok/s "
                                                     f"({r['requests']} x {r['isl']}/{r['osl']})"))
        elif r["part"] == "copy":
            print(f"copy     {r['copy_gb_s']} GB/s")
        elif r["part"] == "tuned":
            print(f"tuned    {len(r['table'])} (M bucket, N, K) entries (JSON: part tuned)")


if __name__ == "__main__":
    main()
