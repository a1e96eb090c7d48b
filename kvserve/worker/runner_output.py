"""A launched step's result: sampled tokens on their way to the host, then verified drafts.

``AsyncModelRunnerOutput.get()`` waits for the step's one device->host copy, unpacks the
sampler's tokens (and logprobs), verifies draft tokens, appends every new token to the
worker's input batch (the worker's own record of each request), asks the proposer for the
next drafts, and returns a ``ModelRunnerOutput``.

Drafts are verified by ``kvserve.spec_decode.rejection_sampler.verify``: each of a
request's ``1 + k`` positions was sampled as if the drafts before it were accepted; drafts
are kept while they equal the samples, then the sample at the first difference is appended
(speculative sampling with point proposals, Leviathan et al., arXiv:2211.17192; greedy
verification at temperature 0). Outputs have the target's distribution, and seeded requests
get the same tokens as without speculation.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.spec_decode.rejection_sampler import replay_generator, verify


def verify_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """Tokens a request gets for ``drafts`` ``[k]`` given the target's greedy choices
    ``[k + 1]`` (``rejection_sampler.verify`` at temperature 0)."""
    return verify(drafts, targets)


class AsyncModelRunnerOutput:
    """A launched step; ``get()`` returns its ``ModelRunnerOutput`` (call it once).

    Args:
        req_ids: requests sampled without drafts: the sampler's first rows, in order.
        packed / md: the sampler's packed result and metadata (None when nothing sampled).
        spec: ``(req_ids, drafts, saved generator states by request id, vocab size)`` for
            requests that verified drafts (their ``1 + k`` rows follow, in order), or None.
        event: CUDA event recorded after the copies were issued (None on the CPU).
        runner: the model runner (its sampler, input batch and proposer).
        prompt_logprobs: ``ModelRunnerOutput.prompt_logprobs`` of this step (host data).
    """

    def __init__(self, req_ids: list[str], packed, md, spec, event, runner, prompt_logprobs=None) -> None:
        self._prompt_logprobs = prompt_logprobs or {}
        self.poll = False  # an empty step (nothing computed): it only polls the KV connector
        self.kv_block_mass: dict = {}  # h2o: ModelRunnerOutput.kv_block_mass of this step
        self.tree = None  # the step's tree drafts (kvserve.spec_decode.tree.TreeVerification)
        self.req_ids = req_ids
        self._packed = packed
        self._md = md
        self._spec = spec
        self._event = event
        self._runner = runner

    def get(self) -> ModelRunnerOutput:
        out = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs, kv_block_mass=self.kv_block_mass)
        conn = getattr(self._runner, "kv_connector", None)
        if conn is not None:
            # Transfers between engines that ended by now (an empty step polls: it may wait briefly).
            out.kv_connector_output = conn.take_kv_connector_output(0.005 if self.poll else 0.0)
        if self._event is not None:
            self._event.synchronize()
        runner = self._runner
        batch = runner.input_batch
        multi: list[str] = []  # requests that got several tokens (verified drafts)
        if self._md is not None:
            s = runner.sampler.unpack(self._packed.tolist(), self._md)
            ids, lps = s.sampled_token_ids, s.logprobs
            plain = self.req_ids
            out.sampled_token_ids.update(zip(plain, [[t] for t in ids[:len(plain)]]))
            if self._md.logprobs_idx is not None:
                for rid, lp in zip(plain, lps):
                    if lp is not None:
                        out.logprobs[rid] = [lp]
            batch.append_sampled(plain, ids[:len(plain)])
            if self._spec is not None:
                rids, drafts, saved, vocab = self._spec
                pos = len(self.req_ids)
                states = batch.states
                tree = self.tree
                for rid, d in zip(rids, drafts):
                    walked = tree.accept(rid, ids[pos:pos + len(d) + 1]) if tree is not None else None
                    toks = verify(d, ids[pos:pos + len(d) + 1]) if walked is None else walked[0]
                    out.sampled_token_ids[rid] = toks
                    multi.append(rid)
                    if lps[pos] is not None:
                        out.logprobs[rid] = lps[pos:pos + len(toks)] if walked is None else \
                            [lps[pos + r] for r in walked[1]]
                    if rid in saved:
                        replay_generator(states[rid].generator, saved[rid], len(toks), vocab)
                    pos += len(d) + 1
        for rid in multi:
            batch.append_tokens(rid, out.sampled_token_ids[rid])
        if self.tree is not None:  # accepted nodes' K/V into consecutive slots, before the next step
            self.tree.finish(runner)
        load = getattr(runner, "expert_load", None)
        if load is not None and not self.poll:
            out.moe_expert_tokens = load.maybe_read()
        if runner.proposer is not None and out.sampled_token_ids:
            out.draft_token_ids = runner.propose(list(out.sampled_token_ids))
        return out


def copy_to_host(tensors: list[Optional[torch.Tensor]]) -> tuple[list, Optional[torch.cuda.Event]]:
    """Start non-blocking copies of CUDA tensors into pinned memory (CPU tensors pass through);
    returns the host tensors and an event to wait on (None without CUDA)."""
    if not any(t is not None and t.is_cuda for t in tensors):
        return tensors, None
    host = []
    for t in tensors:
        if t is None or not t.is_cuda:
            host.append(t)
            continue
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        host.append(h)
    event = torch.cuda.Event()
    event.record()
    return host, event
