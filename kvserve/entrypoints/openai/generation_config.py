"""``--generation-config``: default sampling parameters from a checkpoint's ``generation_config.json``.

vLLM's meaning: ``auto`` (the default) reads ``generation_config.json`` next to the model,
``vllm`` uses no file (the engine's own defaults: temperature 1, top_p 1, ...), a folder
reads that folder's ``generation_config.json``. The keys a request may also set
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``) become that
request field's default; ``max_new_tokens`` becomes the default ``max_tokens`` cap. A field the
request sets always wins. Model creators put their recommended sampling there (Qwen3:
temperature 0.6, top_p 0.95, top_k 20), which is why vLLM applies it by default.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

#: generation_config.json keys that map to request fields of the same name.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_generation_config(value: Optional[str]) -> None:
    """Fail fast (before the model loads) on a folder without ``generation_config.json``.

    Raises ValueError naming ``--generation-config``."""
    if value in (None, "auto", "vllm"):
        return
    if not os.path.isfile(os.path.join(os.path.expanduser(value), "generation_config.json")):
        raise ValueError(f"--generation-config {value!r}: expected 'auto', 'vllm' or a folder holding "
                         f"generation_config.json")


def load_generation_defaults(value: Optional[str], model_path: str) -> dict[str, Any]:
    """The default request fields of ``--generation-config value`` for the model at ``model_path``
    (an HF directory or a file such as a ``.gguf``: ``auto`` then finds nothing). Returns
    ``{field: value}`` with ``max_tokens`` for ``max_new_tokens``; ``{}`` for ``vllm`` or no file.
    Raises ValueError for a folder without the file or a file that is not a JSON object."""
    if value == "vllm":
        return {}
    check_generation_config(value)
    folder = model_path if value in (None, "auto") else os.path.expanduser(value)
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--generation-config: {path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--generation-config: {path} must hold a JSON object")
    out = {k: cfg[k] for k in SAMPLING_KEYS if cfg.get(k) is not None}
    if isinstance(cfg.get("max_new_tokens"), int) and cfg["max_new_tokens"] > 0:
        out["max_tokens"] = cfg["max_new_tokens"]
    return out


def apply_generation_defaults(req: Any, defaults: dict[str, Any]) -> None:
    """Set each default on ``req`` (a pydantic request) unless the client set that field."""
    for key, value in defaults.items():
        if key != "max_tokens" and key not in req.model_fields_set and hasattr(req, key):
            setattr(req, key, value)
