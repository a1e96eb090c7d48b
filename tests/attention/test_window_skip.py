"""Sliding-window layers never read blocks below their window: every backend (cpu, torch_ref,
and the Triton decode / prefill kernels, in the interpreter without CUDA) gives the float64
dense answer when the block-table entries below each request's window point at a NaN block
(the hybrid KV cache manager frees those blocks; their entries become the null block)."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import view_of
from kvserve.attention.registry import get_attn_backend

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _case(reqs, window, bs=4, heads=(4, 2), d=16, seed=0):
    """Metadata, q/k/v and a cache for ``reqs`` = [(cached, new)], decodes first; entries below
    each request's window point at a NaN block. Returns (meta, q, k, v, cache, dense output)."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    nbs = [-(-(c + n) // bs) for c, n in reqs]
    num_blocks = sum(nbs) + 2  # + the null block 0 and the poison block 1
    perm = (torch.randperm(num_blocks - 2, generator=g) + 2).tolist()
    bt = torch.zeros(len(reqs), max(nbs), dtype=torch.int32)
    o = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = torch.tensor(perm[o:o + nb])
        o += nb
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g)
    cache[:, 0] = 0.0
    t = sum(n for _, n in reqs)
    q, k, v = (torch.randn(t, x, d, generator=g) for x in (h, hkv, hkv))
    # Dense float64 reference over the true blocks (new K/V in place).
    dense = torch.empty(t, h, d, dtype=torch.float64)
    slots, qsl = [], [0]
    for i, (c, n) in enumerate(reqs):
        s = c + n
        pos = torch.arange(s)
        kk = cache[0, bt[i, pos // bs].long(), pos % bs].double().clone()
        vv = cache[1, bt[i, pos // bs].long(), pos % bs].double().clone()
        kk[c:], vv[c:] = k[qsl[-1]:qsl[-1] + n].double(), v[qsl[-1]:qsl[-1] + n].double()
        kk, vv = (x.repeat_interleave(h // hkv, 1).transpose(0, 1) for x in (kk, vv))
        qpos = torch.arange(c, s)[:, None]
        mask = (pos[None] <= qpos) & (pos[None] > qpos - window)
        sc = (q[qsl[-1]:qsl[-1] + n].double().transpose(0, 1) @ kk.transpose(1, 2)) * d ** -0.5
        dense[qsl[-1]:qsl[-1] + n] = (sc.masked_fill(~mask, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
        slots += [int(bt[i, p // bs]) * bs + p % bs for p in range(c, s)]
        qsl.append(qsl[-1] + n)
        skip = max(c - window + 1, 0) // bs  # blocks no query of this request sees
        bt[i, :skip] = 1
    cache[:, 1] = float("nan")
    qlens, slens = [n for _, n in reqs], [c + n for c, n in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), block_tables=bt.to(DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=DEV),
        query_lens_cpu=qlens, seq_lens_cpu=slens, max_query_len=max(qlens), max_seq_len=max(slens),
        num_decodes=next((i for i, n in enumerate(qlens) if n != 1), len(qlens)),
    )
    return meta, q.to(DEV), k.to(DEV), v.to(DEV), cache.to(DEV), dense


@pytest.mark.parametrize("backend", ["cpu", "torch_ref", "triton"])
@pytest.mark.parametrize("window", [1, 6, 8])
def test_blocks_below_the_window_are_never_read(backend, window):
    if backend == "triton":
        pytest.importorskip("triton")
    # Decodes far past the window (and one inside it), then prefill chunks that start past it.
    reqs = [(40, 1), (3, 1), (71, 1), (23, 1), (37, 9), (16, 5), (2, 13)]
    meta, q, k, v, cache, dense = _case(reqs, window, seed=window)
    impl = get_attn_backend(backend)
    out = impl.forward(q, k, v, view_of(cache), meta, q.shape[-1] ** -0.5, window)
    assert not out.isnan().any(), "a block below the window was read"
    torch.testing.assert_close(out.cpu().double(), dense, rtol=1e-4, atol=1e-4)
