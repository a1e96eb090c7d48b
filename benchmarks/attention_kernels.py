"""Triton attention kernels vs torch_ref at real shapes: correctness and speed (GPU).

For each case (Qwen3-0.6B: 16 heads / 8 KV heads, D 128; Llama-3.1-8B: 32 / 8, D 128;
bf16 q and KV cache, block size 16, shuffled block tables) it:
  1. runs ``TritonBackend.forward`` and ``TorchRefBackend.forward`` on the same inputs and
     prints the max relative error ``max|tri - ref| / max|ref|``;
  2. times with ``triton.testing.do_bench`` (median): the Triton forward (store + attention),
     the Triton attention kernels alone, and the torch_ref forward;
  3. prints the bytes-moved roofline (unique KV bytes read / 3.0 TB/s) and the fraction of
     it the Triton attention kernels achieve; for prefill also TFLOP/s (causal FLOPs).
Cases: 1/8/64/256 decodes at 1k context; prefill chunks of 512-2048 over 0-4k prefixes;
one mixed batch (64 decodes + a 512 chunk over a 1k prefix).

Usage (GPU machine, repo root; about a minute on an H100):
    PYTHONPATH=. python benchmarks/attention_kernels.py --out benchmarks/results/attention_kernels.json
``--out`` may be a directory (writes ``attention_kernels.json`` in it). ``--tiny`` runs a
few tiny cases on the CPU under the Triton interpreter (a smoke test of this script only;
its timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kvserve.attention.forward_context import AttentionMetadata  # noqa: E402
from kvserve.attention.kv_format import view_of  # noqa: E402
from kvserve.attention.torch_ref import TorchRefBackend  # noqa: E402
from kvserve.attention.triton import TritonBackend, decode_attention, prefill_attention  # noqa: E402
from kvserve.attention.triton.decode import _num_sms, choose_num_splits  # noqa: E402

HBM_BYTES_PER_S = 3.0e12  # H100 SXM HBM3, round number
BF16_DENSE_FLOPS = 989e12  # H100 SXM dense bf16 tensor-core peak
MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}


def build(heads, hkv, d, ctx_lens, q_lens, block_size, dtype, device, seed=0):
    """Random inputs, random (fully valid) cache, shuffled block tables, metadata."""
    torch.manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    bt = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=device)
    at = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[at:at + n]
        at += n
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, device=device).to(dtype)
    t = sum(q_lens)
    q = torch.randn(t, heads, d, device=device, dtype=dtype)
    k = torch.randn(t, hkv, d, device=device, dtype=dtype)
    v = torch.randn(t, hkv, d, device=device, dtype=dtype)
    slots = []
    for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
        pos = torch.arange(c, s, device=device)
        slots.append(bt[i, pos // block_size].long() * block_size + pos % block_size)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    nd = 0
    while nd < len(q_lens) and q_lens[nd] == 1:
        nd += 1
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=bt,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens_cpu=list(q_lens), seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_decodes=nd,
    )
    return q, k, v, kv_cache, meta


def bench(fn, device):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_case(name, model, ctx_lens, q_lens, dtype, block_size, device):
    heads, hkv, d = MODELS[model]
    q, k, v, kv, meta = build(heads, hkv, d, ctx_lens, q_lens, block_size, dtype, device)
    scale = d ** -0.5
    tri_be, ref_be = TritonBackend(), TorchRefBackend()
    kv_ref = kv.clone()
    out_ref = ref_be.forward(q, k, v, view_of(kv_ref), meta, scale)
    out_tri = tri_be.forward(q, k, v, view_of(kv), meta, scale)
    rel_err = ((out_tri.float() - out_ref.float()).abs().max() / out_ref.float().abs().max()).item()
    store_ok = torch.equal(kv, kv_ref)

    nd, r = meta.num_decodes, len(q_lens)
    out = torch.empty_like(q)

    def attn_only():
        if nd:
            decode_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                             meta.max_seq_len, scale, out=out)
        if r > nd:
            prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                              r - nd, meta.max_query_len, scale, out=out)

    t_attn = bench(attn_only, device)
    t_fwd = bench(lambda: tri_be.forward(q, k, v, view_of(kv), meta, scale), device)
    t_ref = bench(lambda: ref_be.forward(q, k, v, view_of(kv_ref), meta, scale), device)

    esz = kv.element_size()
    seq_lens = meta.seq_lens_cpu
    kv_bytes = sum(seq_lens) * hkv * d * 2 * esz
    qo_bytes = 2 * q.numel() * q.element_size()
    roof_ms = (kv_bytes + qo_bytes) / HBM_BYTES_PER_S * 1e3
    # Causal FLOPs: QK^T and PV, 2 flops per MAC each, over the keys each row sees.
    keys_seen = sum(c * n + n * (n + 1) // 2 for c, n in zip(ctx_lens, q_lens))
    flops = 4 * heads * d * keys_seen
    rec = dict(
        case=name, model=model, heads=heads, kv_heads=hkv, head_dim=d, dtype=str(dtype).split(".")[-1],
        block_size=block_size, num_reqs=r, num_decodes=nd, num_tokens=sum(q_lens),
        ctx_lens=sorted(set(ctx_lens)), q_lens=sorted(set(q_lens)),
        decode_num_splits=choose_num_splits(nd, hkv, meta.max_seq_len, _num_sms(q.device)) if nd else None,
        max_rel_err=rel_err, store_equal=store_ok, ok=bool(rel_err < 2e-2 and store_ok),
        triton_attn_ms=t_attn, triton_forward_ms=t_fwd, torch_ref_ms=t_ref,
        speedup_vs_ref=t_ref / t_fwd,
        kv_bytes_read=kv_bytes, roofline_ms=roof_ms, attn_frac_of_roofline=roof_ms / t_attn,
        attn_tflops=flops / (t_attn * 1e-3) / 1e12, compute_roofline_ms=flops / BF16_DENSE_FLOPS * 1e3,
    )
    del q, k, v, kv, kv_ref, out, out_ref, out_tri
    return rec


def cases(tiny):
    if tiny:
        yield "decode x2 @40", "qwen3-0.6b", [39, 20], [1, 1]
        yield "prefill 24 over 16", "qwen3-0.6b", [16], [24]
        yield "mixed", "llama-3.1-8b", [30, 16], [1, 9]
        return
    for model in MODELS:
        for b in (1, 8, 64, 256):
            yield f"decode x{b} @1k", model, [1023] * b, [1] * b
        for chunk, prefix in ((512, 0), (512, 4096), (1024, 1024), (2048, 0), (2048, 2048), (1024, 3072)):
            yield f"prefill {chunk} over {prefix}", model, [prefix], [chunk]
        yield "mixed 64 dec @1k + 512 over 1k", model, [1023] * 64 + [1024], [1] * 64 + [512]


def env() -> dict:
    import triton

    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        commit = "unknown"
    return dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                commit=commit, command=" ".join([sys.executable] + sys.argv))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/attention_kernels.json")
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter smoke test")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --tiny for the CPU interpreter smoke test)")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    t_start = time.time()
    records = []
    hdr = (f"{'model':13s} {'case':32s} {'relerr':>8s} {'tri_attn':>9s} {'tri_fwd':>9s} {'ref':>9s} "
           f"{'xref':>6s} {'roof':>8s} {'%roof':>6s} {'TFLOP/s':>8s}")
    print(hdr, flush=True)
    for name, model, ctx, ql in cases(args.tiny):
        rec = run_case(name, model, ctx, ql, dtype, args.block_size, device)
        records.append(rec)
        print(f"{model:13s} {name:32s} {rec['max_rel_err']:8.1e} {rec['triton_attn_ms']*1e3:7.1f}us "
              f"{rec['triton_forward_ms']*1e3:7.1f}us {rec['torch_ref_ms']*1e3:7.1f}us "
              f"{rec['speedup_vs_ref']:5.1f}x {rec['roofline_ms']*1e3:6.1f}us "
              f"{100*rec['attn_frac_of_roofline']:5.1f}% {rec['attn_tflops']:8.1f}"
              + ("" if rec["ok"] else "  MISMATCH"), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    result = dict(env=env(), hbm_bytes_per_s=HBM_BYTES_PER_S, wall_s=time.time() - t_start, results=records,
                  all_ok=all(r["ok"] for r in records))
    out = args.out
    if not out.endswith(".json"):
        os.makedirs(out, exist_ok=True)
        out = os.path.join(out, "attention_kernels.json")
    else:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"all_ok={result['all_ok']} wall={result['wall_s']:.0f}s -> {out}")
    sys.exit(0 if result["all_ok"] else 1)


if __name__ == "__main__":
    main()
