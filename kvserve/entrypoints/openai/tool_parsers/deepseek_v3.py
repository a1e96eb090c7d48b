"""DeepSeek-V3 / R1 tool calls: ``<｜tool▁calls▁begin｜>`` then per call
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`` and
``<｜tool▁calls▁end｜>``. The V3.1 shape ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``
is read too. The markers are special tokens: the text is detokenized with them kept."""

from __future__ import annotations

import json
import re
from typing import Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolCall,
    ToolParser,
    register_tool_parser,
)

CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
EOS = "<｜end▁of▁sentence｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)",
                   re.DOTALL)
_FENCED = re.compile(r"^\s*(\S+)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.DOTALL)


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(ToolParser):
    start_markers = (CALLS_BEGIN, CALL_BEGIN)
    needs_special_tokens = True

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        text = text.replace(EOS, "")
        i = min((j for j in (text.find(m) for m in self.start_markers) if j >= 0), default=-1)
        if i < 0:
            return text, []
        calls = []
        for head, rest in _CALL.findall(text[i:]):
            m = _FENCED.match(rest)
            if m is not None:  # V3: "function" <sep> name \n ```json ... ```
                name, args = m.group(1), m.group(2)
            else:  # V3.1: name <sep> args
                name, args = head.strip(), rest.strip()
            try:
                obj = json.loads(args)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and name:
                calls.append(ToolCall(name, json.dumps(obj, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:i].strip() or None, calls
