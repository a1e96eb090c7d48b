"""The batched host paths of a step equal the per-request ones they replace: one sampled token
per request appended over the batch (``InputBatch.append_sampled``), the all-greedy sampling
metadata built in one pass, and the vectorized ``update_cached`` under a decode batch with
rows that roll back (rejected drafts) and rows that get new blocks."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from kvserve.core.sched_output import CachedRequestData, NewRequestData
from kvserve.sample import metadata as sample_metadata
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch


def _batch(n: int, bs: int = 4, width_tokens: int = 24, seed: int = 0) -> InputBatch:
    rng = random.Random(seed)
    b = InputBatch(2, width_tokens, bs, [-(-width_tokens // bs)])  # starts small: rows grow
    for i in range(n):
        p = rng.randint(1, 12)
        b.add_request(NewRequestData(f"r{i}", [rng.randrange(100) for _ in range(p)], [], SamplingParams(),
                                     2, [list(range(1 + 10 * i, 1 + 10 * i + -(-p // bs)))], p - 1))
    return b


def test_append_sampled_equals_append_tokens():
    a, b = _batch(9), _batch(9)
    rng = random.Random(1)
    for step in range(20):  # past the starting width: token rows grow on the way
        ids = [f"r{i}" for i in range(9)] + ["gone"]
        rng.shuffle(ids)
        toks = [rng.randrange(100) for _ in ids]
        for rid, t in zip(ids, toks):
            a.append_tokens(rid, [t])
        b.append_sampled(ids, toks)
    assert a.token_ids.shape == b.token_ids.shape
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
    for rid, st in a.states.items():
        assert st.output_token_ids == b.states[rid].output_token_ids and len(st.output_token_ids) == 20
    b.append_sampled(["gone"], [5])  # nothing left to append: no error


def test_update_cached_batched_equals_per_request():
    bs = 4
    a = _batch(6, bs)
    rows = {r: st.row for r, st in a.states.items()}
    before = {r: (a.block_tables[0].table[rows[r]].copy(), int(a.block_tables[0].num_blocks[rows[r]]))
              for r in rows}
    # r1 rolls back to 1 computed token (1 block kept), r2 gets two blocks, r3 one token, others as they are.
    nc = {r: int(a.num_computed[rows[r]]) for r in rows}
    nc["r1"] = 1
    new_blocks = {"r2": ([500, 501],), "r4": ([600],)}
    toks = {"r3": [77]}
    ids = list(rows)
    a.update_cached(CachedRequestData(ids, [new_blocks.get(r) for r in ids], [nc[r] for r in ids],
                                      [toks.get(r, []) for r in ids]))
    for r in ids:
        row = rows[r]
        tbl, n = before[r]
        assert a.num_computed[row] == nc[r]
        keep = min(n, -(-nc[r] // bs)) if r == "r1" else n
        extra = list(new_blocks.get(r, ([],))[0])
        assert a.block_tables[0].num_blocks[row] == keep + len(extra)
        assert list(a.block_tables[0].table[row, :keep + len(extra)]) == list(tbl[:keep]) + extra
    assert a.states["r3"].output_token_ids == [77]


def _requests(params: list[SamplingParams]):
    class R:
        def __init__(self, sp):
            self.sampling_params, self.prompt_token_ids, self.output_token_ids = sp, [3, 4], [5]
            self.eos_token_id, self.generator = 2, None

    return [R(sp) for sp in params]


def test_all_greedy_metadata_equals_the_general_path(monkeypatch):
    reqs = _requests([SamplingParams(temperature=0.0, seed=s, max_tokens=4) for s in (None, 3, None)])
    fast = sample_metadata.build_sampling_metadata(reqs, 32, "cpu")
    monkeypatch.setattr(sample_metadata, "plain_greedy", lambda sp: False)
    general = sample_metadata.build_sampling_metadata(reqs, 32, "cpu")
    assert dataclasses.asdict(fast) == dataclasses.asdict(general)
    assert fast.all_greedy and not fast.all_random


def test_greedy_with_extras_takes_the_general_path():
    for kw in (dict(logprobs=2), dict(min_tokens=3), dict(repetition_penalty=1.2), dict(presence_penalty=0.5)):
        md = sample_metadata.build_sampling_metadata(_requests([SamplingParams(temperature=0.0, **kw)]), 32, "cpu")
        filled = [md.logprobs_idx, md.min_tokens_rows, md.output_ids]
        assert any(t is not None for t in filled), kw
    logits = torch.randn(3, 32)
    md = sample_metadata.build_sampling_metadata(_requests([SamplingParams(temperature=0.0)] * 3), 32, "cpu")
    from kvserve.sample.sampler import Sampler

    assert torch.equal(Sampler().sample(logits, md), logits.argmax(-1))


def test_top_k_top_p_without_the_full_sort_equals_the_sorted_path():
    from kvserve.sample.sampler import apply_top_k_top_p

    g = torch.Generator().manual_seed(0)
    V = 300
    logits = torch.randn(64, V, generator=g) * 3
    top_k = torch.randint(1, 40, (64,), generator=g)
    top_p = torch.rand(64, generator=g).clamp_min(0.05)
    top_p[::7] = 1.0  # top-k alone in some rows
    fast = apply_top_k_top_p(logits, top_k, top_p, max_top_k=int(top_k.max()))
    full = apply_top_k_top_p(logits, top_k, top_p, max_top_k=V)  # a row without top-k: the full sort
    assert torch.equal(fast, full)
    kept = torch.isfinite(fast).sum(-1)
    assert (kept >= 1).all() and (kept <= top_k).all() and (kept[::7] == top_k[::7]).all()


def test_sampling_extra_reqs_follow_the_batch():
    """The input batch's set of requests that sample by more than a plain argmax (the runner
    skips the sampler's per-request check while it is empty)."""
    b = _batch(3)  # SamplingParams(): temperature 1, not plain greedy
    assert b.sampling_extra_reqs == {"r0", "r1", "r2"}
    kinds = {"g": SamplingParams(temperature=0.0), "lp": SamplingParams(temperature=0.0, logprobs=1),
             "pen": SamplingParams(temperature=0.0, repetition_penalty=1.1)}
    for rid, sp in kinds.items():
        b.add_request(NewRequestData(rid, [3, 4], [], sp, 2, [[99]], 1))
    assert b.sampling_extra_reqs == {"r0", "r1", "r2", "lp", "pen"}
    for rid in ("r0", "r1", "r2", "lp", "pen", "never"):
        b.remove_request(rid)
    assert not b.sampling_extra_reqs and set(b.states) == {"g"}
    assert all(sample_metadata.plain_greedy(st.sampling_params) for st in b.states.values())
