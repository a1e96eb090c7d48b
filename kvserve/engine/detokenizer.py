"""Incremental detokenization: each step decodes only a short window of a sequence's last tokens.

``IncrementalDetokenizer.update()`` returns exactly ``tokenizer.decode(ids,
skip_special_tokens=...)`` of the sequence's whole output so far, at every step, while
decoding only the tokens since the last *cut* (the prefix/read-offset window of vLLM's
slow-tokenizer path and of ``tokenizers.decoders.DecodeStream``). The text is
``stable + tail``: ``stable`` is the committed text up to the read offset ``r``; ``tail``
is ``decode(ids[p:]) - decode(ids[p:r])`` (string suffix), where the window start ``p``
is an earlier read offset. The tail may end in U+FFFD (a multi-byte character split across
tokens): it is shown as the full decode shows it and committed once the character is whole.

Why not ``DecodeStream`` itself: it yields only the committed chunks (not the pending tail
that the full decode shows with U+FFFD, which outputs expose today), and its window may start
inside a run of byte-fallback tokens, where the full decode turns a whole run into U+FFFD once
one byte in it is invalid. Here a window start must follow a plain vocabulary token (not an
added/special or ``<0xNN>`` byte token) and decode to non-empty text (decoders that strip the
first token's leading space then agree with the full decode), and every step checks that the
window's text still starts with its committed part; if it does not (a byte-fallback run that
turned invalid changes earlier text), the sequence is decoded in full once and the window
restarts from token 0.

The reference is the decode of the output alone (as before), so the prompt is no context here.
A window grows while no cut is allowed (a long run of byte-fallback or special tokens, text that
keeps ending in U+FFFD); each step then decodes the whole run, as a full decode of it would.

Decoders whose text is not local to tokens (BPE suffix decoders that treat the last token
apart, CTC, regex ``Replace`` patterns, ``Strip`` of trailing characters) and tokenizers that
clean up tokenization spaces use the full decode (``DetokenizerSpec.mode == "full"``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

# Decoder components whose output is a concatenation of per-token pieces, up to the first
# token's leading-space strip (Metaspace, Strip) and byte runs (ByteLevel, ByteFallback).
_LOCAL_DECODERS = frozenset({"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Replace", "Strip"})

_CUT_AFTER = 4  # tokens between the window start and the read offset before a cut is tried (fastest of 1-16)


def _decoder_is_local(d: Optional[dict]) -> bool:
    if d is None:
        return False
    kind = d.get("type")
    if kind == "Sequence":
        return all(_decoder_is_local(x) for x in d.get("decoders", ()))
    if kind not in _LOCAL_DECODERS:
        return False
    if kind == "Replace":  # a one-character string pattern cannot straddle two tokens
        pat = d.get("pattern", {})
        return isinstance(pat.get("String"), str) and len(pat["String"]) <= 1
    if kind == "Strip":  # stripping trailing characters changes the text once a token follows
        return not d.get("stop")
    return True


def _byte_token_ids(lookup: Callable[[str], Optional[int]]) -> set[int]:
    out = set()
    for b in range(256):
        i = lookup(f"<0x{b:02X}>")
        if i is not None and i >= 0:
            out.add(i)
    return out


class DetokenizerSpec:
    """How one tokenizer's outputs are detokenized; built once per tokenizer.

    ``mode``: ``"window"`` (fast backend: ``tokenizers.Tokenizer.decode`` on a window),
    ``"window-slow"`` (no fast backend: ``tokenizer.decode`` on a window) or ``"full"``
    (``tokenizer.decode`` of the whole output every time: today's cost, always exact).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.mode = "full"
        self.reason = ""
        self.unsafe_cut: frozenset[int] = frozenset()  # a window never starts right after these
        self._decode_fn: Callable[[list[int], bool], str] = self._full_decode
        if tokenizer is None:
            self.reason = "no tokenizer"
            return
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if backend is not None and hasattr(backend, "decode") and hasattr(backend, "decoder"):
            self._init_fast(tokenizer, backend)
        else:
            self._init_slow(tokenizer)

    def _full_decode(self, ids: list[int], skip: bool) -> str:
        tok = self.tokenizer
        return "" if tok is None else tok.decode(ids, skip_special_tokens=skip)

    def _init_fast(self, tok: Any, backend: Any) -> None:
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # an older transformers: decode there is not checked here
            self.reason = "transformers without TokenizersBackend"
            return
        # ``tokenizer.decode`` must be the plain backend decode (no subclass post-processing).
        if not (isinstance(tok, TokenizersBackend) and type(tok)._decode is TokenizersBackend._decode
                and type(tok).decode is PreTrainedTokenizerBase.decode):
            self.reason = f"{type(tok).__name__} overrides decode"
            return
        if tok.clean_up_tokenization_spaces and not (
                type(backend.model).__name__ == "BPE"
                and not getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                                False)):
            self.reason = "clean_up_tokenization_spaces changes text across token boundaries"
            return
        try:
            dec = backend.decoder
            spec = json.loads(dec.__getstate__()) if dec is not None else None
        except Exception as exc:  # noqa: BLE001 - an unreadable decoder: stay exact with the full decode
            self.reason = f"decoder unreadable ({exc!r})"
            return
        if not _decoder_is_local(spec):
            self.reason = f"decoder {spec and spec.get('type')!r} is not token-local"
            return
        self.unsafe_cut = frozenset(backend.get_added_tokens_decoder()) | frozenset(
            _byte_token_ids(backend.token_to_id))
        self._decode_fn = backend.decode
        self.mode = "window"

    def _init_slow(self, tok: Any) -> None:
        if getattr(tok, "clean_up_tokenization_spaces", False):
            self.reason = "clean_up_tokenization_spaces changes text across token boundaries"
            return
        unk = getattr(tok, "unk_token_id", None)
        added = getattr(tok, "added_tokens_decoder", None) or {}

        def lookup(t: str) -> Optional[int]:
            i = tok.convert_tokens_to_ids(t)
            return None if i is None or i == unk else i

        self.unsafe_cut = frozenset(added) | frozenset(_byte_token_ids(lookup))
        self.mode = "window-slow"

    def new(self, ids: list[int], skip_special_tokens: bool) -> "IncrementalDetokenizer":
        """A detokenizer over ``ids`` (the caller's list; tokens are only ever appended to it)."""
        return IncrementalDetokenizer(self, ids, skip_special_tokens)


class IncrementalDetokenizer:
    """The text of one growing token sequence; see the module docstring for the algorithm."""

    __slots__ = ("ids", "skip", "text", "_decode", "_unsafe", "_full", "_n", "_p", "_r", "_stable", "_prefix")

    def __init__(self, spec: DetokenizerSpec, ids: list[int], skip_special_tokens: bool) -> None:
        self.ids = ids
        self.skip = skip_special_tokens
        self.text = ""
        self._decode = spec._decode_fn
        self._unsafe = spec.unsafe_cut
        self._full = spec.mode == "full"
        self._n = 0  # tokens folded into ``text``
        self._p = 0  # window start
        self._r = 0  # read offset: ``_stable`` is the text of ids[:_r]
        self._stable = ""
        self._prefix = ""  # decode(ids[_p:_r])

    def update(self) -> str:
        """Fold the tokens appended since the last call; returns (and keeps in ``text``) the
        full decode of ``ids``. Costs one or two decodes of the window, not of all of ``ids``."""
        ids = self.ids
        n = len(ids)
        if n == self._n:
            return self.text
        self._n = n
        if self._full:
            self.text = self._decode(ids, self.skip)
            return self.text
        p = self._p
        new_text = self._decode(ids[p:n] if p else ids, self.skip)
        prefix = self._prefix
        if not new_text.startswith(prefix):
            # The window's committed text changed (e.g. a byte-fallback run turned invalid, which
            # the full decode shows as U+FFFD for every byte of the run): restart from token 0.
            # The full decode below is exact; a later commit cuts the window again.
            self._p = self._r = p = 0
            self._stable = self._prefix = prefix = ""
            new_text = self._decode(ids, self.skip)
        tail = new_text[len(prefix):]
        text = self._stable + tail if tail else self._stable
        self.text = text
        if tail and tail[-1] != "\ufffd":  # commit ids[_r:n]
            self._stable = text
            r_old = self._r
            self._r = n
            # Move the window start only once the window is long: a decode of a few more tokens
            # costs less than the second decode that a cut needs.
            if r_old - p >= _CUT_AFTER and ids[r_old - 1] not in self._unsafe:
                cut_prefix = self._decode(ids[r_old:n], self.skip)
                if cut_prefix:
                    self._p = r_old
                    self._prefix = cut_prefix
                    return text
            self._prefix = new_text
        return text


__all__ = ["DetokenizerSpec", "IncrementalDetokenizer"]
