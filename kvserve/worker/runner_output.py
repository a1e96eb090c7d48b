"""A launched step's result: sampled tokens on their way to the host, then verified drafts.

``AsyncModelRunnerOutput.get()`` waits for the step's one device->host copy, unpacks the
sampler's tokens (and logprobs), verifies draft tokens, appends every new token to the
worker's input batch (the worker's own record of each request), asks the proposer for the
next drafts, and returns a ``ModelRunnerOutput``.

Draft verification here is greedy: the target's argmax at each of a request's ``1 + k``
positions is computed on the device; drafts are accepted while they equal it, and the
target's token at the first mismatch (or after the last draft) is appended, so the output
is exactly what plain greedy decoding gives (Leviathan et al., arXiv:2211.17192, at
temperature 0). Requests that sample at temperature > 0 are never given drafts here.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.core.sched_output import ModelRunnerOutput


def verify_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """Tokens a request gets for ``drafts`` ``[k]`` given the target's greedy choices
    ``[k + 1]``: the longest agreeing prefix of the drafts, then the target's next token."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return drafts[:a] + [targets[a]]


class AsyncModelRunnerOutput:
    """A launched step; ``get()`` returns its ``ModelRunnerOutput`` (call it once).

    Args:
        req_ids: requests sampled by the sampler, in its row order.
        packed / md: the sampler's packed device result and metadata (None when none).
        spec: ``(req_ids, drafts, argmax [sum(1 + k)] long device tensor)`` for requests that
            verified drafts, or None.
        event: CUDA event recorded after the copies were issued (None on the CPU).
        runner: the model runner (its sampler, input batch and proposer).
        prompt_logprobs: ``ModelRunnerOutput.prompt_logprobs`` of this step (host data).
    """

    def __init__(self, req_ids: list[str], packed, md, spec, event, runner, prompt_logprobs=None) -> None:
        self._prompt_logprobs = prompt_logprobs or {}
        self.req_ids = req_ids
        self._packed = packed
        self._md = md
        self._spec = spec
        self._event = event
        self._runner = runner

    def get(self) -> ModelRunnerOutput:
        out = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs)
        if self._event is not None:
            self._event.synchronize()
        runner = self._runner
        batch = runner.input_batch
        if self.req_ids:
            s = runner.sampler.unpack(self._packed.tolist(), self._md)
            for rid, tok, lp in zip(self.req_ids, s.sampled_token_ids, s.logprobs):
                out.sampled_token_ids[rid] = [tok]
                if lp is not None:
                    out.logprobs[rid] = [lp]
        if self._spec is not None:
            rids, drafts, targets = self._spec
            flat = targets.tolist()
            pos = 0
            for rid, d in zip(rids, drafts):
                out.sampled_token_ids[rid] = verify_greedy(d, flat[pos:pos + len(d) + 1])
                pos += len(d) + 1
        for rid, toks in out.sampled_token_ids.items():
            batch.append_tokens(rid, toks)
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
