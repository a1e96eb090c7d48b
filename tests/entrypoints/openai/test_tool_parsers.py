"""Tool-call parsers (hermes, llama3_json): whole outputs and the streaming safe prefix."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names


def test_registry():
    assert {"hermes", "llama3_json"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_hermes():
    p = get_tool_parser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = p.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls[0].id != calls[1].id
    assert p.extract("no calls here") == ("no calls here", [])
    assert p.extract("<tool_call>{not json</tool_call>")[1] == []
    # Streaming: content before the marker is safe; a partial marker at the end is held back.
    assert p.safe_prefix_len("Hello <tool") == len("Hello ")
    assert p.safe_prefix_len("Hello <tool_call>{") == len("Hello ")
    assert p.safe_prefix_len("Hello") == 5


def test_llama3_json():
    p = get_tool_parser("llama3_json")
    content, calls = p.extract('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert p.extract("Sure, here you go.") == ("Sure, here you go.", [])
    assert p.extract('{"a": 1}')[1] == []  # JSON but not a call
    assert p.safe_prefix_len('{"name"') == 0 and p.safe_prefix_len("Plain") == 5


def _run_stream(mode_kind, pieces, parser="hermes", name=None):
    """Drive ``stream_tool_chat`` with a scripted output; return (content, calls, finish)."""
    import asyncio
    from types import SimpleNamespace as NS

    from kvserve.entrypoints.openai.tool_stream import stream_tool_chat
    from kvserve.entrypoints.openai.tools import ToolMode

    async def gen():
        for k, text in enumerate(pieces):
            last = k == len(pieces) - 1
            yield NS(finished=last, num_cached_tokens=0,
                     outputs=[NS(index=0, text=text, token_ids=[1], finish_reason="stop" if last else None,
                                 stop_reason=None)])

    mode = ToolMode(mode_kind, name=name, parser=get_tool_parser(parser) if mode_kind == "auto" else None)

    async def collect():
        lines = []
        async for line in stream_tool_chat(NS(model_name="m"), NS(include_usage=False), "id", gen(), 3,
                                           NS(n=1), mode):
            lines.append(line)
        return lines

    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    content, calls, finish = "", {}, None
    for line in lines[:-1]:
        ch = json.loads(line[len("data: "):])["choices"][0]
        d = ch["delta"]
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            cur = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            cur["id"] = tc.get("id") or cur["id"]
            cur["name"] += (tc.get("function") or {}).get("name") or ""
            cur["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        finish = ch["finish_reason"] or finish
    return content, calls, finish


def test_stream_auto_hermes_reassembles():
    text = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    content, calls, finish = _run_stream("auto", pieces)
    ref_content, ref_calls = get_tool_parser("hermes").extract(text)
    assert content.strip() == ref_content and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in ref_calls]
    # No call: everything arrives as content, finish stays "stop".
    content, calls, finish = _run_stream("auto", ["Just ", "text <tool", " not a call"])
    assert content == "Just text <tool not a call" and not calls and finish == "stop"


def test_stream_named_and_required():
    content, calls, finish = _run_stream("named", ['{"city"', ': "Rome"}'], name="get_weather")
    assert calls == {0: {"id": calls[0]["id"], "name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert finish == "stop" and calls[0]["id"]
    arr = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    content, calls, finish = _run_stream("required", [arr[:10], arr[10:]])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("f", {"x": 1}), ("g", {})]
    assert finish == "tool_calls" and not content
