"""Chat responses with tools: the non-streamed message and the SSE stream of OpenAI
tool-call deltas (``choices[].delta.tool_calls[]``: the first delta of a call carries its
``id``, ``type`` and ``function.name``; later ones append to ``function.arguments``)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from kvserve.entrypoints.openai import protocol as P
from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.sse import merge, sse
from kvserve.entrypoints.openai.tool_parsers import ToolCall
from kvserve.entrypoints.openai.tools import ToolMode, extract_calls


def _finish(mode: ToolMode, calls: list[ToolCall], finish: Optional[str]) -> Optional[str]:
    # OpenAI reports "tool_calls" when the model chose to call (auto / required); a forced
    # named call ends with "stop".
    if calls and finish == "stop" and mode.kind in ("auto", "required"):
        return "tool_calls"
    return finish


def tool_message(mode: ToolMode, text: str, finish: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
    """``(assistant message, finish_reason)`` of one finished choice."""
    if not mode.active:
        return {"role": "assistant", "content": text}, finish
    content, calls = extract_calls(mode, text)
    msg = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
    return msg, _finish(mode, calls, finish)


async def stream_tool_chat(serving, req, rid: str, gen, n_prompt: int, sp, mode: ToolMode) -> AsyncIterator[str]:
    """The SSE lines of a streamed chat completion whose tools are active (see module doc)."""
    created, model = P.now(), serving.model_name

    def chunk(index: int, delta: dict, finish=None, stop_reason=None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "stop_reason": stop_reason}]}
        if req.include_usage:
            body["usage"] = None
        return sse(body)

    acc: dict[int, str] = {}
    sent: dict[int, int] = {}
    named: dict[int, ToolCall] = {}
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
                if mode.kind == "named":
                    if i not in named:
                        named[i] = call = ToolCall(mode.name, "")
                        first = call.to_openai(0)
                        yield chunk(i, {"tool_calls": [first]})
                    if co.text:
                        yield chunk(i, {"tool_calls": [{"index": 0, "function": {"arguments": co.text}}]})
                elif mode.kind == "auto":
                    safe = mode.parser.safe_prefix_len(acc[i])
                    if safe > sent.get(i, 0):
                        yield chunk(i, {"content": acc[i][sent.get(i, 0):safe]})
                        sent[i] = safe
                if co.finish_reason is None:
                    continue
                calls: list[ToolCall] = []
                if mode.kind == "named":
                    calls = [named[i]]
                else:
                    _, calls = extract_calls(mode, acc[i])
                    if calls:
                        yield chunk(i, {"tool_calls": [c.to_openai(k) for k, c in enumerate(calls)]})
                    elif len(acc[i]) > sent.get(i, 0):
                        yield chunk(i, {"content": acc[i][sent.get(i, 0):]})
                yield chunk(i, {}, _finish(mode, calls, co.finish_reason), co.stop_reason)
        if req.include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": P.usage(n_prompt, n_gen, n_cached)})
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        yield sse(APIError.from_exception(exc).body())
    yield sse("[DONE]")
