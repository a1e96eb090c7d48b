"""gpt-oss tool calls (``--tool-call-parser openai``): harmony messages addressed to
``functions.NAME`` on the ``commentary`` channel, their body the JSON arguments, ended by
``<|call|>`` (``kvserve.entrypoints.openai.harmony``). Content is the ``final`` channel (and
preambles); the ``analysis`` channel is left to ``--reasoning-parser openai_gptoss``."""

from __future__ import annotations

import json
from typing import Optional

from kvserve.entrypoints.openai.harmony import harmony_split
from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolCall,
    ToolParser,
    register_tool_parser,
)


@register_tool_parser("openai")
class OpenAIHarmonyToolParser(ToolParser):
    needs_special_tokens = True
    #: Parses the whole harmony output (channels), not content after a start marker.
    harmony = True

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        _, content, msgs = harmony_split(text, final=True)
        calls = []
        for m in msgs:
            try:
                obj = json.loads(m.body) if m.body.strip() else {}
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                calls.append(ToolCall(m.recipient[len("functions."):], json.dumps(obj, ensure_ascii=False)))
        return content or None, calls

    def safe_prefix_len(self, text: str) -> int:
        return 0  # markup, not content: the chat output pipeline streams the harmony content itself
