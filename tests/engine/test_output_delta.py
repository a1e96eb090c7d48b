"""``OutputProcessor.make_output``: streaming deltas (``since``) carry exactly the new tokens and
logprobs, and the running cumulative logprob equals the sum over the whole output every step."""

from __future__ import annotations

import random

from kvserve import SamplingParams
from kvserve.engine.core_types import EngineCoreOutput
from kvserve.engine.input_processor import make_child_requests
from kvserve.engine.output_processor import OutputProcessor, ParentState


def test_delta_outputs_and_running_cumulative_logprob():
    rng = random.Random(3)
    op = OutputProcessor(None)
    sp = SamplingParams(max_tokens=200, n=2, logprobs=2)
    kids = make_child_requests("r", [5, 6], sp, 0.0, 0, None)
    parent = ParentState("r", None, [5, 6])
    op.add(parent, kids)
    sent = [(0, 0), (0, 0)]
    got_toks, got_lps = [[], []], [[], []]
    for step in range(40):
        outs = []
        for c in kids:
            new = [rng.randrange(100) for _ in range(rng.choice((1, 1, 2, 4)))]
            # the sampled token is usually among the returned logprobs, not always (rank > logprobs)
            lps = [{t: (-rng.random(), 1), t + 1: (-1.5, 2)} if rng.random() < 0.8 else {t + 1: (-2.0, 1)}
                   for t in new]
            outs.append(EngineCoreOutput(c.request_id, new, new_logprobs=lps))
        op.apply_outputs(outs)
        full = op.make_output(parent)
        delta = op.make_output(parent, since=sent)
        for co, dco, seq in zip(full.outputs, delta.outputs, parent.seqs):
            req = seq.request
            ref = sum(lp[t][0] for lp, t in zip(req.logprobs, req.output_token_ids) if t in lp)
            assert co.cumulative_logprob == ref == dco.cumulative_logprob  # same order: equal, not close
            assert co.token_ids == req.output_token_ids and co.token_ids is not req.output_token_ids
            t0, l0 = sent[co.index]
            assert dco.token_ids == co.token_ids[t0:] and dco.logprobs == co.logprobs[l0:]
            got_toks[co.index] += dco.token_ids
            got_lps[co.index] += dco.logprobs
        sent = [(len(c.token_ids), len(c.logprobs)) for c in full.outputs]
    for i, seq in enumerate(parent.seqs):  # the deltas add up to the whole output
        assert got_toks[i] == seq.request.output_token_ids and got_lps[i] == seq.request.logprobs


def test_no_logprobs_no_cumulative():
    op = OutputProcessor(None)
    kids = make_child_requests("q", [1], SamplingParams(max_tokens=5), 0.0, 0, None)
    parent = ParentState("q", None, [1])
    op.add(parent, kids)
    op.apply_outputs([EngineCoreOutput(kids[0].request_id, [7, 8])])
    o = op.make_output(parent, since=[(1, 0)])
    assert o.outputs[0].token_ids == [8] and o.outputs[0].logprobs is None
    assert o.outputs[0].cumulative_logprob is None


def test_single_completion_metrics_equal_the_general_rule():
    """n = 1 takes a shortcut for ``RequestMetrics``; it must equal the rule for n completions
    (earliest first token, latest finish once the request is finished, summed counters)."""
    op = OutputProcessor(None)
    for finished in (False, True):
        for ftt in (None, 0.0, 12.5):
            kids = make_child_requests("m", [1], SamplingParams(max_tokens=5), 1.0, 0, None)
            parent = ParentState("m", None, [1])
            op.add(parent, kids)
            op.apply_outputs([EngineCoreOutput(kids[0].request_id, [7], first_scheduled_time=2.0,
                                               first_token_time=ftt, finished_time=20.0 if finished else None,
                                               finish_reason="length" if finished else None, num_preemptions=2,
                                               num_draft_tokens=5, num_accepted_tokens=3)])
            m = op.make_output(parent).metrics
            r = parent.seqs[0].request
            assert m.arrival_time == r.arrival_time and m.first_scheduled_time == 2.0
            assert m.first_token_time == (min([ftt]) if ftt else None)
            assert m.finished_time == (20.0 if finished and parent.finished else None)
            assert (m.num_preemptions, m.num_draft_tokens, m.num_accepted_tokens) == (2, 5, 3)
            op.remove(parent)
