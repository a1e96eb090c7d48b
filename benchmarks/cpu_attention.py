"""CPU: decode attention of one step (all layers), torch_ref vs the cpu backend.

A step is ``--layers`` attention calls over per-layer paged caches sharing one metadata
object, as in the engine; shapes default to SmolLM2-135M (9 heads, 3 KV heads, head
dim 64, 30 layers) at batch 64 with context lengths uniform in ``--ctx``. Backends run
interleaved, ``--reps`` times each; medians of wall ms per step are printed (and the
thread CPU ms with ``--threads 1``, which other jobs on a shared machine disturb less).

    python benchmarks/cpu_attention.py --dtype bfloat16 --batch 64 --ctx 200:700
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve.attention.registry import get_attn_backend
from kvserve.attention.cpu_backend import CpuAttentionMetadata, CpuBackend
from kvserve.attention.kv_format import view_of

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def make_step(batch: int, lo: int, hi: int, args, gen: torch.Generator):
    """Metadata for ``batch`` decodes with context lengths in [lo, hi], blocks shuffled, and
    ``args.layers`` random caches."""
    bs = args.block_size
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    nbs = [-(-n // bs) for n in lens]
    num_blocks = sum(nbs) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    bt = torch.zeros(batch, max(nbs), dtype=torch.int32)
    o = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = torch.tensor(perm[o : o + nb])
        o += nb
    slots = [int(bt[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
    dtype = _DTYPES[args.dtype]
    caches = [torch.randn(2, num_blocks, bs, args.kv_heads, args.head_dim, generator=gen).to(dtype)
              for _ in range(args.layers)]

    def meta() -> CpuAttentionMetadata:
        return CpuAttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=bt,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), query_lens_cpu=[1] * batch, seq_lens_cpu=lens,
            max_query_len=1, max_seq_len=max(lens), num_decodes=batch,
        )

    return meta, caches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", default="200:700", help="LO:HI context length, uniform")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--chunk-tokens", default=str(CpuBackend().chunk_tokens),
                   help="comma-separated cpu-backend chunk sizes to compare")
    p.add_argument("--exact-scores", action="store_true",
                   help="also time the cpu backend with float32-exact scores (exact_scores=True)")
    p.add_argument("--json", default=None, help="write the per-rep times here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    lo, hi = (int(x) for x in args.ctx.split(":"))
    gen = torch.Generator().manual_seed(0)
    meta, caches = make_step(args.batch, lo, hi, args, gen)
    dtype = _DTYPES[args.dtype]
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(args.batch, h, d, generator=gen).to(dtype)
    k = torch.randn(args.batch, hkv, d, generator=gen).to(dtype)
    v = torch.randn(args.batch, hkv, d, generator=gen).to(dtype)
    backends = {"torch_ref": get_attn_backend("torch_ref")}
    for c in args.chunk_tokens.split(","):
        backends[f"cpu(chunk={c})"] = CpuBackend(chunk_tokens=int(c))
        if args.exact_scores:
            backends[f"cpu(chunk={c},exact)"] = CpuBackend(chunk_tokens=int(c), exact_scores=True)

    def step(backend) -> None:
        m = meta()  # fresh per step: per-step plans are part of the cost
        for cache in caches:
            backend.forward(q, k, v, view_of(cache), m, d**-0.5)

    times: dict[str, list[float]] = {n: [] for n in backends}
    with torch.inference_mode():
        ref = backends["torch_ref"].forward(q, k, v, view_of(caches[0]), meta(), d**-0.5).float()
        for name, b in backends.items():
            err = (b.forward(q, k, v, view_of(caches[0]), meta(), d**-0.5).float() - ref).abs().max().item()
            print(f"{name:24s} max |diff| vs torch_ref {err:.2e}")
            step(b)  # warm-up: buffers, oneDNN primitives
        for _ in range(args.reps):
            for name, b in backends.items():
                t = clock()
                step(b)
                times[name].append((clock() - t) * 1e3)
    base = statistics.median(times["torch_ref"])
    print(f"batch {args.batch}, ctx {args.ctx}, {args.dtype}, {args.layers} layers, threads "
          f"{torch.get_num_threads()} ({'thread CPU' if clock is time.thread_time else 'wall'} ms per step)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:24s} median {med:8.2f}  min {min(ts):8.2f}  speedup {base / med:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ms_per_step": times}, f, indent=1)


if __name__ == "__main__":
    main()
