"""Hermes (NousResearch) tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks, as Hermes 2 Pro, Qwen2.5 and SmolLM2's tool format write them."""

from __future__ import annotations

import json
import re
from typing import Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolCall,
    ToolParser,
    call_from_obj,
    register_tool_parser,
)

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    start_markers = ("<tool_call>",)

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        i = text.find("<tool_call>")
        if i < 0:
            return text, []
        calls = []
        for body in _BLOCK.findall(text[i:]):
            try:
                call = call_from_obj(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[:i].strip()
        return content or None, calls
