"""Probe: the Triton kernels with the int4/int2 rotation (``rotate=True``), one case per
process (run with CUDA_LAUNCH_BLOCKING=1 so a fault names its kernel), each checked against
torch_ref over the float32-rotated inputs.

Usage (GPU machine, repo root): PYTHONPATH=. python3 benchmarks/rotation_probe.py CASE [--dtype int4]
CASE: store | decode | prefill | prefill64 | prefill16 | forward (the prefill cases rotate around the
kernel, as ``TritonBackend`` does: the in-kernel rotation was wrong in its 64/128-row tiles on sm_90,
an H100 run of 2026-11-27, kept in git history). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: the Triton interpreter (TRITON_INTERPRET=1)")
    ns = ap.parse_args()
    sys.path.insert(0, ".")
    from kvserve.attention.forward_context import AttentionMetadata
    from kvserve.attention.kv_quant import dequantize_pages, quantize_pages
    from kvserve.attention.kv_rotation import rotation_matrix
    from kvserve.attention.torch_ref import TorchRefBackend
    from kvserve.attention.triton import TritonBackend, decode_attention, prefill_attention, store_kv
    from kvserve.attention.kv_format import kv_format_for, view_of
    from kvserve.core.kv_cache_spec import get_kv_format

    dev, d, h, hkv, bs = ns.device, ns.d, 16, 8, 16
    g = torch.Generator().manual_seed(0)
    reqs = [(37, 1), (5, 1), (20, 40), (0, 70)]  # decodes, then prefill chunks
    nb = sum(-(-(c + n) // bs) for c, n in reqs) + 1
    perm = torch.randperm(nb - 1, generator=g) + 1
    maxb = max(-(-(c + n) // bs) for c, n in reqs)
    bt = torch.zeros(len(reqs), maxb, dtype=torch.int32)
    i0 = 0
    for i, (c, n) in enumerate(reqs):
        k = -(-(c + n) // bs)
        bt[i, :k] = perm[i0:i0 + k]
        i0 += k
    cache = quantize_pages(torch.randn(2, nb, bs, hkv, d, generator=g), get_kv_format(ns.dtype)).to(dev)
    slots, qsl = [], [0]
    for i, (c, n) in enumerate(reqs):
        slots += [int(bt[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev), block_tables=bt.to(dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([c + n for c, n in reqs], dtype=torch.int32, device=dev),
        query_lens_cpu=[n for _, n in reqs], seq_lens_cpu=[c + n for c, n in reqs],
        max_query_len=max(n for _, n in reqs), max_seq_len=max(c + n for c, n in reqs), num_decodes=2)
    q, k, v = (torch.randn(t, n, d, generator=g).to(torch.bfloat16).to(dev) for n in (h, hkv, hkv))
    r = rotation_matrix(d, dev)
    kvf = kv_format_for(ns.dtype, d)
    rec = dict(case=ns.case, dtype=ns.dtype, d=d)
    try:
        c_ref = cache.clone()
        rot = [x.float() @ r for x in (q, k, v)]
        ref = TorchRefBackend().forward(*rot, view_of(c_ref, kvf), dataclasses.replace(meta), d ** -0.5) @ r.T
        torch.cuda.synchronize() if dev == "cuda" else None
        out = torch.full_like(q, float("nan"))
        if ns.case == "store":
            store_kv(k, v, cache, meta.slot_mapping, rotate=True, kv_format=kvf)
            torch.cuda.synchronize() if dev == "cuda" else None if dev == "cuda" else None
            # Judge the stored rows by their squared error against the float32-rotated input (a
            # range chosen by a search, as tried once, may differ from torch's in a few
            # rows on the GPU: summation order), and count the rows that differ.
            sl = meta.slot_mapping
            x = torch.stack(rot[1:])  # [2, t, hkv, d]
            deq_t, deq_r = (dequantize_pages(c, d, torch.float32, get_kv_format(ns.dtype)).flatten(1, 2)[:, sl] for c in (cache, c_ref))
            e_t, e_r = ((y - x).square().sum().item() for y in (deq_t, deq_r))
            differ = ((deq_t - deq_r).abs().amax(-1) > 1e-6).float().mean().item()
            rec.update(ok=bool(e_t <= 1.001 * e_r and differ < 0.05), sq_err=e_t, sq_err_torch=e_r,
                       rows_differing=round(differ, 4))
        else:
            store_kv(k, v, cache, meta.slot_mapping, rotate=True, kv_format=kvf)
            torch.cuda.synchronize() if dev == "cuda" else None if dev == "cuda" else None
            rows = slice(0, t)
            if ns.case == "decode":
                decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 2,
                                 meta.max_seq_len, d ** -0.5, out=out, rotate=True, kv_format=kvf)
                rows = slice(0, 2)
            elif ns.case.startswith("prefill"):  # rotated around the kernel, as the backend does
                bm = {"prefill": None, "prefill64": 64, "prefill16": 16}[ns.case]
                qr = (q.float() @ r).to(q.dtype)
                prefill_attention(qr, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 2, 2,
                                  meta.max_query_len, d ** -0.5, out=out, block_m=bm, kv_format=kvf)
                out = (out.float() @ r.T).to(q.dtype)
                rows = slice(2, t)
            else:
                out = TritonBackend().forward(q, k, v, view_of(cache.copy_(c_ref), kvf, rotate=True), meta, d ** -0.5)
            torch.cuda.synchronize() if dev == "cuda" else None if dev == "cuda" else None
            err = (out[rows].float() - ref[rows]).abs().max()
            rec.update(ok=bool(err < 3e-2), max_err=float(err))
    except Exception as exc:  # noqa: BLE001 - report, do not hide
        traceback.print_exc()
        rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
