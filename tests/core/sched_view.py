"""Test helpers: a scheduler step seen with the scheduler's own objects, and a fake model.

``view(s, out)`` must be taken right after ``s.schedule()`` (before the update): it pairs the
step's data (``SchedulerOutput``) with the ``Request`` objects, the computed counts before the
step, which requests sample, and group 0's block ids and copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.request import Request


@dataclass
class StepView:
    out: SchedulerOutput
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.out.is_empty

    @property
    def num_scheduled_tokens(self) -> int:
        return self.out.total_num_scheduled_tokens


def view(s, out: SchedulerOutput, preempted_objs: dict[str, Request] | None = None) -> StepView:
    """The step as the old tests saw it (sync scheduling: a request samples iff it got a
    pending token from this schedule)."""
    v = StepView(out)
    before = {rid: nc for rid, nc in zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens)}
    before.update({n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs})
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        v.scheduled.append((r, n))
        v.num_computed.append(before[rid])
        v.samples.append(r.num_pending_tokens > 0)
        v.block_ids[rid] = s.kv.get_block_ids(rid)[0]
    v.preempted = [s.requests[rid] for rid in out.preempted_req_ids]
    v.kv_copies = [(op.src, op.dst, op.num_tokens) for op in out.block_ops]
    return v


def runner_output(sampled: dict[str, int]) -> ModelRunnerOutput:
    """A fake model's output: one token per request id."""
    return ModelRunnerOutput(sampled_token_ids={rid: [t] for rid, t in sampled.items()})


def schedule(s) -> StepView:
    return view(s, s.schedule())


def update(s, v: StepView, sampled: dict[str, int]):
    """``update_from_output`` with one token per request id; returns the updated requests."""
    return [r for r, _, _ in s.update_from_output(v.out, runner_output(sampled))]
