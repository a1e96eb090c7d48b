"""Tokenization that never blocks the API server's event loop.

Three guards, in this order, for every text that would be tokenized (completion prompts,
chat message contents, ``/tokenize``):

1. **A character bound**, checked on the event loop in O(1): a text of more than
   ``max_model_len x L`` characters, where ``L`` is the length in characters of the longest
   token in the vocabulary, cannot fit in the context (each token covers at most ``L``
   characters), so it gets 400 without being tokenized. For SmolLM2 (``L`` = 81) and
   ``--max-model-len 8192`` that is 663,552 characters; an 8 MB prompt is refused in
   microseconds instead of freezing the loop for seconds. (The bound assumes a normalizer
   that does not delete characters, true of byte-level BPE and SentencePiece tokenizers.)
2. **Valid Unicode**: a lone surrogate (``"\\ud800"`` is valid JSON) makes the Rust
   tokenizer raise ``TypeError``; it gets a 400 naming the field and the index instead.
3. **Off the loop, bounded**: tokenization and chat templating run in a small thread pool
   (Hugging Face ``tokenizers`` releases the GIL while encoding), at most
   ``max_concurrency`` at a time; others wait their turn on an ``asyncio.Semaphore``.
   Any other exception from the tokenizer or the template becomes a 400 ``APIError``.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from kvserve.entrypoints.openai.errors import APIError

logger = logging.getLogger("kvserve")

#: Threads (and concurrent tokenizations) when the server does not say: tokenization is
#: CPU-bound, and the engine core needs the other cores.
DEFAULT_MAX_CONCURRENCY = 2


def longest_token_chars(tokenizer) -> int:
    """Length, in characters, of the longest vocabulary entry (added tokens included).

    Byte-level BPE spells a multi-byte character with several symbols, so this over-counts,
    which keeps the bound of ``TokenizerPool`` on the safe side. 1 without a tokenizer.
    """
    if tokenizer is None:
        return 1
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - an odd tokenizer: fall back to a loose bound
        return 256
    return max((len(t) for t in vocab), default=1)


def check_unicode(text: str, field: str) -> None:
    """Raise ``APIError(400)`` if ``text`` holds a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{field} is not valid Unicode: a lone surrogate at character {exc.start}",
                       field) from None


class TokenizerPool:
    """Bounded, off-loop tokenization for one server (see the module docstring).

    Args:
        tokenizer: the engine's tokenizer (None with ``--skip-tokenizer-init``).
        max_model_len: the context length in tokens, as the engine core sized it.
        max_concurrency: tokenizations running at once (threads).
        max_chars: the character bound (default ``max_model_len x longest_token_chars``).
    """

    def __init__(self, tokenizer, max_model_len: int, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 max_chars: Optional[int] = None) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_concurrency = max_concurrency
        self.token_chars = longest_token_chars(tokenizer)
        self.max_chars = max_chars if max_chars is not None else max_model_len * self.token_chars
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kvserve-tokenize")
        self._sem: Optional[asyncio.Semaphore] = None

    def _too_long(self, n_chars: int, field: str) -> APIError:
        return APIError(400, f"{field} is too long: {n_chars} characters. This model's maximum context "
                             f"length is {self.max_model_len} tokens, and no token is longer than "
                             f"{self.token_chars} characters, so at most {self.max_chars} characters "
                             f"can fit", field)

    def check_text(self, text: str, field: str) -> None:
        """Raise ``APIError(400)`` for a text that is too long to fit or not valid Unicode."""
        if len(text) > self.max_chars:
            raise self._too_long(len(text), field)
        check_unicode(text, field)

    def check_messages(self, messages: Sequence[Any], field: str = "messages") -> None:
        """``check_text`` over chat messages (``ChatMessage`` models): their total length and each text."""
        texts = []
        for i, m in enumerate(messages):
            content = m.content
            parts = [content] if isinstance(content, str) else \
                [p.get("text") for p in (content or []) if isinstance(p, dict)]
            texts += [(i, t) for t in (*parts, m.name, m.role) if isinstance(t, str)]
        total = sum(len(t) for _, t in texts)
        if total > self.max_chars:
            raise self._too_long(total, field)
        for i, t in texts:
            check_unicode(t, f"{field}[{i}]")

    async def run(self, fn: Callable, *args, what: str = "prompt") -> Any:
        """``fn(*args)`` in the pool, at most ``max_concurrency`` at once.

        ``APIError`` passes through; a ``ValueError`` becomes ``APIError(400)`` with its message;
        anything else the tokenizer or template raises becomes ``APIError(400, "the tokenizer
        rejected the {what}: ...")``. ``what`` is the ``param`` of the error.
        """
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        async with self._sem:
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(self._executor, lambda: fn(*args))
            except APIError:
                raise
            except ValueError as exc:  # our own checks (e.g. no tokenizer): their message as is
                raise APIError(400, str(exc), what) from None
            except Exception as exc:  # noqa: BLE001 - tokenizer / template errors are the client's input
                raise APIError(400, f"the tokenizer rejected the {what}: {type(exc).__name__}: {exc}",
                               what) from None

    async def tokenize(self, serving, prompt) -> list[int]:
        """A completion prompt (text or token ids) -> ids, via ``serving.tokenize``."""
        if isinstance(prompt, str):
            self.check_text(prompt, "prompt")
            return await self.run(serving.tokenize, prompt, what="prompt")
        return serving.tokenize(prompt)

    async def chat_prompt_ids(self, serving, messages, add_generation_prompt: bool = True,
                              tools: Optional[list] = None) -> list[int]:
        """Chat messages (and tool definitions) -> ids through the chat template, via
        ``serving.chat_prompt_ids``."""
        self.check_messages(messages)
        return await self.run(serving.chat_prompt_ids, messages, add_generation_prompt, tools, what="messages")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenizer.encode`` for ``/tokenize``."""
        self.check_text(text, "prompt")
        tok = self.tokenizer
        return list(await self.run(lambda: tok.encode(text, add_special_tokens=add_special_tokens),
                                   what="prompt"))

    def close(self) -> None:
        """Stop the threads (a running tokenization finishes; queued ones are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
