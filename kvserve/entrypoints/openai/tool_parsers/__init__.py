"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``), vLLM's names.

A parser turns a model's raw text into ``(content, [ToolCall])``. Streaming is by
buffering: text is streamed as content until the parser's start marker may begin; from
there the rest is held back and parsed when the output ends, then sent as tool-call deltas.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.tool_parsers import deepseek_v3, gpt_oss, hermes, llama3_json  # noqa: F401  (register)
from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolCall,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)

__all__ = ["ToolCall", "ToolParser", "get_tool_parser", "register_tool_parser", "tool_parser_names"]
