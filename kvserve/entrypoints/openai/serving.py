"""Completions and chat completions on top of ``AsyncLLM``: validation, fan-out over prompts,
OpenAI response and SSE chunk assembly.

Each ``create_*`` returns a dict (the JSON body) or, for ``stream=true``, an async iterator
of SSE lines (``"data: {json}\\n\\n"`` ... ``"data: [DONE]\\n\\n"``). Errors are raised as
``APIError`` (status, message, type, param).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Optional, Union

from kvserve.engine.async_client import AsyncLLM
from kvserve.entrypoints.openai import protocol as P
from kvserve.entrypoints.openai.chat_output import ChatOutputParser, stream_parsed_chat
from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.generation_config import apply_generation_defaults
from kvserve.entrypoints.openai.sse import merge, sse
from kvserve.entrypoints.openai.tool_stream import stream_tool_chat, tool_message
from kvserve.entrypoints.openai.tools import resolve_tool_mode, template_tools, tool_structured_outputs
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


class _Ticket:
    """Engine sequences held by one admitted request; ``release()`` is idempotent.

    Released when the response finishes, fails or is abandoned; ``__del__`` catches a
    streaming body that Starlette never started (client gone before the first byte).
    """

    __slots__ = ("adm", "n")

    def __init__(self, adm: "Admission", n: int) -> None:
        self.adm, self.n = adm, n

    def release(self) -> None:
        if self.n:
            self.adm.admitted -= self.n
            self.n = 0

    def __del__(self) -> None:
        self.release()


class Admission:
    """Bounded admission: at most ``max_num_seqs + max_waiting`` engine sequences admitted.

    A request needing ``k`` sequences (``n`` times the number of prompts) past that gets 429
    with ``Retry-After`` at once; one needing more than the whole capacity gets 400.
    ``max_waiting < 0`` turns the bound off.
    """

    def __init__(self, max_num_seqs: int, max_waiting: int, retry_after_s: int = 1) -> None:
        self.max_num_seqs, self.max_waiting = max_num_seqs, max_waiting
        self.retry_after_s = retry_after_s
        self.admitted = 0
        self.rejected = 0

    @property
    def capacity(self) -> Optional[int]:
        return None if self.max_waiting < 0 else self.max_num_seqs + self.max_waiting

    def admit(self, k: int) -> _Ticket:
        cap = self.capacity
        if cap is not None:
            if k > cap:
                raise APIError(400, f"the request needs {k} sequences (n x prompts); the server admits at "
                                    f"most {cap} at a time", "n")
            if self.admitted + k > cap:
                self.rejected += 1
                raise APIError(429, f"the server is overloaded: {self.admitted} sequences are running or "
                                    f"waiting (limit {cap}); retry later", None,
                               headers={"Retry-After": str(self.retry_after_s)})
        self.admitted += k
        return _Ticket(self, k)


async def _released(it: AsyncIterator[str], ticket: _Ticket) -> AsyncIterator[str]:
    try:
        async for x in it:
            yield x
    finally:
        ticket.release()
        await it.aclose()


class OpenAIServing:
    """Shared checks: model name, prompt length vs. context, sampling parameters, limits.

    ``tokenizer_pool`` (a ``tokenization.TokenizerPool``, set by ``build_app``) moves
    tokenization off the event loop; ``default_max_tokens`` caps a completion when the
    client gives no ``max_tokens`` (None: the rest of the context).
    """

    tokenizer_pool = None
    default_max_tokens: Optional[int] = None
    #: Request-field defaults from ``--generation-config`` (``generation_config``).
    generation_defaults: dict = {}

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], admission: Optional[Admission] = None,
                 max_n: int = 16) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.admission = admission or Admission(1, -1)
        self.max_n = max_n

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(400, f"n must be <= {self.max_n} on this server, got {n}", "n")

    def check_extras(self, ids_list: list[list[int]], req) -> None:
        """Token ids and vLLM's extras that the engine would choke on: 400 here instead."""
        v = self.engine.vocab_size
        for ids in ids_list:
            bad = next((t for t in ids if not 0 <= t < v), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {v})", "prompt")
        bad = next((t for t in (req.stop_token_ids or []) if not 0 <= t < v), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids: {bad} is outside the vocabulary [0, {v})", "stop_token_ids")
        if req.top_k is not None and req.top_k >= v:
            req.top_k = 0  # keeping every token is no top-k at all

    def check_kv_transfer(self, req, num_prompts: int) -> None:
        """``kv_transfer_params`` (disaggregated prefill/decode): this server must play the role
        the params ask for, one prompt and ``n == 1`` only, and a decode leg's ``kv_layout``
        must equal this engine's. Raises APIError(400) naming what differs."""
        ktp = req.kv_transfer_params
        if ktp is None:
            return
        info = self.engine.kv_transfer_info or {}
        role = info.get("kv_role")
        if num_prompts != 1 or req.n != 1:
            raise APIError(400, "kv_transfer_params needs exactly one prompt and n == 1", "kv_transfer_params")
        if ktp.get("do_remote_decode") and role not in ("kv_producer", "kv_both"):
            raise APIError(400, f"kv_transfer_params.do_remote_decode needs a server started with kv_role "
                                f"kv_producer or kv_both (this one: {role})", "kv_transfer_params")
        if ktp.get("do_remote_prefill"):
            if role not in ("kv_consumer", "kv_both"):
                raise APIError(400, f"kv_transfer_params.do_remote_prefill needs a server started with kv_role "
                                    f"kv_consumer or kv_both (this one: {role})", "kv_transfer_params")
            if "kv_layout" in ktp:
                from kvserve.kv_connector.p2p.wire import layout_mismatch

                diff = layout_mismatch(info.get("kv_layout") or {}, ktp["kv_layout"])
                if diff:
                    raise APIError(400, f"kv_transfer_params.kv_layout does not match this engine's KV layout: "
                                        f"{diff}", "kv_transfer_params")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    @property
    def bounded_kv(self) -> bool:
        """Whether the engine bounds each request's KV (``--kv-eviction-policy``): completions may
        then run past max_model_len up to their max_tokens (docs/bounded-kv.md)."""
        cfg = getattr(self.engine, "config", None)
        return getattr(getattr(cfg, "cache_config", None), "kv_eviction_policy", "none") != "none"

    def check_length(self, prompt_len: int, max_tokens: Optional[int], what: str = "prompt") -> int:
        """Return the max_tokens to use; raise APIError(400) if the context cannot hold it
        (with bounded KV only the prompt must fit)."""
        m = self.engine.max_model_len
        if prompt_len > m:
            raise APIError(400, f"This model's maximum context length is {m} tokens. However, your {what} has "
                                f"{prompt_len} tokens. Please reduce the length of the {what}.", "messages"
                           if what == "messages" else "prompt")
        if max_tokens is None:
            rest = max(m - prompt_len, 1)
            return rest if self.default_max_tokens is None else min(rest, self.default_max_tokens)
        if prompt_len + max_tokens > m and not self.bounded_kv:
            raise APIError(400, f"This model's maximum context length is {m} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} "
                                f"for the completion). Please reduce the length of the {what} or completion.",
                           "max_tokens")
        return max_tokens

    def tokenize(self, prompt: Union[str, list[int]]) -> list[int]:
        _, ids = self.engine.tokenize(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids

    def chat_prompt_ids(self, messages: list[P.ChatMessage], add_generation_prompt: bool = True,
                        tools: Optional[list[dict]] = None) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        conv = [m.to_template_dict() for m in messages]
        kw = {"tools": tools} if tools else {}
        try:
            ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
        except Exception as exc:  # jinja2 TemplateError (raise_exception in templates), bad roles
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


async def _with_disconnect(coro, is_disconnected) -> Any:
    """Run ``coro``; cancel it (aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if is_disconnected is not None and await is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: P.CompletionRequest, is_disconnected=None) -> Union[dict, AsyncIterator[str]]:
        self.check_model(req.model)
        self.engine.check_alive()
        self.check_n(req.n)
        apply_generation_defaults(req, self.generation_defaults)
        prompts = req.prompts()
        self.check_kv_transfer(req, len(prompts))
        pool = self.tokenizer_pool
        ids_list = [await pool.tokenize(self, p) if pool else self.tokenize(p) for p in prompts]
        self.check_extras(ids_list, req)
        explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
        params = []
        for ids in ids_list:
            mt = self.check_length(len(ids), req.max_tokens if explicit else None)
            if not explicit:
                mt = min(mt, 16)
            params.append(req.to_sampling_params(mt))
            self.engine.validate(ids, params[-1], req.priority)
        ticket = self.admission.admit(req.n * len(ids_list))
        rid = f"cmpl-{uuid.uuid4().hex}"
        texts = [p if isinstance(p, str) else None for p in prompts]
        gens = [self.engine.generate(ids, sp, f"{rid}-{i}", priority=req.priority, delta=req.stream,
                                     cache_salt=req.cache_salt,
                                     prompt_text=texts[i])
                for i, (ids, sp) in enumerate(zip(ids_list, params))]
        if req.stream:
            return _released(self._stream(req, rid, gens, ids_list, params[0]), ticket)
        outs: list[Optional[RequestOutput]] = [None] * len(gens)

        async def collect() -> None:
            async for i, out in merge(gens):
                outs[i] = out

        try:
            await _with_disconnect(collect(), is_disconnected)
        finally:
            ticket.release()
        return self._response(req, rid, outs, params[0])

    def _with_token_ids(self, req: P.CompletionRequest) -> bool:
        """Choices carry ``token_ids`` when asked (vLLM's ``return_token_ids``) or when the
        server has no tokenizer, so that outputs are visible without text."""
        return bool(req.return_token_ids) or self.engine.tokenizer is None

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.engine.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _response(self, req: P.CompletionRequest, rid: str, outs: list[RequestOutput], sp: SamplingParams) -> dict:
        choices, n_prompt, n_gen, n_cached = [], 0, 0, 0
        tok = self.engine.tokenizer
        for pi, out in enumerate(outs):
            n_prompt += len(out.prompt_token_ids)
            n_cached += out.num_cached_tokens
            prefix = self._prompt_text(out) if req.echo else ""
            for co in out.outputs:
                n_gen += len(co.token_ids)
                lp = None
                if sp.logprobs is not None:
                    lp = P.completion_logprobs(tok, co.token_ids, co.logprobs or [], len(prefix))
                choice = {"index": pi * sp.n + co.index, "text": prefix + co.text, "logprobs": lp,
                          "finish_reason": co.finish_reason, "stop_reason": co.stop_reason}
                if self._with_token_ids(req):
                    choice["token_ids"] = list(co.token_ids)
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                if sp.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = P.prompt_logprobs_json(tok, out.prompt_logprobs)
                choices.append(choice)
        body = {"id": rid, "object": "text_completion", "created": P.now(), "model": self.model_name,
                "choices": choices, "usage": P.usage(n_prompt, n_gen, n_cached), "system_fingerprint": None}
        if req.kv_transfer_params is not None:
            body["kv_transfer_params"] = outs[0].kv_transfer_params if outs else None
        return body

    async def _stream(self, req, rid, gens, ids_list, sp: SamplingParams) -> AsyncIterator[str]:
        created, model, tok = P.now(), self.model_name, self.engine.tokenizer
        offsets: dict[int, int] = {}
        n_gen = n_cached = 0
        cached_seen: set[int] = set()

        with_ids = self._with_token_ids(req)
        first_sent: set[int] = set()

        def chunk(index: int, text: str, lp=None, finish=None, stop_reason=None, token_ids=None, ktp=None) -> str:
            ch = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}
            if with_ids:
                ch["token_ids"] = list(token_ids or [])
                if index not in first_sent:  # the first chunk of a choice carries its prompt
                    first_sent.add(index)
                    ch["prompt_token_ids"] = list(ids_list[index // sp.n])
            body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [ch]}
            if req.include_usage:
                body["usage"] = None
            if ktp is not None:
                body["kv_transfer_params"] = ktp
            return sse(body)

        try:
            if req.echo:
                for pi, ids in enumerate(ids_list):
                    text = req.prompts()[pi] if isinstance(req.prompts()[pi], str) else (tok.decode(ids) if tok else "")
                    for k in range(sp.n):
                        offsets[pi * sp.n + k] = len(text)
                        yield chunk(pi * sp.n + k, text)
            async for pi, out in merge(gens):
                if out.finished and pi not in cached_seen:
                    cached_seen.add(pi)
                    n_cached += out.num_cached_tokens
                for co in out.outputs:
                    idx = pi * sp.n + co.index
                    n_gen += len(co.token_ids)
                    lp = None
                    if sp.logprobs is not None and co.token_ids:
                        lp = P.completion_logprobs(tok, co.token_ids, co.logprobs or [], offsets.get(idx, 0))
                        offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    yield chunk(idx, co.text, lp, co.finish_reason, co.stop_reason, co.token_ids,
                                out.kv_transfer_params if co.finish_reason is not None else None)
            if req.include_usage:
                n_prompt = sum(len(ids) for ids in ids_list)
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": P.usage(n_prompt, n_gen, n_cached)})
        except Exception as exc:  # noqa: BLE001 - reported in the stream
            yield sse(APIError.from_exception(exc).body())
        yield sse("[DONE]")


class OpenAIServingChat(OpenAIServing):
    #: ``--enable-auto-tool-choice`` / ``--tool-call-parser`` (set by the app).
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    #: ``--reasoning-parser``: a ``ReasoningParser`` or None (set by the app).
    reasoning_parser = None

    def _prompt_opened(self, ids: list[int]) -> bool:
        """Whether the prompt ends inside a reasoning block (the template opened ``<think>``)."""
        marker = getattr(self.reasoning_parser, "open_marker", "")
        tok = self.engine.tokenizer
        return bool(marker and tok is not None and tok.decode(ids[-4:]).rstrip().endswith(marker))

    async def create(self, req: P.ChatCompletionRequest, is_disconnected=None) -> Union[dict, AsyncIterator[str]]:
        self.check_model(req.model)
        self.engine.check_alive()
        self.check_n(req.n)
        apply_generation_defaults(req, self.generation_defaults)
        mode = resolve_tool_mode(req, self.enable_auto_tool_choice, self.tool_call_parser)
        tools = template_tools(req, mode)
        pool = self.tokenizer_pool
        self.check_kv_transfer(req, 1)
        ids = (await pool.chat_prompt_ids(self, req.messages, req.add_generation_prompt, tools) if pool
               else self.chat_prompt_ids(req.messages, req.add_generation_prompt, tools))
        self.check_extras([ids], req)
        mt = self.check_length(len(ids), req.requested_max_tokens, "messages")
        sp = req.to_sampling_params(mt)
        forced = tool_structured_outputs(req, mode)
        if forced is not None:
            if sp.structured_outputs is not None:
                raise APIError(400, f"tool_choice {mode.kind!r} cannot be combined with response_format / "
                                    "structured_outputs", "tool_choice")
            sp.structured_outputs = forced
        rp = self.reasoning_parser if req.separate_reasoning else None
        parsed = ChatOutputParser(rp, mode, self._prompt_opened(ids)) if ChatOutputParser.applies(rp, mode) else None
        if parsed is not None and parsed.needs_special_tokens:
            sp.skip_special_tokens = False  # the parser's markers are special tokens
        self.engine.validate(ids, sp, req.priority)
        ticket = self.admission.admit(req.n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self.engine.generate(ids, sp, rid, priority=req.priority, delta=bool(req.stream),
                                   cache_salt=req.cache_salt)
        if req.stream:
            if parsed is not None:
                return _released(stream_parsed_chat(self, req, rid, gen, len(ids), sp, parsed), ticket)
            if mode.active:
                return _released(stream_tool_chat(self, req, rid, gen, len(ids), sp, mode), ticket)
            return _released(self._stream(req, rid, gen, ids, sp), ticket)
        final: list[RequestOutput] = []

        async def collect() -> None:
            async for out in gen:
                final[:] = [out]

        try:
            await _with_disconnect(collect(), is_disconnected)
        finally:
            ticket.release()
        out = final[0]
        tok = self.engine.tokenizer
        choices = []
        for co in out.outputs:
            lp = P.chat_logprobs(tok, co.token_ids, co.logprobs or [], sp.logprobs or 0) \
                if sp.logprobs is not None else None
            message, finish = (parsed.message(co.text, co.finish_reason) if parsed is not None
                               else tool_message(mode, co.text, co.finish_reason))
            choice = {"index": co.index, "message": message,
                      "logprobs": lp, "finish_reason": finish, "stop_reason": co.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = list(co.token_ids)
            choices.append(choice)
        n_gen = sum(len(co.token_ids) for co in out.outputs)
        body = {"id": rid, "object": "chat.completion", "created": P.now(), "model": self.model_name,
                "choices": choices, "usage": P.usage(len(ids), n_gen, out.num_cached_tokens),
                "system_fingerprint": None}
        if req.return_token_ids:
            body["prompt_token_ids"] = list(ids)
        if req.kv_transfer_params is not None:
            body["kv_transfer_params"] = out.kv_transfer_params
        return body

    async def _stream(self, req, rid, gen, prompt_ids: list[int], sp: SamplingParams) -> AsyncIterator[str]:
        created, model, tok = P.now(), self.model_name, self.engine.tokenizer
        n_prompt = len(prompt_ids)
        with_ids = bool(req.return_token_ids)

        def chunk(index: int, delta: dict, lp=None, finish=None, stop_reason=None, token_ids=None, extra=None) -> str:
            ch = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}
            if with_ids:
                ch["token_ids"] = list(token_ids or [])
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [ch]}
            if req.include_usage:
                body["usage"] = None
            if extra:
                body.update(extra)
            return sse(body)

        n_gen, n_cached = 0, 0
        try:
            for i in range(sp.n):
                yield chunk(i, {"role": "assistant", "content": ""},
                            extra={"prompt_token_ids": list(prompt_ids)} if with_ids and i == 0 else None)
            async for out in merge([gen]):
                out = out[1]
                if out.finished:
                    n_cached = out.num_cached_tokens
                for co in out.outputs:
                    n_gen += len(co.token_ids)
                    if co.text or co.token_ids:
                        lp = None
                        if sp.logprobs is not None and co.token_ids:
                            lp = P.chat_logprobs(tok, co.token_ids, co.logprobs or [], sp.logprobs)
                        if co.text or lp is not None or (with_ids and co.token_ids):
                            yield chunk(co.index, {"content": co.text}, lp, token_ids=co.token_ids)
                    if co.finish_reason is not None:
                        ktp = out.kv_transfer_params
                        yield chunk(co.index, {}, None, co.finish_reason, co.stop_reason,
                                    extra={"kv_transfer_params": ktp} if ktp is not None else None)
            if req.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": P.usage(n_prompt, n_gen, n_cached)})
        except Exception as exc:  # noqa: BLE001 - reported in the stream
            yield sse(APIError.from_exception(exc).body())
        yield sse("[DONE]")
