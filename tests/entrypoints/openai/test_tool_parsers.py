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
