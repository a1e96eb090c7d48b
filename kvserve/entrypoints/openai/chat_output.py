"""A chat choice's text read back as OpenAI's message: ``reasoning_content`` (``--reasoning-parser``),
``content`` and ``tool_calls`` (``tool_choice`` auto with ``--tool-call-parser``), non-streamed
and as SSE deltas.

Streaming re-parses the text received so far at each step (``final=False``): every parser
returns prefixes of its final result there (partial markers held back), so each delta is the
new suffix, and the deltas of a choice add up to the non-streamed message. Tool calls are
sent whole when the choice ends. With a reasoning parser the content loses its leading
whitespace (the blank line after ``</think>``), and while a tool call may follow, trailing
whitespace is held back until the end.

Used when a reasoning parser is on (tool_choice none or auto) or the tool-call parser needs
special tokens (``deepseek_v3``, gpt-oss's ``openai``); the plain tool paths are ``tool_stream``.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from kvserve.entrypoints.openai import protocol as P
from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.harmony import harmony_split
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from kvserve.entrypoints.openai.sse import merge, sse
from kvserve.entrypoints.openai.tool_parsers import ToolCall
from kvserve.entrypoints.openai.tools import ToolMode


class ChatOutputParser:
    """Reasoning, content and tool calls of one choice's text. ``prompt_opened``: the prompt ends
    inside a reasoning block (the template opened ``<think>``)."""

    def __init__(self, reasoning: Optional[ReasoningParser], mode: ToolMode, prompt_opened: bool = False) -> None:
        self.reasoning, self.mode, self.prompt_opened = reasoning, mode, prompt_opened
        self.tool_parser = mode.parser if mode.kind == "auto" else None

    @staticmethod
    def applies(reasoning: Optional[ReasoningParser], mode: ToolMode) -> bool:
        """Whether a request with this parser and mode goes through this class."""
        if reasoning is not None and mode.kind in ("none", "auto"):
            return True
        return mode.kind == "auto" and (mode.parser.harmony or mode.parser.needs_special_tokens)

    @property
    def needs_special_tokens(self) -> bool:
        return bool((self.reasoning is not None and self.reasoning.needs_special_tokens)
                    or (self.tool_parser is not None and self.tool_parser.needs_special_tokens))

    def parse(self, text: str, final: bool = True) -> tuple[str, str, list[ToolCall]]:
        """``(reasoning, content, calls)``; "" for none. ``final=False``: prefixes, no calls."""
        rp, tp = self.reasoning, self.tool_parser
        calls: list[ToolCall] = []
        if tp is not None and tp.harmony:
            r, c, _ = harmony_split(text, final)
            if final:
                calls = tp.extract(text)[1]
            r = r if rp is not None else ""
        else:
            r, c = rp.split(text, final, self.prompt_opened) if rp is not None else ("", text)
            if rp is not None:
                c = c.lstrip()
            if tp is not None:
                c = c.replace("<｜end▁of▁sentence｜>", "") if tp.needs_special_tokens else c
                if final:
                    content, calls = tp.extract(c)
                    c = content or ""
                else:
                    c = c[:tp.safe_prefix_len(c)].rstrip()
        if final and not self.mode.parallel:
            calls = calls[:1]
        return r, c, calls

    def message(self, text: str, finish: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """``(assistant message, finish_reason)`` of a finished choice."""
        r, c, calls = self.parse(text, True)
        msg: dict[str, Any] = {"role": "assistant", "content": c or None}
        if self.reasoning is not None:
            msg["reasoning_content"] = r or None
        if self.mode.active:
            msg["tool_calls"] = [call.to_openai() for call in calls]
        if calls and finish == "stop":
            finish = "tool_calls"
        return msg, finish


async def stream_parsed_chat(serving, req, rid: str, gen, n_prompt: int, sp,
                             parser: ChatOutputParser) -> AsyncIterator[str]:
    """The SSE lines of a streamed chat completion read by ``parser`` (see the module doc)."""
    created, model = P.now(), serving.model_name

    def chunk(index: int, delta: dict, finish=None, stop_reason=None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "stop_reason": stop_reason}]}
        if req.include_usage:
            body["usage"] = None
        return sse(body)

    acc: dict[int, str] = {}
    sent: dict[int, list[int]] = {}
    n_gen = n_cached = 0
    try:
        for i in range(sp.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for _, out in merge([gen]):
            if out.finished:
                n_cached = out.num_cached_tokens
            for co in out.outputs:
                i = co.index
                n_gen += len(co.token_ids)
                acc[i] = acc.get(i, "") + co.text
                done = co.finish_reason is not None
                r, c, calls = parser.parse(acc[i], final=done)
                sr, sc = sent.setdefault(i, [0, 0])
                if len(r) > sr:
                    yield chunk(i, {"reasoning_content": r[sr:]})
                if len(c) > sc:
                    yield chunk(i, {"content": c[sc:]})
                sent[i] = [max(sr, len(r)), max(sc, len(c))]
                if not done:
                    continue
                if calls:
                    yield chunk(i, {"tool_calls": [call.to_openai(k) for k, call in enumerate(calls)]})
                finish = "tool_calls" if calls and co.finish_reason == "stop" else co.finish_reason
                yield chunk(i, {}, finish, co.stop_reason)
        if req.include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": P.usage(n_prompt, n_gen, n_cached)})
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        yield sse(APIError.from_exception(exc).body())
    yield sse("[DONE]")
