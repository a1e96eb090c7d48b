"""Long-prompt prefill on one GPU: the Triton prefill kernel alone, then W5 through the engine.

- ``peak``: the measured bf16 matmul peak (8192^3 ``torch.matmul``, best of 10, TFLOP/s): the
  denominator of every kernel figure.
- ``kernel``: the prefill kernel alone at the Llama-3.1-8B attention shape (32 query heads,
  8 KV heads, head dim 128, block size 16), batch 1, causal prompts of 4K / 32K / 128K tokens,
  bf16 and fp8_e4m3 KV. Two ways of reading keys: ``pages`` (every key through the block table,
  as the kernel did before the chunk's own keys came from its K/V rows) and ``chunk_kv`` (the
  chunk's own keys from its contiguous K/V, only the cached prefix from the pages: what the
  engine runs now); each as one whole-prompt call (``whole``) and as the engine's 8,192-token
  chunks over the cached prefix (``chunked``: the sum of the chunk calls). ms (CUDA events) and
  TFLOP/s of the causal FLOPs ``4 * S^2 * H * d / 2``, against ``peak``. The 4K records check the
  output against SDPA (``max_err``). Also the decode kernel at batch 1 x 32K per KV dtype (GB/s of
  the K/V bytes it reads vs 4.8 TB/s, HBM3e) with the default split count and two others.
  With ``--old-kernel PATH`` (an older tree's ``kvserve/attention/triton/prefill.py``) the same
  calls through it instead of ``pages`` (``old``; with the chunk's own K/V if it takes them).
- ``sweep``: tile configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (``SWEEP``) x kernel paths
  (``SWEEP_PATHS``: the default, and FP8 Q K^T for e4m3) of the prefill kernel at
  ``--sweep-seqs`` (32K), bf16 and fp8, whole and in ``--sweep-chunk`` chunks over the cached
  prefix; a ``sweep_best`` record per (seq, KV dtype, pattern): the figures that choose
  ``prefill.PREFILL_CONFIGS`` / ``PREFILL_PATHS``.
- ``chunk``: the paged-prefix path alone: the last ``CHUNK``-token chunk of a ``--chunk-seqs``
  prompt (32K, 128K) over the rest of it cached (where chunked prefill spends most of a long
  prompt's attention), per KV dtype, the default paths against the new ``PREFILL_PATHS`` switches
  (``CHUNK_PATHS``: the block-table ids prefetched a step ahead, the converted FP8 path), each path
  at every length, in that order until ``--chunk-budget`` seconds have passed; prompts past 32K also
  time their last 32K chunk (``CHUNK_LONG``, a lone prompt's chunk in W5). FLOPs
  ``4 * H * d * (n * (S - n) + n^2 / 2)``.
- ``w5``: ``benchmarks/workloads.py --workload w5`` for bf16 and fp8_e4m3 KV, each in its own
  process (32,768 and 130,944-token prompts + 128 output tokens: TTFT and ms/token).

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 benchmarks/gpu_prefill.py --out $OUT/prefill --parts peak,kernel,sweep,chunk,w5
    python3 benchmarks/gpu_prefill.py --cpu-smoke     # tiny shapes, interpreter kernels, CPU
Appends one JSON record per figure to --out/prefill.json; prints a table last.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
import traceback

H, HKV, D, BS = 32, 8, 128, 16
CHUNK = 8192
HBM_BYTES_PER_S = 4.8e12
#: (BLOCK_M, BLOCK_N, num_warps, num_stages); None: ``prefill._config``'s default
SWEEP = [None, (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2)]
#: kernel paths swept with each config (``prefill.PREFILL_PATHS``): the defaults (``{}``) and, for
#: e4m3 caches, the FP8 Q K^T dot (each one compile)
SWEEP_PATHS = [{}, {"fp8_qk": True}, {"fp8_qk": True, "fp8_pv": True}, {"prefix_stages": 5}, {"page_tiles": True},
               {"prefetch_ids": True}]
#: ``--sweep-set quick`` (run.sh's one call, about 30 s): per KV dtype the default config with each
#: path, and the neighbours that decide the table's entry ((config, paths); None: the default)
SWEEP_QUICK = {
    "bfloat16": [(None, {}), ((128, 64, 8, 3), {}), ((128, 128, 8, 2), {})],
    "fp8_e4m3": [(None, {}), (None, {"fp8_qk": True}),
                 ((128, 64, 8, 2), {}), ((128, 128, 8, 3), {})],
}


#: ``chunk`` part: per KV dtype, the default paths (first) and the switches against them, most
#: telling first (the budget may stop the list)
#: (``prefix_stages=5`` and ``fp8_pv`` were measured on 2026-11-29 and did not pay: see
#: docs/benchmarks/long-context.md; ``{"fp8_qk": False}``: the converted FP8 path, exact queries)
CHUNK_PATHS = {
    "bfloat16": [{"prefetch_ids": False}, {"prefetch_ids": True}],
    "fp8_e4m3": [{"prefetch_ids": False}, {"prefetch_ids": True}, {"fp8_qk": False, "prefetch_ids": True},
                 {"fp8_qk": False, "prefetch_ids": False}],
}
#: ``chunk`` part: prompts longer than this also time their last chunk of this many tokens (a
#: lone long prompt's chunk in W5: ``--max-num-batched-tokens 32768``)
CHUNK_LONG = 32768


def _record(out_dir: str, rec: dict) -> None:
    print(json.dumps(rec), flush=True)
    with open(os.path.join(out_dir, "prefill.json"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def _time_ms(fn, reps: int, cuda: bool) -> float:
    """Best of ``reps`` runs of ``fn`` after one warm-up run (CUDA events on the GPU)."""
    import torch

    fn()
    best = float("inf")
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def matmul_peak(device: str, n: int) -> float:
    """bf16 ``n x n x n`` matmul TFLOP/s (best of 10)."""
    import torch

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    ms = _time_ms(lambda: torch.matmul(a, b), 10 if device == "cuda" else 2, device == "cuda")
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


class Prompt:
    """One request's prompt of ``s`` tokens at the 8B attention shape: q / k / v rows and a paged
    cache (bf16 or quantized) already holding every key, as after the store kernel."""

    def __init__(self, s: int, kv_dtype: str, device: str, h: int = H, hkv: int = HKV, d: int = D, bs: int = BS):
        import torch

        from kvserve.attention.kv_format import kv_format_for
        from kvserve.attention.triton import store_kv

        dt = torch.bfloat16 if device == "cuda" else torch.float32
        self.s, self.h, self.hkv, self.d, self.bs, self.device = s, h, hkv, d, bs, device
        g = torch.Generator(device=device).manual_seed(0)
        self.q = torch.randn(s, h, d, device=device, dtype=dt, generator=g)
        self.k = torch.randn(s, hkv, d, device=device, dtype=dt, generator=g)
        self.v = torch.randn(s, hkv, d, device=device, dtype=dt, generator=g)
        nb = -(-s // bs)
        self.fmt = kv_format_for(kv_dtype, d) if kv_dtype != "bfloat16" else None
        if self.fmt is not None:
            self.cache = torch.zeros(self.fmt.cache_shape(nb + 1, bs, hkv), device=device,
                                     dtype=getattr(torch, self.fmt.desc.torch_dtype))
        else:
            self.cache = torch.zeros(2, nb + 1, bs, hkv, d, device=device, dtype=dt)
        self.bt = (torch.randperm(nb, device=device, generator=g) + 1).to(torch.int32)[None, :]
        pos = torch.arange(s, device=device)
        slots = self.bt[0, pos // bs].long() * bs + pos % bs
        store_kv(self.k, self.v, self.cache, slots, kv_format=self.fmt)

    def run(self, chunk_kv: bool, chunk: int | None, out, kernel=None, **cfg) -> None:
        """The prompt through the prefill kernel (``kernel``: another ``prefill_attention``, e.g.
        an older tree's): one call, or ``chunk``-token calls over the prefix."""
        import torch

        from kvserve.attention.triton import prefill_attention

        prefill_attention = kernel or prefill_attention
        step = chunk or self.s
        for c in range(0, self.s, step):
            n = min(step, self.s - c)
            sl = slice(c, c + n)
            lens = torch.tensor([c + n], dtype=torch.int32, device=self.device)
            qsl = torch.tensor([0, n], dtype=torch.int32, device=self.device)
            extra = dict(new_key=self.k[sl], new_value=self.v[sl]) if chunk_kv else {}
            prefill_attention(self.q[sl], self.cache, self.bt, lens, qsl, 0, 1, n, self.d ** -0.5, out=out[sl],
                              kv_format=self.fmt, **extra, **cfg)


def _sdpa_err(p: Prompt, out, exact: bool) -> float:
    """max |out - SDPA| over the prompt: fp32 SDPA of the K/V as computed (``exact``) or as
    stored (dequantized for fp8)."""
    import torch

    from kvserve.attention.kv_quant import dequantize_pages

    if exact:
        k, v = p.k.float(), p.v.float()
    else:
        c = dequantize_pages(p.cache, p.d, torch.float32, p.fmt.desc) if p.fmt is not None else p.cache.float()
        pos = torch.arange(p.s, device=p.device)
        blocks = p.bt[0, pos // p.bs].long()
        k, v = c[0, blocks, pos % p.bs], c[1, blocks, pos % p.bs]  # [s, hkv, d]
    g = p.h // p.hkv
    q = p.q.float().transpose(0, 1)
    k = k.repeat_interleave(g, 1).transpose(0, 1)
    v = v.repeat_interleave(g, 1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
    return (out.float() - ref).abs().max().item()


def load_old_kernel(path: str):
    """``prefill_attention`` of an older ``prefill.py`` (its kvserve imports resolve to this tree)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvserve_old_prefill", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.prefill_attention


def kernel_part(a, out_dir: str, peak: float) -> None:
    import torch

    from kvserve.attention.triton import decode_attention

    cuda = a.device == "cuda"
    old = load_old_kernel(a.old_kernel) if a.old_kernel else None
    # an old kernel stands in for "pages"; one that takes the chunk's own K/V runs with them
    old_kv = old is not None and "new_key" in inspect.signature(old).parameters
    modes = (["old"] if old else ["pages"]) + ["chunk_kv"]
    for s in a.sizes:
        for kv in a.kv_dtypes:
            try:
                p = Prompt(s, kv, a.device, *a.shape)
            except Exception as e:  # noqa: BLE001 - one size's failure must not stop the rest
                _record(out_dir, dict(part="kernel", seq=s, kv_dtype=kv, error=repr(e)))
                continue
            out = torch.empty_like(p.q)
            flops = 4 * s * s * p.h * p.d / 2
            for mode in modes:
                for pattern, chunk in (("whole", None), ("chunked", CHUNK if s > CHUNK else None)):
                    if (pattern == "chunked" and chunk is None) or (mode != "chunk_kv" and pattern == "whole"
                                                                   and s > 32768):
                        continue  # 128K: the engine's pattern (chunked) both ways, whole only as it runs now
                    try:
                        ms = _time_ms(lambda: p.run(mode == "chunk_kv" or (mode == "old" and old_kv), chunk, out,
                                                    old if mode == "old" else None),
                                      1 if s > 32768 else a.reps, cuda)
                        rec = dict(part="kernel", seq=s, kv_dtype=kv, mode=mode, pattern=pattern, ms=round(ms, 3),
                                   tflops=round(flops / (ms * 1e-3) / 1e12, 1))
                        if peak:
                            rec["frac_of_peak"] = round(rec["tflops"] / peak, 3)
                        kv_rows = mode == "chunk_kv" or (mode == "old" and old_kv)
                        exact = kv_rows and (pattern == "whole" or p.fmt is None)
                        if s <= 4096 and (not kv_rows or exact):  # chunked fp8 chunk_kv: mixed keys
                            rec["max_err"] = _sdpa_err(p, out, exact)
                    except Exception as e:  # noqa: BLE001
                        rec = dict(part="kernel", seq=s, kv_dtype=kv, mode=mode, pattern=pattern, error=repr(e))
                        traceback.print_exc()
                    _record(out_dir, rec)
            del p, out
            if cuda:
                torch.cuda.empty_cache()
    # decode at batch 1 x the longest decode context: the K/V bytes it reads against HBM bandwidth
    s = a.decode_ctx
    for kv in a.kv_dtypes:
        p = Prompt(s, kv, a.device, *a.shape)
        q1 = p.q[-1:].contiguous()
        o1 = torch.empty_like(q1)
        lens = torch.tensor([s], dtype=torch.int32, device=a.device)
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=a.device)
        row = p.fmt.row_elems * p.cache.element_size() if p.fmt is not None else p.d * p.cache.element_size()
        nbytes = 2 * s * p.hkv * row
        for splits in (None, 16, 64):
            try:
                ms = _time_ms(lambda: decode_attention(q1, p.cache, p.bt, lens, qsl, 1, s, p.d ** -0.5, out=o1,
                                                       num_splits=splits, kv_format=p.fmt), a.reps * 5, cuda)
                rec = dict(us=round(ms * 1e3, 2), gb_per_s=round(nbytes / (ms * 1e-3) / 1e9, 1),
                           frac_of_hbm=round(nbytes / (ms * 1e-3) / HBM_BYTES_PER_S, 3))
            except Exception as e:  # noqa: BLE001 - one split count's failure must not stop the part
                rec = dict(error=repr(e)[:300])
            _record(out_dir, dict(part="decode", ctx=s, kv_dtype=kv, num_splits=splits or "default", **rec))
        del p


def sweep_part(a, out_dir: str, peak: float) -> None:
    """Every ``SWEEP`` config x ``SWEEP_PATHS`` path per KV dtype at each ``--sweep-seqs`` length,
    timed as one whole-prompt call and as ``--sweep-chunk``-token chunks over the cached prefix
    (the same compiled kernel); then one ``sweep_best`` record per (seq, KV dtype, pattern)."""
    import torch

    cuda = a.device == "cuda"
    for s in a.sweep_seqs:
        chunk = a.sweep_chunk if s > a.sweep_chunk else None
        for kv in a.kv_dtypes:
            p = Prompt(s, kv, a.device, *a.shape)
            out = torch.empty_like(p.q)
            flops = 4 * s * s * p.h * p.d / 2
            best: dict[str, dict] = {}
            from kvserve.attention.triton import prefill as prefill_mod

            default = prefill_mod._config(p.d, torch.bfloat16, p.h // p.hkv, False,
                                          p.fmt.kernel_code if p.fmt is not None else 0)
            _record(out_dir, dict(part="sweep_default", seq=s, kv_dtype=kv, config=list(default),
                                  paths=dict(prefill_mod.PREFILL_PATHS)))
            if a.sweep_set == "quick":
                combos = SWEEP_QUICK.get(kv, SWEEP_QUICK["bfloat16"])
            else:
                combos = [(cfg, paths) for paths in SWEEP_PATHS for cfg in SWEEP
                          if not (paths.get("fp8_qk") and kv not in ("fp8", "fp8_e4m3"))]
            for cfg, paths in combos:
                tag = dict(part="sweep", seq=s, kv_dtype=kv, config=cfg or "default", paths=paths or "default")
                if time.time() - a.t0 > a.budget:
                    _record(out_dir, dict(tag, skipped="budget"))
                    continue
                kw = dict(paths)
                if cfg is not None:
                    kw.update(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                    if not cuda:
                        kw.update(num_warps=1, num_stages=1)
                for pattern, c in (("whole", None), ("chunked", chunk)):
                    if pattern == "chunked" and c is None:
                        continue
                    try:
                        ms = _time_ms(lambda: p.run(True, c, out, **kw), a.reps, cuda)
                        rec = dict(tag, pattern=pattern, chunk=c or s, ms=round(ms, 3),
                                   tflops=round(flops / (ms * 1e-3) / 1e12, 1))
                        if peak:
                            rec["frac_of_peak"] = round(rec["tflops"] / peak, 3)
                        if s <= 4096 or not cuda:
                            rec["max_err"] = _sdpa_err(p, out, pattern == "whole" or p.fmt is None)
                        if pattern not in best or rec["ms"] < best[pattern]["ms"]:
                            best[pattern] = rec
                    except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is a record
                        rec = dict(tag, pattern=pattern, error=repr(e)[:300])
                    _record(out_dir, rec)
            for pattern, rec in best.items():
                _record(out_dir, dict(rec, part="sweep_best"))
            del p, out
            if cuda:
                torch.cuda.empty_cache()


def chunk_part(a, out_dir: str, peak: float) -> None:
    """The last ``CHUNK``-token chunk of each ``--chunk-seqs`` prompt over the rest of it cached
    (the chunk's own keys from its rows), per KV dtype and ``CHUNK_PATHS`` entry, each path (one
    compile) timed at every length before the next; rows after ``--chunk-budget`` seconds are
    recorded as skipped."""
    import torch

    from kvserve.attention.triton import prefill_attention

    cuda = a.device == "cuda"
    t0 = time.time()
    for kv in a.kv_dtypes:
        paths_list = CHUNK_PATHS.get(kv, [{}])
        if time.time() - t0 > a.chunk_budget:
            for paths in paths_list:
                _record(out_dir, dict(part="chunk", kv_dtype=kv, paths=paths or "default", skipped="budget"))
            continue
        runs = []  # per (length, chunk): (seq, prompt, cached, chunk, out, lens, qsl, flops, [ref])
        for s in a.chunk_seqs:
            p = Prompt(s, kv, a.device, *a.shape)
            for n in [min(CHUNK, s)] + ([CHUNK_LONG] if s > CHUNK_LONG else []):
                c = s - n
                runs.append((s, p, c, n, torch.empty_like(p.q[c:]),
                             torch.tensor([s], dtype=torch.int32, device=a.device),
                             torch.tensor([0, n], dtype=torch.int32, device=a.device),
                             4 * p.h * p.d * (n * c + n * n / 2), [None]))
        for paths in paths_list:
            for s, p, c, n, out, lens, qsl, flops, ref in runs:
                tag = dict(part="chunk", seq=s, kv_dtype=kv, chunk=n, cached=c, paths=paths or "default")
                if time.time() - t0 > a.chunk_budget:
                    _record(out_dir, dict(tag, skipped="budget"))
                    continue
                try:
                    ms = _time_ms(lambda: prefill_attention(
                        p.q[c:], p.cache, p.bt, lens, qsl, 0, 1, n, p.d ** -0.5, out=out, kv_format=p.fmt,
                        new_key=p.k[c:], new_value=p.v[c:], **paths), a.reps, cuda)
                    rec = dict(tag, ms=round(ms, 3), tflops=round(flops / (ms * 1e-3) / 1e12, 1))
                    if peak:
                        rec["frac_of_peak"] = round(rec["tflops"] / peak, 3)
                    # the FP8 paths' error at the real shape
                    if s <= 32768 and n == min(CHUNK, s) and (p.fmt is not None or not cuda):
                        if ref[0] is None:
                            ref[0] = _sdpa_ref_rows(p, c)
                        rec["max_err"] = round((out.float() - ref[0]).abs().max().item(), 5)
                except Exception as e:  # noqa: BLE001 - one path's failure must not stop the rest
                    rec = dict(tag, error=repr(e)[:300])
                    traceback.print_exc()
                _record(out_dir, rec)
        del runs
        if cuda:
            torch.cuda.empty_cache()


def _sdpa_ref_rows(p: "Prompt", r0: int):
    """float32 SDPA of rows ``r0:`` over the prefix as stored (dequantized) and the chunk's own K/V
    as computed: ``[s - r0, H, d]``."""
    import torch

    from kvserve.attention.kv_quant import dequantize_pages

    c = dequantize_pages(p.cache, p.d, torch.float32, p.fmt.desc) if p.fmt is not None else p.cache.float()
    pos = torch.arange(p.s, device=p.device)
    blocks = p.bt[0, pos // p.bs].long()
    k, v = c[0, blocks, pos % p.bs].clone(), c[1, blocks, pos % p.bs].clone()
    k[r0:], v[r0:] = p.k[r0:].float(), p.v[r0:].float()
    g = p.h // p.hkv
    q = p.q[r0:].float().transpose(0, 1)  # the last rows against every key: causal from the bottom right
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    mask = torch.arange(p.s, device=p.device)[None, :] <= torch.arange(r0, p.s, device=p.device)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # one KV head's query heads at a time (bounded memory if SDPA falls back to its math path)
    return torch.cat([sdpa(q[i * g:(i + 1) * g], k[i:i + 1].expand(g, -1, -1), v[i:i + 1].expand(g, -1, -1),
                           attn_mask=mask) for i in range(p.hkv)]).transpose(0, 1)


def w5_part(a, out_dir: str) -> None:
    """workloads.py --workload w5 per KV dtype, each in its own process."""
    here = os.path.dirname(os.path.abspath(__file__))
    for kv in a.kv_dtypes:
        dst = os.path.join(out_dir, f"w5_{kv}.json")
        cmd = [sys.executable, os.path.join(here, "workloads.py"), "--workload", "w5", "--out", dst]
        if kv != "bfloat16":
            cmd += ["--kv-cache-dtype", kv]
        if a.device != "cuda":
            cmd.append("--tiny")
        t0 = time.time()
        rc = subprocess.call(cmd)
        rec = dict(part="w5", kv_dtype=kv, rc=rc, wall_s=round(time.time() - t0, 1))
        if rc == 0 and os.path.exists(dst):
            rec["prompts"] = json.loads(open(dst).readline())["prompts"]
        _record(out_dir, rec)


def main() -> None:
    global CHUNK, CHUNK_LONG
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/kvserve-prefill")
    ap.add_argument("--parts", default="peak,kernel,sweep,w5")
    ap.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3")
    ap.add_argument("--sizes", default="4096,32768,131072", help="kernel part: prompt lengths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--old-kernel", default=None, metavar="PREFILL_PY",
                    help="kernel part: also time this older prefill.py (mode 'old')")
    ap.add_argument("--budget", type=float, default=1e9, help="sweep: stop starting configs after this many seconds")
    ap.add_argument("--sweep-seqs", default="32768", help="sweep: prompt lengths")
    ap.add_argument("--sweep-chunk", type=int, default=CHUNK, help="sweep: the chunked pattern's chunk (tokens)")
    ap.add_argument("--sweep-set", default="full", choices=["full", "quick"],
                    help="sweep: SWEEP x SWEEP_PATHS, or SWEEP_QUICK (the default config's neighbours)")
    ap.add_argument("--chunk-seqs", default="32768,131072", help="chunk: prompt lengths (the last chunk timed)")
    ap.add_argument("--chunk-budget", type=float, default=1e9, help="chunk: skip rows after this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    a = ap.parse_args()
    a.t0 = time.time()
    if a.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    a.device = "cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu"
    a.kv_dtypes = a.kv_dtypes.split(",")
    a.sizes = [int(x) for x in a.sizes.split(",")]
    a.shape = (H, HKV, D, BS)
    a.decode_ctx = 32768
    a.sweep_seqs = [int(x) for x in a.sweep_seqs.split(",")]
    a.chunk_seqs = [int(x) for x in a.chunk_seqs.split(",")]
    if a.device == "cpu":  # interpreter: tiny shapes, one rep, one config per path
        a.sizes, a.shape, a.decode_ctx, a.sweep_seqs, a.reps = [40], (4, 2, 16, 4), 40, [40], 1
        a.chunk_seqs = [40]
        a.sweep_chunk = 16
        CHUNK = 16
        CHUNK_LONG = 32
        SWEEP[:] = SWEEP[:2]
    os.makedirs(a.out, exist_ok=True)
    peak = 0.0
    for part in a.parts.split(","):  # in the order given
        if part == "peak":
            peak = matmul_peak(a.device, 8192 if a.device == "cuda" else 64)
            _record(a.out, dict(part="peak", device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                                torch=torch.__version__, bf16_matmul_tflops=round(peak, 1)))
        elif part == "kernel":
            kernel_part(a, a.out, peak)
        elif part == "sweep":
            sweep_part(a, a.out, peak)
        elif part == "chunk":
            chunk_part(a, a.out, peak)
        elif part == "w5":
            w5_part(a, a.out)
        else:
            raise SystemExit(f"unknown part {part!r} (peak, kernel, sweep, chunk, w5)")
    print("| part | seq | kv | mode | ms | TFLOP/s | of peak |")
    print("|--|--|--|--|--|--|--|")
    for line in open(os.path.join(a.out, "prefill.json")):
        r = json.loads(line)
        if r["part"] in ("kernel", "sweep", "sweep_best", "chunk"):
            what = r.get("mode", f"{r['config']} {r.get('paths', '')}" if "config" in r else r.get("paths"))
            ms = r.get("ms", r.get("error", r.get("skipped", "")))
            print(f"| {r['part']} | {r['seq']} | {r['kv_dtype']} | {what} "
                  f"{r.get('pattern', r.get('chunk', ''))} | {ms} | {r.get('tflops', '')} | "
                  f"{r.get('frac_of_peak', '')} |")
        elif r["part"] == "w5":
            for n, f in r.get("prompts", {}).items():
                print(f"| w5 | {n} | {r['kv_dtype']} | TTFT {f['ttft_s']} s | {f['ms_per_token']} ms/token | | |")


if __name__ == "__main__":
    main()
