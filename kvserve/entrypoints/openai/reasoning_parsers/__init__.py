"""Reasoning parsers (``--reasoning-parser NAME``, vLLM's names): split a chat completion's text
into ``reasoning_content`` (the model's chain of thought) and ``content`` (its answer).

- ``qwen3``: ``<think>...</think>`` then the answer. With thinking off (``enable_thinking``
  false) Qwen3's template pre-fills an empty think block and the output is all content; when
  the template opens ``<think>`` in the prompt (Qwen3-Thinking-2507), the output starts inside it.
- ``deepseek_r1``: the same tags, but the output always starts inside the reasoning (R1's
  template ends the prompt with ``<think>\\n``); an unclosed block is all reasoning.
- ``openai_gptoss``: gpt-oss's harmony channels (``kvserve.entrypoints.openai.harmony``): the
  ``analysis`` channel is the reasoning, ``final`` the content.

A parser's ``split(text, final, prompt_opened)`` gives ``(reasoning, content)``; for a partial
text (``final=False``, streaming) both are prefixes of what the whole text gives, so streamed
deltas add up to the non-streamed message.
"""

from __future__ import annotations

from typing import Callable

from kvserve.entrypoints.openai.harmony import harmony_split, held_back


class ReasoningParser:
    """Base class. ``needs_special_tokens``: the markers are special tokens, so the text must be
    detokenized with ``skip_special_tokens=False``."""

    needs_special_tokens = False
    #: Text whose presence at the end of the prompt means the output starts inside the reasoning.
    open_marker: str = ""

    def split(self, text: str, final: bool = True, prompt_opened: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text`` ("" for none)."""
        raise NotImplementedError


class ThinkTagReasoningParser(ReasoningParser):
    """``<think>reasoning</think>content``. ``always_opened``: the output starts inside the
    reasoning even without ``<think>`` (DeepSeek-R1)."""

    start, end = "<think>", "</think>"
    open_marker = "<think>"
    always_opened = False

    def split(self, text: str, final: bool = True, prompt_opened: bool = False) -> tuple[str, str]:
        opened = prompt_opened or self.always_opened
        body, s = text, text.lstrip()
        if s.startswith(self.start):
            opened, body = True, s[len(self.start):]
        elif not final and not opened and self.start.startswith(s):
            return "", ""  # may still become <think>: undecided
        if not opened:
            return "", text
        i = body.find(self.end)
        if i < 0:
            return (body if final else body[:len(body) - held_back(body, (self.end,))]), ""
        return body[:i], body[i + len(self.end):]


_PARSERS: dict[str, Callable[[], ReasoningParser]] = {}


def register_reasoning_parser(name: str):
    def deco(cls):
        _PARSERS[name] = cls
        return cls
    return deco


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    pass


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    always_opened = True


@register_reasoning_parser("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    needs_special_tokens = True

    def split(self, text: str, final: bool = True, prompt_opened: bool = False) -> tuple[str, str]:
        reasoning, content, _ = harmony_split(text, final)
        return reasoning, content


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A parser by name. Raises ValueError naming the known ones."""
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (--reasoning-parser); choose one of "
                         f"{reasoning_parser_names()}")
    return _PARSERS[name]()
