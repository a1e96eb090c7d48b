"""OpenAI API request models (pydantic) and conversions to kvserve types.

Requests follow OpenAI's field names plus vLLM's extras (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, priority, stop_token_ids, skip_special_tokens) and kvserve's bounded-KV
extension (attention_sinks, max_attention_window; docs/bounded-kv.md). Responses are
plain dicts in OpenAI's shapes (built here and in ``serving.py``).
Range checks are ``SamplingParams``'s: a bad value raises ``ValueError`` whose message
starts with the parameter name (``param_of`` picks it out for the error body).
"""

from __future__ import annotations

import time
import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

#: Most top logprobs one token may ask for.
MAX_LOGPROBS = 20
#: Most stop strings one request may give (OpenAI allows 4; vLLM has no limit).
MAX_STOP = 16
#: Longest stop string, in characters.
MAX_STOP_LEN = 1024

#: Integers that fit the engine's messages (msgspec int64); larger ones get 400, not 500.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
#: Non-negative int64 (token ids, counts).
UInt63 = Annotated[int, Field(ge=0, le=2**63 - 1)]


class OpenAIBaseModel(BaseModel):
    # Nested objects ignore unknown fields; the request bodies forbid them (below). NaN and
    # +-Infinity (which Python's JSON parser accepts) are rejected in float fields.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: ``{name, description, schema, strict}``."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str = "response"
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


#: Request-body fields that are accepted and have no effect (documented in docs/openai-api.md).
IGNORED_FIELDS = ("user",)


class _SamplingFields(OpenAIBaseModel):
    model: Optional[str] = None
    n: UInt63 = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[Annotated[int, Field(ge=0, le=2**63 - 1 - 2**20)]] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM extras
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: UInt63 = 0
    priority: Int64 = 0
    cache_salt: Optional[str] = None  # vLLM: prefix-cache isolation between tenants
    stop_token_ids: Optional[list[UInt63]] = None
    skip_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* extras.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # kvserve extension: bounded KV per request (--kv-eviction-policy; docs/bounded-kv.md)
    attention_sinks: Optional[UInt63] = None
    max_attention_window: Optional[UInt63] = None
    # vLLM extra: each choice also carries ``token_ids`` (the generated ids; per chunk, the new
    # ones) and the response ``prompt_token_ids``. Always on for completions when the server has
    # no tokenizer (``--skip-tokenizer-init``), whose ``text`` is empty.
    return_token_ids: bool = False
    # vLLM extra: disaggregated prefill/decode (kvserve.kv_connector.p2p). Prefill leg:
    # ``{"do_remote_decode": true}``; decode leg: the prefill response's ``kv_transfer_params``.
    kv_transfer_params: Optional[dict[str, Any]] = None
    # SGLang's fields that sglang-router adds to every request it forwards (docs/disaggregation.md):
    # accepted at the values kvserve's behaviour matches, a 400 otherwise. With --reasoning-parser,
    # separate_reasoning=false leaves the reasoning in the content; stream_reasoning changes nothing.
    no_stop_trim: Literal[False] = False
    return_hidden_states: Literal[False] = False
    continue_final_message: Literal[False] = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    # Fields not implemented here are a 400 naming the field, never silently ignored.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The request's output constraint, from whichever of response_format,
        structured_outputs and guided_* is set. Raises ValueError if several are."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format: json_schema.schema is required for type json_schema")
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
        if self.structured_outputs is not None:
            try:
                found.append(("structured_outputs", StructuredOutputsParams(**self.structured_outputs)))
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"guided_json: not valid JSON: {exc}") from None
            found.append(("guided_json", StructuredOutputsParams(json=schema)))
        for name, kw in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            v = getattr(self, name)
            if v is not None:
                found.append((name, StructuredOutputsParams(**{kw: v})))
        if len(found) > 1:
            raise ValueError(f"structured_outputs: at most one constraint per request, got {[n for n, _ in found]}")
        return found[0][1] if found else None

    def _params(self, max_tokens: Optional[int], logprobs: Optional[int],
                prompt_logprobs: Optional[int] = None) -> SamplingParams:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens}")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop may hold at most {MAX_STOP} strings, got {len(stops)}")
        if any(len(x) > MAX_STOP_LEN for x in stops):
            raise ValueError(f"stop strings may be at most {MAX_STOP_LEN} characters long")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            attention_sinks=self.attention_sinks,
            max_attention_window=self.max_attention_window,
            extra_args={"kv_transfer_params": dict(self.kv_transfer_params)}
            if self.kv_transfer_params is not None else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or lists of ids."""

    prompt: Union[list[UInt63], list[list[UInt63]], str, list[str]]
    max_tokens: Optional[Int64] = 16
    logprobs: Optional[Int64] = None
    echo: bool = False
    best_of: Optional[Int64] = None
    suffix: Optional[str] = None
    # vLLM extra: per prompt token its logprob and the top ``prompt_logprobs`` alternatives,
    # in each choice's ``prompt_logprobs`` (perplexity through the server). Not streamed.
    prompt_logprobs: Optional[Int64] = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises ValueError for invalid or unsupported values."""
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (best_of > n is not supported)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt logprobs are not computed)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream=true")
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self._params(max_tokens, self.logprobs, self.prompt_logprobs)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt(s) as a list of strings / token-id lists. Raises ValueError if empty."""
        p = self.prompt
        if isinstance(p, str):
            out: list = [p]
        elif p and isinstance(p[0], int):
            out = [list(p)]
        else:
            out = list(p)
        if not out:
            raise ValueError("prompt must not be empty")
        return out


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message for ``apply_chat_template``; list content must be text parts only."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates read arguments as a mapping (vLLM converts the JSON string too).
            calls = []
            for c in self.tool_calls:
                c = dict(c)
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                c["function"] = fn
                calls.append(c)
            d["tool_calls"] = calls
        return d


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Int64] = None
    add_generation_prompt: bool = True
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``max_completion_tokens`` wins over ``max_tokens``; default: the rest of the context."""
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(default_max_tokens if mt is None else mt, lp)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: ``prompt`` text, or chat ``messages`` (the template is applied)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: Optional[str] = None
    tokens: list[Int64]


# ----------------------------------------------------------------------------- responses


def error_body(message: str, type_: str = "BadRequestError", param: Optional[str] = None,
               code: Optional[int] = 400) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_PARAM_NAMES = {"n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "max_tokens", "min_tokens", "logprobs", "stop", "seed", "prompt",
                "messages", "logit_bias", "best_of", "suffix", "top_logprobs", "stream_options", "priority", "cache_salt",
                "echo", "structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "tools", "tool_choice", "prompt_logprobs", "attention_sinks",
                "max_attention_window", "kv_transfer_params"}


def param_of(message: str) -> Optional[str]:
    """The parameter a ValueError message names first (``"top_p must be ..."`` -> ``"top_p"``)."""
    first = message.split(" ", 1)[0].strip(":,")
    return first if first in _PARAM_NAMES else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_str(tokenizer, token_id: int) -> str:
    """Text of one token as OpenAI reports it (decoded alone; ``token_id:N`` without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def prompt_logprobs_json(tokenizer, prompt_logprobs: Optional[list]) -> Optional[list]:
    """vLLM's ``prompt_logprobs`` in a completions choice: per prompt token None (the first) or
    ``{token_id (str): {"logprob", "rank", "decoded_token"}}``."""
    if prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(v), "rank": r, "decoded_token": token_str(tokenizer, t)}
                                    for t, (v, r) in e.items()} for e in prompt_logprobs]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, tuple[float, int]]],
                        text_offset_start: int = 0) -> dict[str, Any]:
    """OpenAI completions logprobs: ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``logprobs[i]`` maps token id -> (logprob, rank) for the top-k tokens plus the sampled
    token ``token_ids[i]``; ``top_logprobs[i]`` holds all of them (token text -> logprob).
    ``text_offset`` is each token's character offset, counted from ``text_offset_start``.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset_start
    for tid, lp in zip(token_ids, logprobs):
        s = token_str(tokenizer, tid)
        tokens.append(s)
        token_lps.append(_finite(lp[tid][0]) if tid in lp else None)
        top = {}
        for t, (v, _rank) in sorted(lp.items(), key=lambda kv: kv[1][1]):
            top.setdefault(token_str(tokenizer, t), _finite(v))
        tops.append(top)
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, tuple[float, int]]],
                  top_n: int) -> dict[str, Any]:
    """OpenAI chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``.

    ``top_logprobs`` lists the ``top_n`` best tokens (rank <= top_n) in rank order.
    """
    content = []
    for tid, lp in zip(token_ids, logprobs):
        s = token_str(tokenizer, tid)
        top = [{"token": token_str(tokenizer, t), "logprob": _finite(v),
                "bytes": list(token_str(tokenizer, t).encode())}
               for t, (v, rank) in sorted(lp.items(), key=lambda kv: kv[1][1]) if rank <= top_n]
        content.append({"token": s, "logprob": _finite(lp[tid][0]) if tid in lp else -9999.0,
                        "bytes": list(s.encode()), "top_logprobs": top[:top_n]})
    return {"content": content}


def _finite(v: float) -> float:
    """JSON has no -inf: clamp to OpenAI's floor of -9999."""
    return max(float(v), -9999.0)


def now() -> int:
    return int(time.time())
