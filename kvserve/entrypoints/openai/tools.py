"""``tools`` / ``tool_choice`` on chat completions: which mode a request runs in, the
structured-output constraint that enforces ``"required"`` and named calls, and the calls read
back from the output.

Modes (OpenAI's, with vLLM's server flags):

- ``"none"``: tools are not shown to the model and nothing is parsed.
- named (``{"type": "function", "function": {"name": N}}``): the output is constrained to
  the JSON schema of N's ``parameters``; it is returned as one call of N.
- ``"required"``: the output is constrained to a JSON array (>= 1 item; 1 without
  ``parallel_tool_calls``) of ``{"name": <a tool>, "parameters": <its schema>}``.
- ``"auto"`` (the default when ``tools`` are given): needs ``--enable-auto-tool-choice`` and
  ``--tool-call-parser``; the model writes freely and the parser finds calls in its text.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvserve.entrypoints.openai.tool_parsers import ToolCall, ToolParser
from kvserve.sampling_params import StructuredOutputsParams


class ToolMode:
    """The resolved mode: ``kind`` in none | auto | required | named; ``name`` for named."""

    __slots__ = ("kind", "name", "parser", "parallel")

    def __init__(self, kind: str, name: Optional[str] = None, parser: Optional[ToolParser] = None,
                 parallel: bool = True) -> None:
        self.kind, self.name, self.parser, self.parallel = kind, name, parser, parallel

    @property
    def active(self) -> bool:
        return self.kind != "none"


def _params_schema(tool: Any) -> dict:
    schema = tool.function.parameters
    return dict(schema) if schema else {"type": "object", "properties": {}}


def resolve_tool_mode(req: Any, enable_auto_tool_choice: bool, tool_parser: Optional[str]) -> ToolMode:
    """The request's mode. Raises ValueError (400) naming ``tool_choice`` / ``tools``."""
    from kvserve.entrypoints.openai.tool_parsers import get_tool_parser

    tools, choice = req.tools or [], req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice == "none":
            return ToolMode("none")
        if not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        if choice == "required":
            return ToolMode("required", parallel=parallel)
        if choice == "auto":
            if not enable_auto_tool_choice or not tool_parser:
                raise ValueError('tool_choice "auto" needs the server to run with --enable-auto-tool-choice '
                                 'and --tool-call-parser (or use "required", "none" or a named function)')
            return ToolMode("auto", parser=get_tool_parser(tool_parser), parallel=parallel)
        raise ValueError(f"tool_choice must be none, auto, required or a named function, got {choice!r}")
    name = choice.function.name
    if not any(t.function.name == name for t in tools):
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return ToolMode("named", name=name, parallel=parallel)


def tool_structured_outputs(req: Any, mode: ToolMode) -> Optional[StructuredOutputsParams]:
    """The constraint enforcing ``required`` / named calls (None for none / auto)."""
    if mode.kind == "named":
        tool = next(t for t in req.tools if t.function.name == mode.name)
        return StructuredOutputsParams(json=_params_schema(tool))
    if mode.kind != "required":
        return None
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _params_schema(t)},
              "required": ["name", "parameters"]} for t in req.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not mode.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def extract_calls(mode: ToolMode, text: str) -> tuple[Optional[str], list[ToolCall]]:
    """``(content, calls)`` of a finished output under ``mode``."""
    if mode.kind == "named":
        return None, [ToolCall(mode.name, text)]
    if mode.kind == "required":
        try:
            arr = json.loads(text)
        except json.JSONDecodeError:  # cut by max_tokens: no valid call
            return text, []
        return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in arr]
    if mode.kind == "auto":
        content, calls = mode.parser.extract(text)
        if not mode.parallel:
            calls = calls[:1]
        return content, calls
    return text, []


def template_tools(req: Any, mode: ToolMode) -> Optional[list[dict]]:
    """The tools as the chat template expects them (OpenAI's dicts), None in mode none."""
    if not mode.active or not req.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]
