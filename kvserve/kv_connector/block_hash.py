"""Content addresses of KV blocks for the tiers: deterministic across processes and runs.

A block's key is a chain ``k_i = BLAKE2b-128(k_{i-1} || int64 token ids of block i)`` with
``k_{-1} = BLAKE2b-128(KEY_VERSION || model fingerprint || KV format || block size ||
cache salt)``. Unlike Python's ``hash()`` (salted per process for str), the same tokens
give the same key in every process, so a disk or remote tier can be shared and survives
restarts; the model fingerprint and KV format in the root keep different models, dtypes and
block sizes apart. ``KEY_VERSION`` names the byte layout of a stored block: v2 is the
page layout of ``kvserve/attention/kv_quant.py`` (a quantized block's codes, then its
scales); blocks written in the v1 layout (codes and scale interleaved per row) are never
found under v2 keys. v3: the same pages, but int4 / int2 blocks hold K and V in the
Hadamard-rotated basis (``kvserve/attention/kv_rotation.py``); v2 files (unrotated int4 /
int2 content) are never read as rotated ones. v4: a page's scales region is head-major
(``[Hkv, block_size]``, so a kernel loads one head's scales as vectors); v3 pages had it
slot-major.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

_DIGEST = 16
#: layout version of the stored block bytes (bump when a KV page layout changes)
KEY_VERSION = b"kvserve-kv-v4"


def model_fingerprint(config) -> str:
    """A stable name for "the KV these weights produce": model file identity, architecture
    config, model dtype, load format (and seed for dummy weights)."""
    mc = config.model_config
    parts = {"model": os.path.basename(str(mc.model or "")), "dtype": mc.dtype, "load_format": mc.load_format}
    path = str(mc.model or "")
    if os.path.isfile(path):
        parts["size"] = os.path.getsize(path)
    if mc.load_format == "dummy":
        parts["seed"] = mc.seed
    hf = mc.hf_config
    if hf is not None:
        keep = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rope_theta", "rope_scaling", "intermediate_size")
        # Read as attributes: the same values from a transformers config and from the HFConfigView a
        # spawned engine core holds (to_dict() leaves out properties such as rope_scaling).
        parts["hf"] = {k: getattr(hf, k, None) for k in keep}
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=_DIGEST).hexdigest()


def root_key(fingerprint: str, kv_format: str, block_size: int, salt: Optional[str]) -> bytes:
    """``k_{-1}`` for a model / KV format / block size / cache salt."""
    blob = KEY_VERSION + b"\0" + fingerprint.encode() + b"\0" + kv_format.encode() + b"\0" \
        + str(block_size).encode() + b"\0" + (b"\1" + salt.encode() if salt is not None else b"\0")
    return hashlib.blake2b(blob, digest_size=_DIGEST).digest()


def chain_keys(parent: bytes, token_ids: list[int], start: int, end: int, block_size: int) -> list[bytes]:
    """Keys of blocks ``start..end-1`` of ``token_ids`` given ``parent`` = key of block ``start-1``."""
    out = []
    toks = np.asarray(token_ids[start * block_size:end * block_size], dtype=np.int64)
    h = parent
    for i in range(end - start):
        h = hashlib.blake2b(h + toks[i * block_size:(i + 1) * block_size].tobytes(), digest_size=_DIGEST).digest()
        out.append(h)
    return out
