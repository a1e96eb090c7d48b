"""A disk cache of tokenizers built from GGUF files.

Building a ``transformers`` tokenizer from GGUF metadata takes seconds (the vocabulary and
merges are converted in Python); loading the same tokenizer saved with ``save_pretrained``
takes a fraction of a second. The cache lives under ``$KVSERVE_CACHE_DIR`` (default
``~/.cache/kvserve``) in ``tokenizers/<key>``, where the key hashes the GGUF's size, its first
and last 4 MiB (the metadata, which holds the vocabulary, sits at the start) and the
transformers version. Writes go to a temporary directory renamed into place, so concurrent
processes never read a half-written entry.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

logger = logging.getLogger("kvserve")

_CHUNK = 4 << 20


def cache_root() -> str:
    return os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")


def gguf_fingerprint(path: str) -> str:
    """sha256 hex of the file's size, first and last 4 MiB, and the transformers version."""
    import transformers

    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(f"{size}:{transformers.__version__}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_CHUNK))
        if size > 2 * _CHUNK:
            f.seek(size - _CHUNK)
            h.update(f.read(_CHUNK))
    return h.hexdigest()[:32]


def load_gguf_tokenizer(path: str, use_cache: bool = True) -> Any:
    """The tokenizer of a ``.gguf`` file, from the cache when it holds it (else built from the
    GGUF and stored). A cache that cannot be written only costs the rebuild next time."""
    from transformers import AutoTokenizer

    entry = os.path.join(cache_root(), "tokenizers", gguf_fingerprint(path)) if use_cache else None
    if entry is not None and os.path.isfile(os.path.join(entry, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(entry)
        except Exception as exc:  # noqa: BLE001 - a broken entry is rebuilt
            logger.warning("tokenizer cache entry %s unreadable (%s); rebuilding", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    d, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    if entry is not None:
        try:
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(entry), prefix=".tmp-")
            tok.save_pretrained(tmp)
            try:
                os.rename(tmp, entry)
            except OSError:  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            logger.warning("could not cache the tokenizer under %s: %s", entry, exc)
    return tok
