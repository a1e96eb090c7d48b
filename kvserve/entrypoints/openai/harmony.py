"""gpt-oss's harmony format, read from the detokenized text (special tokens kept).

An assistant turn is a run of messages, each ``[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL
[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` (a tool
call) or ``<|return|>`` (the last one). The prompt ends with ``<|start|>assistant``, so the
output starts at ``<|channel|>``. Channels: ``analysis`` (chain of thought), ``commentary``
(tool calls, with a ``functions.NAME`` recipient, or preambles) and ``final`` (the answer).
Format: https://cookbook.openai.com/articles/openai-harmony.

Parsed here from text rather than through the ``openai-harmony`` library: its parser works on
token ids and loads the o200k vocabulary file, which it downloads on first use; the frontend
has the text already. A partial text (streaming) parses to a prefix of what the whole text
gives: an unfinished special token at the end of a body is held back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
SPECIALS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class HarmonyMessage:
    """One message: ``channel`` (analysis | commentary | final | ""), ``recipient`` (e.g.
    ``functions.get_weather``; None for the user), ``body`` text, ``complete`` (its end token seen)."""

    channel: str
    recipient: Optional[str]
    body: str
    complete: bool


def held_back(text: str, markers: tuple[str, ...] = SPECIALS) -> int:
    """How many trailing characters of ``text`` may be the start of one of ``markers``."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def is_harmony(text: str) -> Optional[bool]:
    """True if ``text`` is harmony-formatted (a special token within its first characters), False
    if it is plain text, None while undecided (empty, or a prefix of a special token)."""
    s = text.lstrip()
    if not s or any(m.startswith(s) for m in SPECIALS):
        return None
    return s.startswith(SPECIALS) or CHANNEL in s[:64] or MESSAGE in s[:64]


def parse_harmony(text: str, final: bool = True) -> list[HarmonyMessage]:
    """The messages of ``text``. With ``final=False`` an unfinished message body loses a trailing
    partial special token, and a message whose header is unfinished is left out."""
    out = []
    for seg in text.split(START):
        if not seg.strip():
            continue
        head, sep, rest = seg.partition(MESSAGE)
        if not sep:
            continue  # header still streaming (or junk between messages)
        channel = ""
        if CHANNEL in head:
            channel = re.split(r"[\s<]", head.split(CHANNEL, 1)[1].strip(), maxsplit=1)[0]
        m = _RECIPIENT.search(head)
        cut = min((i for i in (rest.find(e) for e in ENDS) if i >= 0), default=-1)
        if cut >= 0:
            out.append(HarmonyMessage(channel, m.group(1) if m else None, rest[:cut], True))
        else:
            body = rest if final else rest[:len(rest) - held_back(rest)]
            out.append(HarmonyMessage(channel, m.group(1) if m else None, body, False))
    return out


def harmony_split(text: str, final: bool = True) -> tuple[str, str, list[HarmonyMessage]]:
    """``(reasoning, content, tool-call messages)``: the ``analysis`` bodies, the ``final`` bodies
    and preambles (``commentary`` without a recipient) each joined by newlines, and the messages
    addressed to ``functions.*`` (complete ones only, unless ``final``). Plain text (no harmony
    tokens) is all content."""
    kind = is_harmony(text)
    if kind is None:
        return "", (text if final else ""), []
    if not kind:
        return "", text, []
    reasoning, content, calls = [], [], []
    for msg in parse_harmony(text, final):
        if msg.recipient and msg.recipient.startswith("functions."):
            if msg.complete or final:
                calls.append(msg)
        elif msg.channel == "analysis":
            reasoning.append(msg.body)
        elif msg.channel in ("final", "commentary", ""):
            content.append(msg.body)
    return "\n".join(reasoning), "\n".join(content), calls
