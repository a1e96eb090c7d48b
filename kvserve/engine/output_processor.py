"""Frontend side of a request: its own state, detokenization, stop strings, ``n`` fan-in, outputs.

The frontend never holds the engine core's ``Request``: each child request has a
``RequestState`` here, updated from the core's ``EngineCoreOutput`` deltas (new tokens,
logprobs, finish reason, timings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from kvserve.engine.core_types import EngineCoreOutput, EngineCoreRequest
from kvserve.engine.detokenizer import DetokenizerSpec, IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


class RequestState:
    """One child request as the frontend knows it (built from an ``EngineCoreRequest``)."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "arrival_time", "output_token_ids",
                 "logprobs", "finish_reason", "stop_reason", "num_cached_tokens", "first_scheduled_time",
                 "first_token_time", "finished_time", "num_preemptions", "prompt_logprobs",
                 "num_draft_tokens", "num_accepted_tokens", "kv_transfer_params")

    def __init__(self, req: EngineCoreRequest) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = req.prompt_token_ids
        self.sampling_params = req.sampling_params
        self.arrival_time = req.arrival_time
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, tuple[float, int]]] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[Union[int, str]] = None
        self.num_cached_tokens = -1
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None
        self.num_preemptions = 0
        self.prompt_logprobs: Optional[list] = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.kv_transfer_params: Optional[dict] = None

    def apply(self, o: EngineCoreOutput) -> None:
        """Fold one engine-core output into this state."""
        self.output_token_ids.extend(o.new_token_ids)
        if o.new_logprobs:
            self.logprobs.extend(o.new_logprobs)
        self.num_cached_tokens = o.num_cached_tokens
        self.first_scheduled_time = o.first_scheduled_time
        self.first_token_time = o.first_token_time
        self.finished_time = o.finished_time
        self.num_preemptions = o.num_preemptions
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        self.num_draft_tokens = o.num_draft_tokens
        self.num_accepted_tokens = o.num_accepted_tokens
        if o.kv_transfer_params is not None:
            self.kv_transfer_params = o.kv_transfer_params
        if o.finish_reason is not None:
            self.finish_reason = o.finish_reason
            self.stop_reason = o.stop_reason

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class _SeqState:
    """Per-completion text state."""

    index: int
    request: RequestState
    text: str = ""
    stop_reason: Optional[str] = None
    finish_reason: Optional[str] = None
    streamed: int = 0  # characters already handed out by ``take_delta``
    detok: Optional[IncrementalDetokenizer] = None  # built on the first decode
    cum_logprob: float = 0  # the sum of the first ``cum_count`` sampled tokens' logprobs
    cum_count: int = 0


@dataclass
class ParentState:
    """A user request: a prompt and its ``n`` completions (child requests)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    seqs: list[_SeqState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # n = 1: read every step for every request
            return seqs[0].finish_reason is not None
        return all(s.finish_reason is not None for s in seqs)


class OutputProcessor:
    """Turns engine-core token updates into text, finds stop strings, builds RequestOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # Each completion's text is decoded incrementally (a short window of its last tokens per
        # step), identical to ``tokenizer.decode(output_token_ids)`` (detokenizer.py).
        self.detokenizer_spec = DetokenizerSpec(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, _SeqState]] = {}
        # Open children without stop strings -> their output token list: a plain decode row
        # that needs no ``process`` is one append (``apply_plain``). Dropped when the child closes.
        self._token_lists: dict[str, list[int]] = {}

    def add(self, parent: ParentState, children: list[EngineCoreRequest]) -> None:
        self.parents[parent.request_id] = parent
        for i, child in enumerate(children):
            seq = _SeqState(i, RequestState(child))
            parent.seqs.append(seq)
            self.child_to_parent[child.request_id] = (parent, seq)
            if not child.sampling_params.stop:
                self._token_lists[child.request_id] = seq.request.output_token_ids

    def apply_outputs(self, outputs: list[EngineCoreOutput]) -> list[tuple[RequestState, int]]:
        """Fold engine-core outputs into the children's states; returns ``(state, number of
        new tokens)`` for each child still open (outputs of unknown or closed children are
        dropped)."""
        updated = []
        for o in outputs:
            entry = self.child_to_parent.get(o.request_id)
            if entry is None or entry[1].finish_reason is not None:
                continue
            req = entry[1].request
            req.apply(o)
            updated.append((req, len(o.new_token_ids)))
        return updated

    def apply_plain(self, req_ids: list[str], token_ids: list[int], stop_only: bool = False) -> list[RequestState]:
        """Append the plain decode rows' tokens (``EngineCoreOutputs.plain_req_ids``: one new
        token, nothing else new). Returns the states of the children still open, in order; with
        ``stop_only`` only those with stop strings (the rest need nothing from ``process``
        unless the caller detokenizes every step: they are running, so their parent is too).
        Rows of unknown or closed children are dropped."""
        out = []
        child_to_parent = self.child_to_parent
        lists = self._token_lists
        for rid, tok in zip(req_ids, token_ids):
            if stop_only and (toks := lists.get(rid)) is not None:
                toks.append(tok)  # open, no stop strings: nothing for ``process`` to do
                continue
            entry = child_to_parent.get(rid)
            if entry is None:
                continue
            seq = entry[1]
            if seq.finish_reason is not None:
                continue
            req = seq.request
            req.output_token_ids.append(tok)
            if not stop_only or req.sampling_params.stop:
                out.append(req)
        return out

    def _decode(self, seq: _SeqState) -> str:
        """``tokenizer.decode(output_token_ids, skip_special_tokens=...)``, decoded incrementally."""
        if self.tokenizer is None:
            return ""
        d = seq.detok
        if d is None:
            req = seq.request
            d = seq.detok = self.detokenizer_spec.new(req.output_token_ids, req.sampling_params.skip_special_tokens)
        return d.update()

    def process(self, updated: list[RequestState], detokenize_all: bool) -> tuple[list[ParentState], list[str]]:
        """Handle requests that got a token this step.

        Returns the parents touched and the child ids that hit a stop string (the caller
        must finish them in the engine core).
        """
        touched: dict[str, ParentState] = {}
        stopped: list[str] = []
        child_to_parent = self.child_to_parent
        for req in updated:
            entry = child_to_parent.get(req.request_id)
            if entry is None:
                continue
            parent, seq = entry
            touched[parent.request_id] = parent
            sp = req.sampling_params
            finished = req.finish_reason is not None  # RequestState.is_finished, read once (hot)
            if not (sp.stop or detokenize_all or finished):
                continue
            text = self._decode(seq)
            if sp.stop:
                # A stop string may straddle tokens: search the new tail plus overlap.
                start = max(0, len(seq.text) - max(len(s) for s in sp.stop) + 1)
                best = None
                for s in sp.stop:
                    j = text.find(s, start)
                    if j >= 0 and (best is None or j < best[0]):
                        best = (j, s)
                if best is not None:
                    text = text[: best[0]]
                    seq.stop_reason = best[1]
                    seq.finish_reason = "stop"
                    if not req.is_finished:
                        stopped.append(req.request_id)
            seq.text = text
            if finished and seq.finish_reason is None:
                seq.finish_reason = req.finish_reason
                seq.stop_reason = req.stop_reason
            if seq.finish_reason is not None:
                self._token_lists.pop(req.request_id, None)
        return list(touched.values()), stopped

    def abort(self, child_id: str) -> None:
        entry = self.child_to_parent.get(child_id)
        if entry is not None and entry[1].finish_reason is None:
            entry[1].finish_reason = "abort"
        self._token_lists.pop(child_id, None)

    def take_delta(self, parent: ParentState, index: int = 0) -> str:
        """New text of completion ``index`` since the last call (held back while it could
        still be cut by a stop string, or ends inside a multi-byte character)."""
        seq = parent.seqs[index]
        end = len(seq.text)
        if seq.finish_reason is None:
            sp = seq.request.sampling_params
            if sp.stop:
                end -= max(len(s) for s in sp.stop) - 1
            while end > seq.streamed and seq.text[end - 1] == "\ufffd":
                end -= 1
        if end <= seq.streamed:
            return ""
        delta = seq.text[seq.streamed : end]
        seq.streamed = end
        return delta

    def make_output(self, parent: ParentState, since: Optional[list[tuple[int, int]]] = None) -> RequestOutput:
        """The request's ``RequestOutput`` now: per completion the text, token ids, logprobs and
        cumulative logprob. ``since[i]``: ``(tokens, logprobs)`` of completion ``i`` already handed
        out (a streaming delta): its outputs then carry only what follows, and nothing before is
        copied. The cumulative logprob is kept as a running sum (each token added once)."""
        outs = []
        for seq in parent.seqs:
            req = seq.request
            toks = req.output_token_ids
            t0, l0 = since[seq.index] if since is not None else (0, 0)
            lps = cum = None
            if req.sampling_params.logprobs is not None:
                lps = req.logprobs[l0:]
                n = min(len(req.logprobs), len(toks))
                c = seq.cum_logprob
                for lp, t in zip(req.logprobs[seq.cum_count:n], toks[seq.cum_count:n]):
                    if t in lp:
                        c += lp[t][0]
                seq.cum_logprob, seq.cum_count = c, n
                cum = c
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=toks[t0:],
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=lps,
                cumulative_logprob=cum,
            ))
        first = parent.seqs[0].request
        if len(parent.seqs) == 1:  # n = 1, the common case: the request's own figures
            metrics = RequestMetrics(
                arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
                first_token_time=first.first_token_time or None,
                finished_time=(first.finished_time or None) if parent.finished else None,
                num_preemptions=first.num_preemptions, num_draft_tokens=first.num_draft_tokens,
                num_accepted_tokens=first.num_accepted_tokens,
            )
        else:
            ftt = [s.request.first_token_time for s in parent.seqs if s.request.first_token_time]
            fin = [s.request.finished_time for s in parent.seqs if s.request.finished_time]
            metrics = RequestMetrics(
                arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
                first_token_time=min(ftt) if ftt else None,
                finished_time=max(fin) if parent.finished and fin else None,
                num_preemptions=sum(s.request.num_preemptions for s in parent.seqs),
                num_draft_tokens=sum(s.request.num_draft_tokens for s in parent.seqs),
                num_accepted_tokens=sum(s.request.num_accepted_tokens for s in parent.seqs),
            )
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=outs, finished=parent.finished, metrics=metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0), prompt_logprobs=first.prompt_logprobs,
            kv_transfer_params=first.kv_transfer_params,
        )

    def remove(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for seq in parent.seqs:
            self.child_to_parent.pop(seq.request.request_id, None)
            self._token_lists.pop(seq.request.request_id, None)


__all__ = ["OutputProcessor", "ParentState", "RequestState"]
