"""Llama 3.x JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` (optionally
after ``<|python_tag|>``), several separated by ``;``."""

from __future__ import annotations

import json
from typing import Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolCall,
    ToolParser,
    call_from_obj,
    register_tool_parser,
)


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    start_markers = ("<|python_tag|>", "{")

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].lstrip()
        if not body.startswith("{"):
            return text, []
        dec = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = call_from_obj(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def safe_prefix_len(self, text: str) -> int:
        # A JSON call starts the output; any other first character means plain content.
        s = text.lstrip()
        if not s or s.startswith("{") or "<|python_tag|>".startswith(s[:14]) or s.startswith("<|python_tag|>"):
            return 0
        return len(text)
