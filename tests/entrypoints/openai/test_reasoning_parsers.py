"""Reasoning and tool-call parsing of recorded outputs of each family (Qwen3, DeepSeek-R1/V3,
gpt-oss): the non-streamed message, and the SSE deltas of ``stream_parsed_chat`` fed in small
pieces, which must add up to that message."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from kvserve.entrypoints.openai.chat_output import ChatOutputParser, stream_parsed_chat
from kvserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser, reasoning_parser_names
from kvserve.entrypoints.openai.tool_parsers import get_tool_parser
from kvserve.entrypoints.openai.tools import ToolMode

QWEN3_THINK = "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is **4**."
QWEN3_TOOL = ('<think>\nI should call the weather tool for Tokyo.\n</think>\n\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>')
QWEN3_NO_THINK = "The answer is 4."
QWEN3_OPENED = "Okay, 2+2=4.\n</think>\n\n4"  # Qwen3-Thinking-2507: <think> is in the prompt
R1 = "Okay, so the user asks 2+2... it is 4.\n</think>\n\nThe answer is 4."
R1_CUT = "Okay, so the user asks 2+2 and I am still thin"  # cut by max_tokens inside the reasoning
V3_TOOL = ("Let me look that up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
           "{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
V31_TOOL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
            "<｜tool▁calls▁end｜>")
R1_V3_TOOL = ("Need the weather.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
              'get_weather\n```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
GPTOSS = ("<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
GPTOSS_TOOL = ("<|channel|>analysis<|message|>Need weather; call the tool.<|end|>"
               "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               '{"city":"Tokyo"}<|call|>')
GPTOSS_TOOL_ALT = ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time'
                   '<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>')


def _parser(reasoning=None, tools=None, opened=False, parallel=True):
    mode = ToolMode("auto", parser=get_tool_parser(tools), parallel=parallel) if tools else ToolMode("none")
    return ChatOutputParser(get_reasoning_parser(reasoning) if reasoning else None, mode, opened)


def _calls(msg):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]


CASES = [
    # (reasoning parser, tool parser, prompt opened, text, reasoning, content, calls)
    ("qwen3", None, False, QWEN3_THINK, "\nThe user asks for 2+2. That is 4.\n", "The answer is **4**.", []),
    ("qwen3", "hermes", False, QWEN3_TOOL, "\nI should call the weather tool for Tokyo.\n", None,
     [("get_weather", {"city": "Tokyo"})]),
    ("qwen3", None, False, QWEN3_NO_THINK, None, "The answer is 4.", []),
    ("qwen3", None, True, QWEN3_OPENED, "Okay, 2+2=4.\n", "4", []),
    ("deepseek_r1", None, False, R1, "Okay, so the user asks 2+2... it is 4.\n", "The answer is 4.", []),
    ("deepseek_r1", None, False, R1_CUT, R1_CUT, None, []),
    ("deepseek_r1", "deepseek_v3", False, R1_V3_TOOL, "Need the weather.\n", None, [("get_weather", {"city": "Tokyo"})]),
    (None, "deepseek_v3", False, V3_TOOL, None, "Let me look that up.",
     [("get_weather", {"city": "Tokyo"}), ("get_time", {})]),
    (None, "deepseek_v3", False, V31_TOOL, None, None, [("get_weather", {"city": "Paris"})]),
    ("openai_gptoss", None, False, GPTOSS, "User asks 2+2. Answer 4.", "2 + 2 = 4.", []),
    ("openai_gptoss", "openai", False, GPTOSS_TOOL, "Need weather; call the tool.", None,
     [("get_weather", {"city": "Tokyo"})]),
    (None, "openai", False, GPTOSS_TOOL_ALT, None, "Checking.", [("get_time", {"tz": "UTC"})]),
    (None, "openai", False, GPTOSS, None, "2 + 2 = 4.", []),
]


@pytest.mark.parametrize("rp,tp,opened,text,reasoning,content,calls", CASES)
def test_message(rp, tp, opened, text, reasoning, content, calls):
    msg, finish = _parser(rp, tp, opened).message(text, "stop")
    assert msg.get("reasoning_content") == reasoning
    assert msg["content"] == content
    assert _calls(msg) == calls
    assert finish == ("tool_calls" if calls else "stop")
    if rp is None:
        assert "reasoning_content" not in msg


def _stream(parser, text: str, step: int) -> list[dict]:
    """Run ``stream_parsed_chat`` over ``text`` arriving ``step`` characters at a time."""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]

    async def gen():
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            co = SimpleNamespace(index=0, text=piece, token_ids=[0], finish_reason="stop" if last else None,
                                 stop_reason=None)
            yield SimpleNamespace(finished=last, num_cached_tokens=0, outputs=[co])

    async def collect():
        req = SimpleNamespace(include_usage=False)
        serving = SimpleNamespace(model_name="m")
        lines = [x async for x in stream_parsed_chat(serving, req, "id", gen(), 3, SimpleNamespace(n=1), parser)]
        return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]

    return asyncio.run(collect())


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("rp,tp,opened,text,reasoning,content,calls", CASES)
def test_stream_reassembles_to_the_message(rp, tp, opened, text, reasoning, content, calls, step):
    parser = _parser(rp, tp, opened)
    chunks = _stream(parser, text, step)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in streamed] == calls
    assert chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if calls else "stop")
    if rp is not None and step == 1 and reasoning and content:
        # reasoning streams as it comes, before the answer starts
        first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert sum(1 for d in deltas[:first_content] if d.get("reasoning_content")) > 1


def test_registry_names_are_vllms():
    assert reasoning_parser_names() == ["deepseek_r1", "openai_gptoss", "qwen3"]
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("qwen")
    assert get_tool_parser("openai").needs_special_tokens and get_tool_parser("deepseek_v3").needs_special_tokens
    assert get_reasoning_parser("openai_gptoss").needs_special_tokens


def test_parallel_tool_calls_false_keeps_one():
    msg, _ = _parser(None, "deepseek_v3", parallel=False).message(V3_TOOL, "stop")
    assert _calls(msg) == [("get_weather", {"city": "Tokyo"})]


class _FakeTok:
    chat_template = "x"

    def apply_chat_template(self, conv, add_generation_prompt=True, tokenize=True, **kw):
        return [1, 2, 3]

    def decode(self, ids, **kw):
        return "<|im_start|>assistant\n<think>\n" if self.opened else "<|im_start|>assistant\n"


class _FakeEngine:
    """Answers every request with ``text`` (one piece per character when streaming)."""

    vocab_size, max_model_len, config = 100, 4096, None

    def __init__(self, text: str, opened: bool = False):
        self.text, self.tokenizer, self.seen = text, _FakeTok(), []
        self.tokenizer.opened = opened

    def check_alive(self):
        pass

    def validate(self, ids, sp, priority):
        self.seen.append(sp)

    def generate(self, ids, sp, rid, priority=0, delta=False, cache_salt=None):
        pieces = list(self.text) if delta else [self.text]

        async def gen():
            for k, piece in enumerate(pieces):
                last = k == len(pieces) - 1
                co = SimpleNamespace(index=0, text=piece, token_ids=[5], finish_reason="stop" if last else None,
                                     stop_reason=None, logprobs=None)
                yield SimpleNamespace(finished=last, num_cached_tokens=0, outputs=[co], kv_transfer_params=None)
        return gen()


@pytest.mark.parametrize("stream", [False, True])
def test_serving_chat_with_parsers(stream):
    """``OpenAIServingChat`` wiring: the parsers' message (or deltas), special tokens kept for harmony,
    the prompt's open ``<think>`` seen, ``separate_reasoning=false`` leaves the text alone."""
    from kvserve.entrypoints.openai import protocol as P
    from kvserve.entrypoints.openai.serving import OpenAIServingChat

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    async def run(engine, rp, tp=None, **kw):
        chat = OpenAIServingChat(engine, ["m"])
        chat.reasoning_parser = get_reasoning_parser(rp)
        chat.enable_auto_tool_choice, chat.tool_call_parser = tp is not None, tp
        req = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=stream, **kw)
        out = await chat.create(req)
        if not stream:
            return out["choices"][0]["message"]
        deltas = [json.loads(x[6:])["choices"][0]["delta"] async for x in out
                  if x.startswith("data: {") and json.loads(x[6:])["choices"]]
        return {"reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas) or None,
                "content": "".join(d.get("content") or "" for d in deltas) or None,
                "tool_calls": [t for d in deltas for t in d.get("tool_calls", [])]}

    eng = _FakeEngine(GPTOSS_TOOL)
    msg = asyncio.run(run(eng, "openai_gptoss", "openai", tools=tools))
    assert msg["reasoning_content"] == "Need weather; call the tool." and not msg["content"]
    assert _calls(msg) == [("get_weather", {"city": "Tokyo"})]
    assert eng.seen[-1].skip_special_tokens is False
    msg = asyncio.run(run(_FakeEngine(QWEN3_OPENED, opened=True), "qwen3"))
    assert (msg["reasoning_content"], msg["content"]) == ("Okay, 2+2=4.\n", "4")
    eng = _FakeEngine(QWEN3_THINK)
    msg = asyncio.run(run(eng, "qwen3", separate_reasoning=False))
    assert msg["content"] == QWEN3_THINK and not msg.get("reasoning_content")
    assert eng.seen[-1].skip_special_tokens is True
