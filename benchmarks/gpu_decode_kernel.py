"""The paged decode attention kernel alone against the copy bandwidth, bf16 and FP8 KV.

One Llama-3.1-8B attention layer (32 query heads, 8 KV heads, head dim 128, 16-token blocks,
pages placed at random) at batch 512 x 2K, 64 x 8K and 1 x 32K context, for ``bfloat16`` and
``fp8_e4m3`` KV caches. Per (shape, dtype): the default config (``decode.DECODE_CONFIGS``),
the kernel of an older tree beside it (``--old-kernel``, e.g. ``git show 0fa5af9:...`` of
``kvserve/attention/triton/decode.py``), then a sweep of tiles (BLOCK_N x warps x stages),
page-id gathering (``page_tile``), split counts and the reduce fused into the split kernel
(``fuse_reduce``), the best of them named. Each config is
timed as a CUDA graph of several launches (the engine replays decode attention in graphs; at
batch 1 a launch's host cost would exceed the kernel), each launch on another copy of the
layer's pages when one copy would fit in L2. GB/s counts the cache bytes read (K and V codes,
FP8's per-token scales); the copy rate is a device-to-device copy measured in the same run
(bytes read + written per second, as the step profile's 4.29 TB/s).

FP8 KV also runs the FP8-dot path (``decode.DECODE_PATHS["fp8_dot"]``: e4m3 tensor-core dots on the
codes, no conversion) right after the defaults, before the conversion sweep: its default tile
(``FP8_DOT_CONFIGS``) and ``FP8_DOT_TILES`` (both layouts: keys or query rows as the MMAs' rows),
each record's ``max_err`` against the conversion path's default output and ``max_err_sdpa`` against
SDPA; the table sets the two paths side by side. ``FP8_DOT_TILES`` lead with Q K^T only
(``fp8_pv`` False, V converted); then ``V_BYTES_TILES``, the conversion path with V's codes read
as bytes into the P V operand (``DecodeConfig.v_bytes``), which count as conversion configs.

Correctness: the default config's output against SDPA over the dequantized pages (two
requests); every other config against the default's output.

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 benchmarks/gpu_decode_kernel.py --out $OUT/decode-kernel \
        [--old-kernel /tmp/decode_old.py] [--budget 80]
    PYTHONPATH=. python3 benchmarks/gpu_decode_kernel.py --cpu-smoke   # tiny, interpreter, seconds
Writes ``decode_kernel.json`` (one record per line) under --out; prints a table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import traceback

SHAPES = [(512, 2048), (64, 8192), (1, 32768)]
SMOKE_SHAPES = [(3, 40), (1, 100)]
DTYPES = ["bfloat16", "fp8_e4m3"]
# (block_n, num_warps, num_stages) tiles swept per dtype; each with page_tile off and on
TILES = {
    "bfloat16": [(64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 2, 4), (128, 8, 2), (32, 4, 4)],
    "fp8_e4m3": [(64, 2, 5), (128, 8, 2), (64, 4, 3), (128, 4, 3), (128, 2, 4), (64, 4, 4), (32, 2, 6)],
}
# FP8-dot path tiles (block_n, warps, stages, fp8_keys_rows, fp8_pv), e4m3 only, timed before the
# conversion sweep; 4+ warps (Triton's e4m3 wgmma); keys as the MMAs' rows: block_n >= 64 (wgmma's M).
# fp8_pv False (Q K^T only on e4m3, V converted to float16) first; of the e4m3 P V tiles only the
# best of the fp8_dot_h200 run (128 x 4 x 3, keys as rows) stays, as the yardstick.
FP8_DOT_TILES = [(128, 4, 3, True, False), (64, 4, 3, True, False), (64, 4, 5, True, False),
                 (128, 8, 3, True, False), (64, 8, 3, True, False), (64, 4, 3, False, False),
                 (128, 4, 3, True, True)]
# the conversion path with V read as bytes (DecodeConfig.v_bytes): None is the table's tile
V_BYTES_TILES = [None, (64, 4, 3), (128, 4, 3)]
# (num_splits, fuse_reduce) swept per batch (None: the config's)
SPLITS = {512: [(None, None)], 64: [(None, None), (2, False), (4, True)],
          1: [(None, False), (None, True), (64, True), (16, False)]}


def _record(out_dir: str | None, rec: dict) -> None:
    print(json.dumps(rec), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "decode_kernel.json"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read + written per second (median of 10)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return 2 * nbytes / (times[len(times) // 2] * 1e-3)


def load_old_kernel(path: str):
    """``decode_attention`` of an older tree's ``kvserve/attention/triton/decode.py`` (it imports
    the helpers of this tree's ``kv_load``, which keeps every older one)."""
    spec = importlib.util.spec_from_file_location("kvserve_old_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.decode_attention


class Layer:
    """One attention layer's paged cache at (batch, ctx) in ``dtype``, ``copies`` disjoint page
    sets (one per launch of a graph, so L2 never holds the next launch's pages)."""

    def __init__(self, dtype: str, batch: int, ctx: int, h: int, hkv: int, d: int, bs: int, device: str,
                 l2_bytes: int, seed: int = 0):
        import torch

        from kvserve.attention.kv_format import kv_format_for
        from kvserve.attention.kv_quant import quantize_pages
        from kvserve.core.kv_cache_spec import get_kv_format

        self.desc = get_kv_format(dtype)
        self.fmt = kv_format_for(dtype, d)
        self.batch, self.ctx, self.h, self.hkv, self.d = batch, ctx, h, hkv, d
        tdt = getattr(torch, self.desc.torch_dtype)
        elem = torch.empty(0, dtype=tdt).element_size()
        self.bytes_read = 2 * batch * ctx * hkv * self.desc.row_elems(d) * elem
        self.copies = max(1, min(8, math.ceil(4 * l2_bytes / self.bytes_read)))
        nb = -(-ctx // bs)
        num_blocks = self.copies * batch * nb + 1
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.cache = torch.empty(2, num_blocks, bs, hkv, self.desc.row_elems(d), dtype=tdt, device=device)
        step = 4096
        for i in range(0, num_blocks, step):  # in slices: a full float32 copy would not fit beside it
            n = min(step, num_blocks - i)
            x = torch.randn(2, n, bs, hkv, d, device=device)
            self.cache[:, i:i + n] = quantize_pages(x, self.desc) if self.desc.quantized else x.to(tdt)
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
        self.bts = [perm[c * batch * nb:(c + 1) * batch * nb].view(batch, nb).to(device) for c in range(self.copies)]
        self.seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        qdt = torch.bfloat16 if device == "cuda" else torch.float32
        self.q = torch.randn(batch, h, d, generator=gen).to(device=device, dtype=qdt)
        self.out = torch.empty_like(self.q)

    def call(self, fn, copy: int = 0, **kw):
        return fn(self.q, self.cache, self.bts[copy], self.seq, self.qsl, self.batch, self.ctx, self.d ** -0.5,
                  out=self.out, kv_format=self.fmt, **kw)

    def reference(self, nr: int = 2):
        """SDPA over the dequantized pages of the first ``nr`` requests (copy 0), float32."""
        import torch

        nr = min(nr, self.batch)
        raw = self.cache.view(torch.uint8) if self.cache.element_size() == 1 else self.cache
        pages = raw[:, self.bts[0][:nr].long()].view(self.cache.dtype)
        kv = self.fmt.dequantize_pages(pages, torch.float32).reshape(2, nr, -1, self.hkv, self.d)[:, :, :self.ctx]
        k, v = (t.transpose(1, 2).repeat_interleave(self.h // self.hkv, 1) for t in kv)
        ref = torch.nn.functional.scaled_dot_product_attention(self.q[:nr].float().unsqueeze(2), k, v,
                                                               scale=self.d ** -0.5)
        return ref.squeeze(2)


def time_graph(layer: Layer, fn, kw: dict, launches: int = 8, reps: int = 10) -> float:
    """ms per launch of ``fn`` replayed as a CUDA graph of ``launches`` launches (copies cycled)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in range(layer.copies):  # compile, allocate
            layer.call(fn, c, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            layer.call(fn, i % layer.copies, **kw)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / launches)
    del g
    times.sort()
    return times[len(times) // 2]


def table_entry(dec, best: dict, default: dict, batch: int, hkv: int, sms: int) -> str:
    """The ``DECODE_CONFIGS`` line (``(kv bytes, bucket): DecodeConfig(...)``) that makes
    ``decode_attention`` pick the ``best`` record's config at this batch: an explicit split count
    becomes ``max_splits`` with enough ``waves`` to reach it."""
    cfg = dict(default.get("default") or {})
    if best is not default:
        for k in ("block_n", "num_warps", "num_stages", "page_tile", "fuse_reduce", "v_bytes"):
            if best.get(k) is not None:
                cfg[k] = best[k]
        if best.get("num_splits"):
            n = best["num_splits"]
            cfg["max_splits"], cfg["waves"] = n, max(1, math.ceil(n * batch * hkv / sms))
    nbytes = 1 if best.get("kv_cache_dtype", "").startswith(("fp8", "int8")) else 2
    fields = ", ".join(f"{k}={cfg[k]!r}" for k in dec.DecodeConfig._fields if k in cfg)
    return f"({nbytes}, {dec.programs_bucket(batch, hkv, sms)!r}): DecodeConfig({fields})"


def _variant(task) -> str:
    """What a task compiles: the split kernel's constexprs and launch options, and the reduce
    kernel's split-count class (tasks with equal keys would compile the same binaries)."""
    dtype, kw, old_path = task
    n = kw.get("num_splits", 1)
    kw = {k: v for k, v in kw.items() if v or k != "fp8_dot"}  # fp8_dot False: the conversion path's key
    fused = bool(kw.get("fuse_reduce"))
    s_pad = 1 if n == 1 or fused else max(2, 1 << (n - 1).bit_length())
    k = {k: v for k, v in kw.items() if k != "num_splits"}
    return json.dumps([dtype, old_path, k, n == 1, s_pad], sort_keys=True)


def _compile_one(task, shape, device) -> bool:
    """Precompile worker: one launch of a variant on a tiny layer of the same specialization."""
    try:
        dtype, kw, old_path = task
        h, hkv, d, bs = shape
        fn = load_old_kernel(old_path) if old_path else __import__(
            "kvserve.attention.triton.decode", fromlist=["decode_attention"]).decode_attention
        lay = Layer(dtype, 1, max(256, 128 * kw.get("num_splits", 1)), h, hkv, d, bs, device, 0)
        lay.call(fn, 0, **kw)
        return True
    except Exception:  # noqa: BLE001 - the main process compiles it again and records the error
        traceback.print_exc()
        return False


def precompile(tasks, workers: int, shape, device: str) -> int:
    """Compile ``tasks`` ``(dtype, decode_attention kwargs, old kernel path or None)`` in
    ``workers`` processes at once (Triton's on-disk cache then serves the main process);
    returns how many compiled."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return sum(ex.map(_compile_one, tasks, [shape] * len(tasks), [device] * len(tasks)))


def run(args) -> list[dict]:
    import torch

    from kvserve.attention.triton import decode as dec

    cuda = not args.cpu_smoke
    device = "cuda" if cuda else "cpu"
    out_dir = args.out
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    recs: list[dict] = []
    copy_bps = copy_bandwidth() if cuda else None
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 1 << 20
    rec = dict(part="copy", copy_gb_s=round(copy_bps / 1e9, 1) if copy_bps else None,
               device=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__,
               triton=__import__("triton").__version__)
    _record(out_dir, rec)
    old = load_old_kernel(args.old_kernel) if args.old_kernel else None
    shapes = SMOKE_SHAPES if args.cpu_smoke else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    h, hkv, d, bs = (8, 2, 32, 16) if args.cpu_smoke else (32, 8, 128, 16)
    dtypes = args.dtypes.split(",")
    best: dict[tuple, dict] = {}

    def measure(layer, fn, kw, ref_out, tag, sdpa=None, **extra):
        r = dict(part="kernel", kv_cache_dtype=layer.desc.name, batch=layer.batch, ctx=layer.ctx, config=tag,
                 path=("fp8_dot" if kw.get("fp8_pv", True) else "fp8_qk") if kw.get("fp8_dot") else "convert",
                 **extra)
        try:
            layer.out.fill_(float("nan"))
            layer.call(fn, 0, **kw)
            got = layer.out[:2].float()
            err = (got - ref_out).abs().max().item()
            tol = 2e-2 if layer.q.dtype == torch.bfloat16 else 1e-3
            if kw.get("fp8_dot"):  # e4m3 query and P: up to ~2^-4 of the values' scale (randn; decode.py's bound)
                tol = 2.0 ** -4
            r.update(ok=bool(torch.isfinite(layer.out).all()) and err < tol, max_err=round(err, 6))
            if sdpa is not None:
                r["max_err_sdpa"] = round((got - sdpa).abs().max().item(), 6)
            if cuda:
                ms = time_graph(layer, fn, kw)
                gbs = layer.bytes_read / (ms * 1e-3) / 1e9
                r.update(ms=round(ms, 4), gb_s=round(gbs, 1), copy_fraction=round(gbs * 1e9 / copy_bps, 3))
        except Exception as exc:  # noqa: BLE001 - one failing config must not hide the others
            traceback.print_exc()
            r.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        _record(out_dir, r)
        recs.append(r)
        return r

    layers: dict[tuple, Layer] = {}
    refs: dict[tuple, object] = {}
    sdpa_refs: dict[tuple, object] = {}
    for dtype in dtypes:
        for batch, ctx in shapes:
            lay = layers[(dtype, batch, ctx)] = Layer(dtype, batch, ctx, h, hkv, d, bs, device, l2)
            refs[(dtype, batch, ctx)] = lay.reference()
    sms = dec._num_sms(torch.device(device))

    def resolved(lay, kw):
        """``kw`` with every launch choice decode_attention would make filled in (the precompile
        workers' tiny layers must compile the same variants)."""
        cfg = dec.decode_config(d, lay.q.dtype, not cuda, lay.fmt.kernel_code, False, 0, lay.batch, hkv, sms,
                                bool(kw.get("fp8_dot")))
        full = dict(block_n=kw.get("block_n") or cfg.block_n, num_warps=kw.get("num_warps") or cfg.num_warps,
                    num_stages=kw.get("num_stages") or cfg.num_stages,
                    page_tile=cfg.page_tile if kw.get("page_tile") is None else kw["page_tile"],
                    fuse_reduce=cfg.fuse_reduce if kw.get("fuse_reduce") is None else kw["fuse_reduce"])
        full["num_splits"] = kw.get("num_splits") or dec.choose_num_splits(
            lay.batch, hkv, lay.ctx, sms, full["block_n"], cfg.waves, cfg.max_splits)
        full["fp8_dot"] = bool(kw.get("fp8_dot"))
        if kw.get("v_bytes") or cfg.v_bytes:
            full["v_bytes"] = cfg.v_bytes if kw.get("v_bytes") is None else kw["v_bytes"]
        if full["fp8_dot"]:
            full["fp8_keys_rows"] = cfg.fp8_keys_rows if kw.get("fp8_keys_rows") is None else kw["fp8_keys_rows"]
            full["fp8_pv"] = cfg.fp8_pv if kw.get("fp8_pv") is None else kw["fp8_pv"]
        return full

    # The FP8-dot path (e4m3 layers): its default, then its tiles (batch 1: page tiles too; fp8_pv
    # False: Q K^T only on e4m3).
    fp8_default = dict(fp8_dot=True)
    fp8_sweep = []
    for key, lay in layers.items():
        if lay.fmt.kernel_code != 1:
            continue
        fp8_sweep.append((key, fp8_default, "fp8_dot default"))
        tiles = ([(16, 1, 1, True, False), (16, 1, 1, False, False), (16, 1, 1, True, True)] if args.cpu_smoke
                 else FP8_DOT_TILES)
        for tile in tiles:
            first = key[1] == 1 and tile == tiles[0]  # batch 1: page tiles, and twice the splits (fused merge)
            for page_tile, splits in ([(False, None), (True, None), (False, 64), (True, 64)] if first else
                                      [(False, None)]):
                kw = dict(block_n=tile[0], num_warps=tile[1], num_stages=tile[2], page_tile=page_tile, fp8_dot=True,
                          fp8_keys_rows=tile[3], fp8_pv=tile[4])
                if splits:
                    kw.update(num_splits=2 if args.cpu_smoke else splits, fuse_reduce=True)
                fp8_sweep.append((key, kw, f"{'fp8_dot' if tile[4] else 'fp8_qk'} {tile[0]}x{tile[1]}x{tile[2]}"
                                           f"{' keys' if tile[3] else ''}{' pt' if page_tile else ''}"
                                           f"{f' s{splits} fused' if splits else ''}"))
        # the conversion path with V's codes read as bytes into the P V operand (no float16 copy)
        for tile in ([None] if args.cpu_smoke else V_BYTES_TILES):
            kw = dict(v_bytes=True)
            if tile:
                kw.update(block_n=tile[0], num_warps=tile[1], num_stages=tile[2])
            fp8_sweep.append((key, kw, f"v_bytes {'%dx%dx%d' % tile if tile else 'default tile'}"))

    # The sweep, most likely tiles first, both dtypes at each step: the budget may cut it.
    sweep = []
    n_tiles = 2 if args.cpu_smoke else max(len(TILES[dt]) for dt in dtypes)
    for i in range(n_tiles):
        for page_tile in (False, True):
            for key, lay in layers.items():
                dtype, batch, ctx = key
                tiles = [(16, 1, 1), (32, 1, 1)] if args.cpu_smoke else TILES[dtype]
                if i >= len(tiles):
                    continue
                tile = tiles[i]
                combos = [(None, None), (2, True)] if args.cpu_smoke else SPLITS.get(batch, [(None, None)])
                for splits, fuse in combos:
                    kw = dict(block_n=tile[0], num_warps=tile[1], num_stages=tile[2], page_tile=page_tile,
                              num_splits=splits, fuse_reduce=fuse)
                    sweep.append((key, kw, f"{tile[0]}x{tile[1]}x{tile[2]}{' pt' if page_tile else ''}"
                                           f"{f' s{splits}' if splits else ''}{' fused' if fuse else ''}"))
    if args.precompile_workers > 0:  # every variant compiled in parallel into Triton's cache first
        tasks = [(k[0], resolved(layers[k], {}), None) for k in layers]
        tasks += [(k[0], {"num_splits": resolved(layers[k], {})["num_splits"]}, args.old_kernel)
                  for k in layers if args.old_kernel]
        tasks += [(k[0], resolved(layers[k], kw), None) for k, kw, _ in fp8_sweep + sweep]
        uniq = list({_variant(t): t for t in tasks}.values())
        tc = time.time()
        n_ok = precompile(uniq, args.precompile_workers, (h, hkv, d, bs), device)
        _record(out_dir, dict(part="precompile", variants=len(uniq), ok=n_ok, s=round(time.time() - tc, 1)))

    for key, lay in layers.items():  # the default, then the old kernel
        cfg = dec.decode_config(d, lay.q.dtype, not cuda, lay.fmt.kernel_code, False, 0, lay.batch, hkv, sms)
        r = measure(lay, dec.decode_attention, {}, refs[key], "default", default=cfg._asdict())
        best[key] = dict(default=r, best=r)
        if old is not None:
            best[key]["old"] = measure(lay, old, {}, refs[key], "old")
        if r.get("ok"):  # every other config is checked against the default's output
            lay.call(dec.decode_attention, 0)
            sdpa_refs[key] = refs[key]
            refs[key] = lay.out[:2].float().clone()
    for key, kw, tag in fp8_sweep:  # max_err: against the conversion path's output
        if cuda and time.time() - t0 > args.budget:
            break
        r = measure(layers[key], dec.decode_attention, kw, refs[key], tag, sdpa=sdpa_refs.get(key),
                    **{k: v for k, v in kw.items() if k != "fp8_dot"})
        b = best[key]
        if not kw.get("fp8_dot"):  # v_bytes: a conversion-path config
            if r.get("ok") and r.get("ms") and r["ms"] < b["best"].get("ms", float("inf")):
                b["best"] = r
            continue
        if kw is fp8_default:
            b["fp8_dot_default"] = r
        if r.get("ok") and r.get("ms") and r["ms"] < b.get("fp8_dot_best", {}).get("ms", float("inf")):
            b["fp8_dot_best"] = r
        elif "fp8_dot_best" not in b:
            b["fp8_dot_best"] = r
    for key, kw, tag in sweep:
        if cuda and time.time() - t0 > args.budget:
            _record(out_dir, dict(part="budget", measured=sum(r.get("part") == "kernel" for r in recs),
                                  left=len(sweep)))
            break
        r = measure(layers[key], dec.decode_attention, kw, refs[key], tag, **kw)
        b = best[key]
        if r.get("ok") and r.get("ms") and r["ms"] < b["best"].get("ms", float("inf")):
            b["best"] = r
    layers.clear()

    print("\n| KV dtype | batch x ctx | default ms | GB/s | of copy | best config | best ms | GB/s | of copy |"
          " old ms | old of copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    table_lines = []
    for (dtype, batch, ctx), b in best.items():
        df, bb, od = b["default"], b["best"], b.get("old", {})
        entry = table_entry(dec, bb, df, batch, hkv, sms)
        summary = dict(part="best", kv_cache_dtype=dtype, batch=batch, ctx=ctx, default=df, best=bb, old=od or None,
                       copy_gb_s=rec["copy_gb_s"], decode_configs_entry=entry)
        table_lines.append(f"    {entry},  # {dtype} {batch} x {ctx}: {bb.get('ms')} ms, "
                           f"{bb.get('copy_fraction')} of the copy rate")
        _record(out_dir, summary)
        print(f"| {dtype} | {batch} x {ctx} | {df.get('ms')} | {df.get('gb_s')} | {df.get('copy_fraction')} | "
              f"{bb.get('config')} | {bb.get('ms')} | {bb.get('gb_s')} | {bb.get('copy_fraction')} | "
              f"{od.get('ms')} | {od.get('copy_fraction')} |")
    print("\nDECODE_CONFIGS entries of the best configs (kvserve/attention/triton/decode_configs.py):")
    print("\n".join(table_lines))
    fp8_lines = []
    print("\nFP8 KV, the two paths side by side (max_err: the FP8-dot output against the conversion path's)")
    print("| batch x ctx | convert default ms | of copy | convert best ms | of copy | fp8_dot default ms | of copy |"
          " fp8_dot best config | ms | GB/s | of copy | max_err | max_err_sdpa |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (dtype, batch, ctx), b in best.items():
        if "fp8_dot_best" not in b:
            continue
        df, bb, fd, fb = b["default"], b["best"], b.get("fp8_dot_default", {}), b["fp8_dot_best"]
        bucket = dec.programs_bucket(batch, hkv, sms)
        cfg = dec.FP8_DOT_CONFIGS[bucket]._asdict()
        cfg.update({k: fb[k] for k in ("block_n", "num_warps", "num_stages", "page_tile", "fp8_keys_rows", "fp8_pv",
                                       "fuse_reduce") if fb.get(k) is not None})
        if fb.get("num_splits"):  # an explicit split count: max_splits, with the waves to reach it
            n = fb["num_splits"]
            cfg["max_splits"], cfg["waves"] = n, max(1, math.ceil(n * batch * hkv / sms))
        entry = f"{bucket!r}: DecodeConfig({', '.join(f'{k}={cfg[k]!r}' for k in cfg)})"
        fp8_lines.append(f"    {entry},  # {batch} x {ctx}: {fb.get('ms')} ms, {fb.get('copy_fraction')} of the copy "
                         f"rate (conversion path {bb.get('ms')} ms)")
        _record(out_dir, dict(part="fp8_dot", batch=batch, ctx=ctx, convert_default=df, convert_best=bb,
                              fp8_dot_default=fd or None, fp8_dot_best=fb, copy_gb_s=rec["copy_gb_s"],
                              fp8_dot_configs_entry=entry))
        print(f"| {batch} x {ctx} | {df.get('ms')} | {df.get('copy_fraction')} | {bb.get('ms')} | "
              f"{bb.get('copy_fraction')} | {fd.get('ms')} | {fd.get('copy_fraction')} | {fb.get('config')} | "
              f"{fb.get('ms')} | {fb.get('gb_s')} | {fb.get('copy_fraction')} | {fb.get('max_err')} | "
              f"{fb.get('max_err_sdpa')} |")
    if fp8_lines:
        print("\nFP8_DOT_CONFIGS entries of the best FP8-dot tiles (decode_configs.py; the path itself: DECODE_PATHS):")
        print("\n".join(fp8_lines))
    bad = [r for r in recs if not r.get("ok")]
    if bad:
        print(f"not ok: {len(bad)} records ({', '.join(sorted({str(r.get('config')) for r in bad}))})",
              file=sys.stderr)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for decode_kernel.json")
    ap.add_argument("--old-kernel", default=None, metavar="DECODE_PY",
                    help="an older tree's kvserve/attention/triton/decode.py, timed beside the default")
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES), help="BATCHxCTX,...")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--budget", type=float, default=80.0, help="seconds before the sweep stops (CUDA)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--precompile-workers", type=int, default=None,
                    help="processes compiling every variant first (default: CPUs - 2, at most 14; 0: none)")
    args = ap.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    if args.precompile_workers is None:
        args.precompile_workers = 0 if args.cpu_smoke else max(1, min(14, (os.cpu_count() or 4) - 2))
    recs = run(args)
    # wrong numbers from any config, or a default / old kernel that did not run, fail the run
    if any(not r.get("ok") and ("error" not in r or r.get("config") in ("default", "old"))
           for r in recs if r.get("part") == "kernel"):
        sys.exit(1)


if __name__ == "__main__":
    main()
