"""The tool-call parser interface, its result record and the parsers' registry.

Parsers (``hermes``, ``llama3_json``, ``deepseek_v3``, ``openai``) import this module and register themselves;
``kvserve.entrypoints.openai.tool_parsers`` imports them all and looks them up by name.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class ToolCall:
    """One function call; ``arguments`` is a JSON object as a string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


class ToolParser:
    """Base class. ``start_markers``: strings that open a tool call; content before the first
    one is plain text."""

    start_markers: tuple[str, ...] = ()
    #: The markers are special tokens: detokenize with ``skip_special_tokens=False``.
    needs_special_tokens = False
    #: Reads a whole harmony output (gpt-oss channels) rather than content after a marker.
    harmony = False

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """``(content or None, calls)``; no calls when the text holds none (or only broken ones)."""
        raise NotImplementedError

    def safe_prefix_len(self, text: str) -> int:
        """How many leading characters of ``text`` are surely content (no start marker begins
        in them): a streaming frontend may send those before the output ends."""
        cut = len(text)
        for m in self.start_markers:
            i = text.find(m)
            if i >= 0:
                cut = min(cut, i)
                continue
            # A marker may be starting at the end of the text: hold its partial prefix back.
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return cut


def call_from_obj(obj) -> Optional[ToolCall]:
    """``{"name": ..., "arguments"|"parameters": {...}}`` -> ToolCall (None if not that shape)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_PARSERS: dict[str, Callable[[], ToolParser]] = {}


def register_tool_parser(name: str):
    def deco(cls):
        _PARSERS[name] = cls
        return cls
    return deco



def get_tool_parser(name: str) -> ToolParser:
    """A parser by name. Raises ValueError naming the known ones."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(_PARSERS)}")
    return _PARSERS[name]()


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)
