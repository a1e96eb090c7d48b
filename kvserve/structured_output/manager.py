"""Scheduler-side structured outputs: compile constraints with xgrammar, one matcher per
request, bitmask rows per step, matchers advanced by accepted tokens.

Compiled grammars are cached by the compiler (xgrammar's ``GrammarCompiler`` cache, keyed by
the schema / regex / grammar text), so repeated schemas compile once per engine. The
tokenizer's vocabulary (``xgrammar.TokenizerInfo``) is built on the first constrained request;
an engine that never sees one never imports xgrammar.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import numpy as np

from kvserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("kvserve")


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ValueError("structured outputs need the `xgrammar` package (pip install xgrammar)") from exc
    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Check that the constraint compiles (tokenizer-independent part).

    Raises ValueError("structured_outputs ...") naming the problem: an invalid JSON schema,
    regex or grammar.
    """
    xgr = _xgr()
    kind, spec = params.key()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"structured_outputs: invalid {kind}: {_short(exc)}") from None


def _short(exc: BaseException) -> str:
    """xgrammar messages start with a ``[time] file:line:`` prefix; keep the reason."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if msg.startswith("[") and ": " in msg:
        msg = msg.split(": ", 1)[1]
    return msg


class StructuredOutputRequest:
    """One request's grammar state: its matcher, advanced by every accepted output token."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (never, when the
        token was sampled under this matcher's mask)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles constraints and fills bitmasks for the scheduler.

    Args:
        model_config: the engine's ``ModelConfig`` (model / tokenizer paths).
        vocab_size: the model's logits width (bitmask rows cover it).
        tokenizer: an already loaded HF tokenizer (offline engines share theirs); else one
            is loaded on the first constrained request.
    """

    def __init__(self, model_config: Any, vocab_size: int, tokenizer: Any = None) -> None:
        self.model_config = model_config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self._compiler = None

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgr()
            tok = self.tokenizer
            if tok is None:
                mc = self.model_config
                if getattr(mc, "skip_tokenizer_init", False):
                    raise ValueError("structured outputs need a tokenizer (the engine runs with skip_tokenizer_init)")
                from kvserve.model_loader import get_tokenizer

                tok = self.tokenizer = get_tokenizer(mc.model, mc.load_format, mc.tokenizer)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            threads = max(1, min(8, (os.cpu_count() or 1) // 2))
            self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of a constraint. Raises ValueError if invalid."""
        comp = self._get_compiler()
        kind, spec = params.key()
        try:
            if kind == "json":
                return comp.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return comp.compile_regex(spec)
            if kind == "choice":
                return comp.compile_grammar(choice_ebnf(params.choice))
            return comp.compile_grammar(spec)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs: invalid {kind}: {_short(exc)}") from None

    def make_request_state(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A fresh matcher for one request. Raises ValueError if the constraint is invalid."""
        return StructuredOutputRequest(_xgr().GrammarMatcher(self.compile(params)))

    def grammar_bitmask(self, states: list[StructuredOutputRequest]) -> np.ndarray:
        """int32 ``[len(states), ceil(V / 32)]``: row ``i`` allows the tokens that
        ``states[i]``'s matcher accepts next."""
        xgr = _xgr()
        bm = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        for i, st in enumerate(states):
            st.matcher.fill_next_token_bitmask(bm, i)
        return bm.numpy()


def structured_outputs_of(params: Any) -> Optional[StructuredOutputsParams]:
    return getattr(params, "structured_outputs", None)
