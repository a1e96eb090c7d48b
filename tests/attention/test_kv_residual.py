"""The filling block kept exact (kvserve/attention/kv_residual.py) in torch_ref and the CPU backend:
the position rule against a dense oracle, and the same outputs however a sequence is cut into
prefill chunks, decodes and mixed steps."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.cpu_backend import CpuBackend
from kvserve.attention.forward_context import AttentionMetadata, ResidualMetadata
from kvserve.attention.kv_format import format_of_spec, view_of
from kvserve.attention.kv_quant import dequantize, quantize
from kvserve.attention.kv_residual import residual_shape, residual_slot_mapping, written_early
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.core.kv_cache_spec import FullAttentionSpec, get_kv_format

BS = 4


def _requests(lens, h, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, x, d, generator=g) for x in (h, hkv, hkv)) for n in lens]


class Stepper:
    """Drives a backend step by step over one paged cache and residual (``BS``-token blocks):
    ``step({request: n})`` computes the next ``n`` positions of each request from ``reqs``
    (``(q, k, v)`` per request); ``ctx`` may be lowered between steps (a rollback)."""

    def __init__(self, backend, reqs, dtype="int4", window=None):
        self.backend, self.reqs, self.window = backend, reqs, window
        h, hkv, d = reqs[0][0].shape[1], reqs[0][1].shape[1], reqs[0][0].shape[2]
        spec = FullAttentionSpec(BS, hkv, d, dtype, "float32")
        nbs = [-(-q.shape[0] // BS) for q, _, _ in reqs]
        self.cache = backend.allocate_kv_cache(spec, sum(nbs) + 1, torch.device("cpu"))
        self.residual = torch.zeros(residual_shape(len(reqs), BS, hkv, d))
        self.kv = view_of(self.cache, format_of_spec(spec), residual=self.residual)
        self.bt = torch.zeros(len(reqs), max(nbs), dtype=torch.int32)
        o = 1
        for i, nb in enumerate(nbs):  # blocks in reverse order: block ids never follow positions
            self.bt[i, :nb] = torch.arange(o + nb - 1, o - 1, -1)
            o += nb
        self.ctx = [0] * len(reqs)
        self.outs = [torch.zeros_like(q) for q, _, _ in reqs]

    def step(self, step: dict) -> None:
        order = sorted(step, key=lambda r: step[r] != 1)  # decodes first
        rows_q, rows_k, rows_v, slots, pos_all, qlens, slens = [], [], [], [], [], [], []
        for r in order:
            n, c = step[r], self.ctx[r]
            pos = torch.arange(c, c + n)
            q, k, v = self.reqs[r]
            rows_q.append(q[c:c + n])
            rows_k.append(k[c:c + n])
            rows_v.append(v[c:c + n])
            slots.append(self.bt[r, pos // BS].long() * BS + pos % BS)
            pos_all.append(pos)
            qlens.append(n)
            slens.append(c + n)
        qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
        pos = torch.cat(pos_all)
        req_idx = torch.repeat_interleave(torch.arange(len(order)), torch.tensor(qlens))
        rslots = torch.tensor(order)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots), block_tables=self.bt[rslots], query_start_loc=qsl,
            seq_lens=torch.tensor(slens, dtype=torch.int32), query_lens_cpu=qlens, seq_lens_cpu=slens,
            max_query_len=max(qlens), max_seq_len=max(slens), num_decodes=sum(1 for n in qlens if n == 1),
            residual=ResidualMetadata(
                rslots.to(torch.int32), torch.from_numpy(residual_slot_mapping(
                    pos.numpy(), torch.tensor(slens)[req_idx].numpy(), rslots[req_idx].numpy(), BS, len(self.reqs))),
                rslots.tolist(), written_early(qlens, slens, BS)))
        d = rows_q[0].shape[-1]
        out = self.backend.forward(torch.cat(rows_q), torch.cat(rows_k), torch.cat(rows_v), self.kv, meta,
                                   d ** -0.5, self.window)
        for j, r in enumerate(order):
            self.outs[r][self.ctx[r]:self.ctx[r] + step[r]] = out[qsl[j]:qsl[j + 1]]
            self.ctx[r] += step[r]


def run_schedule(backend, reqs, schedule, dtype="int4", window=None):
    """``Stepper`` through ``schedule`` (steps of ``{request: new tokens}``); per request its
    outputs ``[n, h, d]`` in position order."""
    st = Stepper(backend, reqs, dtype, window)
    for step in schedule:
        st.step(step)
    return st.outs


def dense_reference(q, k, v, dtype="int4", window=None):
    """Position rule in float64: keys of the query's own block exact, earlier ones through the
    format's quantize / dequantize."""
    d = q.shape[-1]
    fmt = get_kv_format(dtype)
    kq = dequantize(quantize(k, fmt), d, torch.float32, fmt).double()
    vq = dequantize(quantize(v, fmt), d, torch.float32, fmt).double()
    n, h = q.shape[0], q.shape[1]
    g = h // k.shape[1]
    out = torch.zeros(n, h, d, dtype=torch.float64)
    for p in range(n):
        own = torch.arange(n) // BS == p // BS
        kk = torch.where(own[:, None, None], k.double(), kq)[: p + 1].repeat_interleave(g, 1)
        vv = torch.where(own[:, None, None], v.double(), vq)[: p + 1].repeat_interleave(g, 1)
        s = torch.einsum("hd,jhd->hj", q[p].double(), kk) * d ** -0.5
        if window is not None:
            s[:, : max(p - window + 1, 0)] = float("-inf")
        out[p] = torch.einsum("hj,jhd->hd", s.softmax(-1), vv)
    return out


SCHEDULES = {
    "one_prefill": [{0: 13, 1: 9}],
    "chunks": [{0: 5, 1: 2}, {0: 3, 1: 3}, {0: 1, 1: 4}, {0: 4}],  # ctx inside a block, chunks over 2-3 blocks
    "decodes": [{0: 2, 1: 1}] + [{0: 1, 1: 1}] * 8 + [{0: 3}],
    "mixed": [{0: 6, 1: 1}, {0: 1, 1: 7}, {0: 1, 1: 1}, {0: 5}],
}


@pytest.mark.parametrize("backend", [TorchRefBackend(), CpuBackend(), CpuBackend(block_diagonal=False)],
                         ids=["torch_ref", "cpu", "cpu_grouped"])
@pytest.mark.parametrize("dtype", ["int4", "int2"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_residual_position_rule(backend, dtype, schedule):
    """Every schedule gives the dense oracle's outputs: own block exact, the rest quantized."""
    reqs = _requests([13, 9], h=4, hkv=2, d=16)
    outs = run_schedule(backend, reqs, SCHEDULES[schedule], dtype)
    for (q, k, v), o in zip(reqs, outs):
        torch.testing.assert_close(o.double(), dense_reference(q, k, v, dtype), atol=2e-5, rtol=2e-5)


def test_residual_with_sliding_window():
    reqs = _requests([13, 9], h=4, hkv=2, d=16, seed=1)
    for schedule in ("one_prefill", "mixed"):
        outs = run_schedule(CpuBackend(), reqs, SCHEDULES[schedule], "int4", window=6)
        for (q, k, v), o in zip(reqs, outs):
            torch.testing.assert_close(o.double(), dense_reference(q, k, v, "int4", window=6), atol=2e-5, rtol=2e-5)


def test_residual_is_what_the_own_block_reads():
    """The quantized loss is gone only inside the own block: with the residual, output differs
    from the plain quantized cache's, and equals the exact attention while p < BS."""
    reqs = _requests([BS], h=2, hkv=1, d=16, seed=2)
    q, k, v = reqs[0]
    out = run_schedule(TorchRefBackend(), reqs, [{0: 1}] * BS)[0]
    s = torch.einsum("phd,jhd->phj", q.double(), k.double()) * 16 ** -0.5
    s = s.masked_fill(torch.ones(BS, BS).triu(1).bool()[:, None, :], float("-inf"))
    exact = torch.einsum("phj,jhd->phd", s.softmax(-1), v.double())
    torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=2e-5)


def test_slot_mapping_writes_each_residual_row_once():
    """Only the last 2 B positions of a request are written (the rest go to the scratch slot), so
    a step's writes never collide, whatever the chunk length."""
    import numpy as np

    pos = np.arange(3, 40)
    rows = residual_slot_mapping(pos, np.full(len(pos), 40), np.full(len(pos), 2), BS, scratch_slot=5)
    kept = rows[rows < 5 * 2 * BS]
    assert len(kept) == len(set(kept.tolist())) == 2 * BS
    assert (rows[pos < 40 - 2 * BS] >= 5 * 2 * BS).all()
    assert rows[-1] == (2 * 2 + (39 // BS) % 2) * BS + 39 % BS


def test_fill_from_cache_gives_the_dequantized_rows():
    from kvserve.attention.kv_quant import dequantize, quantize
    from kvserve.attention.kv_residual import fill_from_cache
    from kvserve.attention.torch_ref import store_kv

    d, hkv = 16, 2
    spec = FullAttentionSpec(BS, hkv, d, "int4", "float32")
    cache = TorchRefBackend().allocate_kv_cache(spec, 4, torch.device("cpu"))
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    store_kv(k, v, view_of(cache, format_of_spec(spec)), torch.arange(2 * BS, 2 * BS + 3))  # block 2, slots 0..2
    res = torch.zeros(residual_shape(2, BS, hkv, d))
    fill_from_cache(res, cache, format_of_spec(spec), slot=1, block_id=2, block_index=5, num_tokens=3)
    fmt = get_kv_format("int4")
    torch.testing.assert_close(res[0, 1, 1, :3], dequantize(quantize(k, fmt), d, torch.float32, fmt))
    torch.testing.assert_close(res[1, 1, 1, :3], dequantize(quantize(v, fmt), d, torch.float32, fmt))
    assert not res[:, 1, 0].any() and not res[:, 0].any() and not res[:, 1, 1, 3:].any()


@pytest.mark.parametrize("dtype,granular", [("int4", False), ("int2", False), ("fp8", True), ("bfloat16", True)])
def test_prefix_hits_are_whole_blocks_when_the_filling_block_is_exact(dtype, granular):
    """int4/int2 recompute a partially cached block (its tokens' exact rows are gone): a hit then
    computes what a cold run does. Other formats copy the partial block's tokens on write."""
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.kv_cache_spec import KVCacheConfig, KVCacheGroup
    from kvserve.request import Request
    from kvserve.sampling_params import SamplingParams

    spec = FullAttentionSpec(BS, 1, 16, dtype, "float32")
    kv = KVCacheManager(KVCacheConfig([KVCacheGroup(0, [0], spec, 16)]))
    first = Request("a", list(range(12)), SamplingParams(max_tokens=4))
    kv.begin_step()
    hits, n = kv.get_computed_blocks(first)
    kv.allocate_slots(first, first.num_tokens - n, hits)
    first.num_computed_tokens = first.num_tokens
    kv.free(first)
    kv.begin_step()
    second = Request("b", list(range(10)) + [77, 78], SamplingParams(max_tokens=4))
    hits, n = kv.get_computed_blocks(second)
    assert n == (10 if granular else 8)
    assert (hits[0].partial is not None) == granular


@pytest.mark.parametrize("backend", [TorchRefBackend(), CpuBackend()], ids=["torch_ref", "cpu"])
def test_rolled_back_verify_step_across_a_block_boundary(backend):
    """A speculative-decoding verify step writes drafts past a block boundary, then all but one
    are rejected: the filling block (the other parity) still holds its exact rows, and the
    recomputed positions give the dense oracle's outputs for the final sequence."""
    final = _requests([11], h=4, hkv=2, d=16, seed=3)[0]
    draft = tuple(t.clone() for t in final)
    for t in draft:
        t[3:] = torch.randn(t[3:].shape)  # drafts 3.. differ from the final tokens
    st = Stepper(backend, [draft])
    st.step({0: 2})
    st.step({0: 4})  # positions 2..5: 2 is the verified token, 3..5 drafts (4, 5 in block 1)
    st.ctx[0] = 3  # only position 2 kept: block 0 fills on, its rows 0..2 must still be exact
    st.reqs = [final]
    for _ in range(8):
        st.step({0: 1})
    torch.testing.assert_close(st.outs[0].double()[3:], dense_reference(*final)[3:], atol=2e-5, rtol=2e-5)


def test_triton_writes_the_residual_in_the_store_kernel_for_decode_steps(monkeypatch):
    """Decode and verify steps (every CUDA-graph step) get their exact rows from the store kernel,
    no extra launch; a chunk that spans 3+ blocks writes them after attention, since its writes
    would overwrite rows its own first queries read. Both give the oracle's outputs."""
    import kvserve.attention.triton.backend as tb

    late = []
    orig = tb.store_residual
    monkeypatch.setattr(tb, "store_residual", lambda *a: (late.append(1), orig(*a)))
    reqs = _requests([13, 9], h=4, hkv=2, d=16, seed=4)
    st = Stepper(tb.TritonBackend(), reqs)
    st.step({0: 2, 1: 1})
    st.step({0: 4, 1: 1})  # verify-like: 2..5 crosses one boundary only
    assert late == []
    st.step({0: 7, 1: 1})  # 6..12 spans blocks 1, 2, 3: written after attention
    assert late == [1]
    for _ in range(6):
        st.step({1: 1})
    assert late == [1]
    for (q, k, v), o in zip(reqs, st.outs):
        torch.testing.assert_close(o.double(), dense_reference(q, k, v), atol=1e-4, rtol=1e-4)
