"""Tests for kvserve.sample: behaviour checked against independent reference computations."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from kvserve.worker.input_batch import CachedRequestState
from kvserve.sample import Sampler, apply_penalties, apply_top_k_top_p
from kvserve.sample import build_sampling_metadata, token_counts
from kvserve.sampling_params import SamplingParams

V = 50
_counter = 0


def make_req(prompt=(1, 2, 3), output=(), eos=None, **sp) -> CachedRequestState:
    """A request as the worker holds it (what the sampler reads)."""
    global _counter
    _counter += 1
    return CachedRequestState(f"r{_counter}", list(prompt), list(output), SamplingParams(**sp), eos, row=0)


def rand_logits(b, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * scale


sampler = Sampler()


# --- greedy

def test_greedy_is_argmax():
    logits = rand_logits(8)
    reqs = [make_req(temperature=0.0) for _ in range(8)]
    out = sampler(logits, reqs)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = rand_logits(6, seed=1)
    # random rows restricted to one token via top_k=1, so every row is predictable
    reqs = [make_req(temperature=0.0) if i % 2 else make_req(temperature=1.0, top_k=1) for i in range(6)]
    out = sampler(logits, reqs)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy():
    for seed in range(5):
        logits = rand_logits(4, seed=seed)
        reqs = [make_req(temperature=1.5, top_k=1) for _ in range(4)]
        assert sampler(logits, reqs).sampled_token_ids == logits.argmax(-1).tolist()


def test_input_logits_not_modified():
    logits = rand_logits(3)
    before = logits.clone()
    reqs = [
        make_req(output=[1, 1, 2], repetition_penalty=1.5, frequency_penalty=0.5, min_tokens=5, eos=3),
        make_req(temperature=0.7, top_p=0.5, min_p=0.1, logprobs=2),
        make_req(temperature=0.0, presence_penalty=1.0, output=[4]),
    ]
    sampler(logits, reqs)
    assert torch.equal(logits, before)


# --- seeds

def test_seed_reproduces():  # same seed + logits -> same tokens; the generator advances
    logits = rand_logits(1, scale=0.5)  # flat distribution: many plausible tokens
    first = sampler(logits, [make_req(seed=1234)]).sampled_token_ids[0]
    runs = []
    for _ in range(3):
        r = make_req(seed=1234)
        runs.append([sampler(logits, [r]).sampled_token_ids[0] for _ in range(10)])
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] == first
    assert len(set(runs[0])) > 1
    other = make_req(seed=4321)
    assert [sampler(logits, [other]).sampled_token_ids[0] for _ in range(10)] != runs[0]


def test_seeded_request_independent_of_batch():
    steps = 8
    logits_seq = [rand_logits(5, seed=100 + s, scale=0.5) for s in range(steps)]

    def seeded():
        return make_req(seed=7, temperature=0.9, top_p=0.95, top_k=40, logprobs=1)

    # alone (row 0 of each step's logits)
    alone_req = seeded()
    alone = []
    for s in range(steps):
        tok = sampler(logits_seq[s][:1], [alone_req]).sampled_token_ids[0]
        alone_req.output_token_ids.append(tok)
        alone.append(tok)

    # batched with unseeded, other-seeded and greedy requests; the seeded one is row 2
    torch.manual_seed(999)
    target = seeded()
    others = [make_req(temperature=1.0), make_req(seed=3, min_p=0.05), make_req(temperature=0.0), make_req()]
    batched = []
    for s in range(steps):
        lg = logits_seq[s]
        lg = torch.cat([lg[1:3], lg[:1], lg[3:5]])  # target's row moves to position 2
        out = sampler(lg, [others[0], others[1], target, others[2], others[3]])
        tok = out.sampled_token_ids[2]
        target.output_token_ids.append(tok)
        for i, r in enumerate(others):
            r.output_token_ids.append(out.sampled_token_ids[[0, 1, 3, 4][i]])
        batched.append(tok)
    assert batched == alone
    assert len(set(alone)) > 1


def test_generator_created_lazily_on_request():
    r = make_req(seed=5)
    assert r.generator is None
    sampler(rand_logits(1), [r])
    assert isinstance(r.generator, torch.Generator) and r.generator.device == torch.device("cpu")
    assert r.generator.initial_seed() == 5
    unseeded = make_req()
    sampler(rand_logits(1), [unseeded])
    assert unseeded.generator is None


# --- filtering

def _allowed(logits_row, temperature, top_k, top_p, min_p):
    """Independent reference: set of token ids the filters allow (float64, plain Python)."""
    vals = [float(x) / temperature for x in logits_row]
    order = sorted(range(len(vals)), key=lambda i: -vals[i])
    if top_k > 0:
        order = order[:top_k]
    m = max(vals[i] for i in order)
    w = {i: math.exp(vals[i] - m) for i in order}
    z = sum(w.values())
    p = {i: w[i] / z for i in order}
    kept, mass = [], 0.0
    for i in order:  # nucleus: smallest prefix with mass >= top_p (tolerance for fp32)
        kept.append(i)
        mass += p[i]
        if mass >= top_p - 1e-6:
            break
    pmax = max(p[i] for i in kept)
    return {i for i in kept if p[i] >= min_p * pmax - 1e-7}


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 5, 1.0, 0.0),
        (0.7, 0, 0.6, 0.0),
        (1.3, 0, 1.0, 0.2),
        (1.0, 10, 0.8, 0.0),
        (2.0, 12, 0.9, 0.1),
        (1.0, 3, 0.3, 0.5),
        (1.0, 4, 0.8, 0.3),
    ],
)
def test_filters_never_emit_outside_allowed_set(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    B, draws = 16, 40
    logits = rand_logits(B, seed=11, scale=2.0)
    allowed = [_allowed(logits[i].tolist(), temperature, top_k, top_p, min_p) for i in range(B)]
    # half the rows seeded, so both noise paths are checked
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    reqs = [make_req(seed=i if i % 2 else None, **kw) for i in range(B)]
    seen = [set() for _ in range(B)]
    for _ in range(draws):
        out = sampler(logits, reqs)
        for i, t in enumerate(out.sampled_token_ids):
            assert t in allowed[i], (i, t, sorted(allowed[i]))
            seen[i].add(t)
    # the filters do not collapse sampling either: rows with several allowed tokens vary
    multi = [len(s) > 1 for s, a in zip(seen, allowed) if len(a) > 1]
    assert not multi or any(multi)


def test_filters_mixed_rows_in_one_batch():
    torch.manual_seed(1)
    cfgs = [(1.0, 4, 1.0, 0.0), (0.8, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.3), (1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0)]
    logits = rand_logits(len(cfgs), seed=5, scale=2.0)
    reqs = [make_req(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in cfgs]
    allowed = [
        _allowed(logits[i].tolist(), t, k, p, m) if t > 0 else {int(logits[i].argmax())}
        for i, (t, k, p, m) in enumerate(cfgs)
    ]
    for _ in range(50):
        out = sampler(logits, reqs)
        for i, t in enumerate(out.sampled_token_ids):
            assert t in allowed[i]


def test_top_p_keeps_top_token_and_exact_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    for p, n_kept in [(0.01, 1), (0.5, 1), (0.6, 2), (0.8, 2), (0.9, 3), (0.96, 4)]:
        out = apply_top_k_top_p(logits, None, torch.tensor([p]))
        kept = torch.isfinite(out[0]).nonzero().flatten().tolist()
        assert kept == list(range(n_kept)), (p, kept)
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.9]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]


def test_random_sampling_matches_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = torch.log(probs).unsqueeze(0).expand(400, V).contiguous()
    reqs = [make_req(temperature=1.0) for _ in range(400)]
    counts = torch.zeros(V)
    for _ in range(5):
        for t in sampler(logits, reqs).sampled_token_ids:
            counts[t] += 1
    freq = counts / counts.sum()
    assert counts[3:].sum() == 0
    assert torch.allclose(freq[:3], probs[:3], atol=0.03), freq[:3]


# --- penalties

def _ref_penalize(logits_row, prompt, output, rep, freq, pres):
    out = list(map(float, logits_row))
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        x = out[t]
        if t in seen:
            x = x / rep if x > 0 else x * rep
        c = output.count(t)
        x -= freq * c
        x -= pres * (1 if c > 0 else 0)
        out[t] = x
    return out


def test_penalties_exact_values():
    logits = rand_logits(3, seed=3)
    logits[0, 7] = 4.0
    logits[0, 8] = -4.0
    cfgs = [
        dict(prompt=[7, 8, 9], output=[7, 10, 10, 10], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        dict(prompt=[1], output=[2, 2], repetition_penalty=1.0, frequency_penalty=-1.0, presence_penalty=1.5),
        dict(prompt=[3], output=[4], repetition_penalty=1.0),  # no penalty row
    ]
    reqs = [make_req(prompt=c.pop("prompt"), output=c.pop("output"), temperature=0.0, **c) for c in cfgs]
    md = build_sampling_metadata(reqs, V, "cpu")
    got = Sampler.process_logits(logits, md)
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        pens = (sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty)
        ref = _ref_penalize(logits[i].tolist(), r.prompt_token_ids, r.output_token_ids, *pens)
        assert torch.allclose(got[i], torch.tensor(ref), atol=1e-5), i
    assert got[0, 7].item() == pytest.approx(4.0 / 2.0 - 0.5 - 0.25)
    assert got[0, 8].item() == pytest.approx(-8.0)  # prompt-only: negative logit * 2
    assert got[0, 10].item() == pytest.approx(logits[0, 10].item() * (1 / 2.0 if logits[0, 10] > 0 else 2.0) - 1.5 - 0.25)


def test_apply_penalties_helper_and_counts():
    ids = torch.tensor([[1, 1, 3, V], [V, V, V, V]])
    counts = token_counts(ids, V)
    assert counts.shape == (2, V)
    assert counts[0, 1] == 2 and counts[0, 3] == 1 and counts[0].sum() == 3 and counts[1].sum() == 0
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0] + [0.0] * (V - 4)] * 2)
    prompt_mask = torch.zeros(2, V, dtype=torch.bool)
    prompt_mask[:, 0] = True
    out = apply_penalties(
        logits, prompt_mask, counts, torch.tensor([2.0, 2.0]), torch.tensor([0.1, 0.1]), torch.tensor([1.0, 1.0])
    )
    assert out[0, :4].tolist() == pytest.approx([1.0, -4.0 - 0.2 - 1.0, 2.0, -4.0 - 0.1 - 1.0])
    assert out[1, :4].tolist() == pytest.approx([1.0, -2.0, 2.0, -2.0])


@pytest.mark.parametrize(
    "kw", [dict(repetition_penalty=100.0), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)]
)
def test_strong_penalty_avoids_repeated_token(kw):
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0  # best token, already in the output
    logits[0, 9] = 0.5
    plain = make_req(output=[7], temperature=0.0)
    assert sampler(logits, [plain]).sampled_token_ids == [7]
    pen = make_req(output=[7], temperature=0.0, **kw)
    assert sampler(logits, [pen]).sampled_token_ids == [9]


def test_frequency_penalty_scales_with_count():
    logits = torch.zeros(2, V)
    logits[:, 5] = 1.5
    logits[:, 6] = 1.0
    once = make_req(output=[5], temperature=0.0, frequency_penalty=1.0)
    twice = make_req(output=[5, 5], temperature=0.0, frequency_penalty=1.0)
    # 1.5 - 1 = 0.5 < 1.0 ; 1.5 - 2 < 1.0 ; with 0.4: once 1.1 > 1.0, twice 0.7 < 1.0
    assert sampler(logits, [once, twice]).sampled_token_ids == [6, 6]
    once = make_req(output=[5], temperature=0.0, frequency_penalty=0.4)
    twice = make_req(output=[5, 5], temperature=0.0, frequency_penalty=0.4)
    assert sampler(logits, [once, twice]).sampled_token_ids == [5, 6]


def test_no_penalty_metadata_when_unused():
    md = build_sampling_metadata([make_req(output=[1, 2]), make_req(temperature=0.0)], V, "cpu")
    assert md.no_penalties and md.output_ids is None and md.prompt_ids is None
    assert md.min_tokens_rows is None and md.logprobs_idx is None
    assert md.top_k is None and md.top_p is None and md.min_p is None
    md = build_sampling_metadata([make_req(temperature=0.0)], V, "cpu")
    assert md.all_greedy and md.temperature is None


# --- min_tokens

def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(4, V)
    logits[:, 2] = 10.0  # eos
    logits[:, 11] = 9.0  # stop id
    logits[:, 12] = 8.0  # stop id
    logits[:, 20] = 1.0
    reqs = [
        make_req(eos=2, stop_token_ids=[11, 12], min_tokens=3, output=[5, 5], temperature=0.0),
        make_req(eos=2, stop_token_ids=[11, 12], min_tokens=3, output=[5, 5, 5], temperature=0.0),  # reached
        make_req(eos=2, stop_token_ids=[11, 12], min_tokens=1),  # random row: never eos/stop
        make_req(eos=None, min_tokens=2, temperature=0.0),  # no eos known, no stop ids
    ]
    for _ in range(20):
        out = sampler(logits, reqs)
        assert out.sampled_token_ids[0] == 20
        assert out.sampled_token_ids[1] == 2
        assert out.sampled_token_ids[2] not in (2, 11, 12)
        assert out.sampled_token_ids[3] == 2


# --- logprobs

@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_logprobs_match_log_softmax_of_raw_logits(n):
    torch.manual_seed(0)
    logits = rand_logits(4, seed=21)
    reqs = [
        make_req(logprobs=n, temperature=1.0, repetition_penalty=1.7, output=[0, 1], presence_penalty=1.0),
        make_req(temperature=0.8),  # no logprobs
        make_req(logprobs=n, temperature=0.0, frequency_penalty=2.0, output=[int(logits[2].argmax())]),
        make_req(logprobs=max(n, 2), temperature=2.0, top_k=3),
    ]
    ref = torch.log_softmax(logits, dim=-1)
    for _ in range(5):
        out = sampler(logits, reqs)
        assert out.logprobs[1] is None
        for i in (0, 2, 3):
            d = out.logprobs[i]
            want_n = reqs[i].sampling_params.logprobs
            top = ref[i].topk(want_n).indices.tolist()
            tok = out.sampled_token_ids[i]
            assert set(d) == set(top) | {tok}
            for t, (lp, rank) in d.items():
                assert lp == pytest.approx(ref[i, t].item(), abs=1e-6)
                assert rank == int((ref[i] > ref[i, t]).sum()) + 1
            for r, t in enumerate(top):
                assert d[t][1] == r + 1
    # greedy row 2 was pushed off its argmax by the penalty; its sampled rank is not 1
    assert out.logprobs[2][out.sampled_token_ids[2]][1] > 1


def test_all_rows_logprobs_and_tokens_consistent():
    logits = rand_logits(3, seed=8)
    reqs = [make_req(logprobs=V + 10, temperature=0.0) for _ in range(3)]
    out = sampler(logits, reqs)
    for i in range(3):
        assert len(out.logprobs[i]) == V
        assert out.logprobs[i][out.sampled_token_ids[i]][1] == 1
        assert sum(math.exp(lp) for lp, _ in out.logprobs[i].values()) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_semantics():
    logits = rand_logits(4).cuda()
    reqs = [make_req(temperature=0.0, logprobs=2), make_req(seed=3, top_k=5), make_req(top_p=0.5), make_req()]
    for r in reqs:
        r.output_token_ids.append(1)
    reqs.append(make_req(output=[1], repetition_penalty=1.3, min_tokens=3, eos=2, logprobs=1))
    logits = torch.cat([logits, rand_logits(1, seed=9).cuda()])
    sampler(logits, reqs)  # warm-up (allocations, generator creation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = sampler(logits, reqs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1  # the single device->host copy of the packed results
    assert out.sampled_token_ids[0] == int(logits[0].argmax())
    assert reqs[1].generator.device.type == "cuda"
    assert out.logprobs[0] is not None and out.logprobs[1] is None
