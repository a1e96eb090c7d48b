"""Disk tier: KV blocks as files under ``--kv-disk-path``, shared by engines and kept across restarts.

One file per block, named by its content key (``block_hash.py``, hex), under two levels of
fan-out directories. A file is ``MAGIC | u32 header length | JSON header | payload``; the
header names the model fingerprint, the KV format, the block size, the payload length
and its BLAKE2b-128 checksum. The payload is the block's bytes in every layer, in the
device cache's format (the host slot's bytes, layer after layer).

* **Writes** are atomic: a unique temporary file in the same directory, then
  ``os.replace``; a reader sees the old file, the whole new file or nothing, never a torn
  one, so several engines can point at one directory.
* **Reads** check magic, header, length and checksum; a truncated, corrupted or foreign
  file is deleted and reported as a miss (the tokens are recomputed), never served.
* **Faults**: a missing or read-only directory is a ValueError at start-up; a write that
  fails at run time (disk full) logs one warning and the block simply stays uncached on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from typing import Optional

logger = logging.getLogger("kvserve")

MAGIC = b"KVSRVKV1"
_DIGEST = 16


class DiskStore:
    """Files of KV blocks under ``root``.

    Args:
        root: an existing, writable directory.
        fingerprint: the model fingerprint every file must carry.
        kv_format: the KV format string every file must carry.
        payload_bytes: bytes of one block's payload.

    Raises:
        ValueError: ``root`` is missing, not a directory or not writable.
    """

    def __init__(self, root: str, fingerprint: str, kv_format: str, block_size: int, payload_bytes: int) -> None:
        if not os.path.isdir(root):
            raise ValueError(f"--kv-disk-path {root!r} is not an existing directory")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"--kv-disk-path {root!r} is not writable")
        self.root = root
        self.header = {"fingerprint": fingerprint, "kv_format": kv_format, "block_size": block_size,
                       "payload_bytes": payload_bytes}
        self.payload_bytes = payload_bytes
        self.file_bytes = payload_bytes + 512  # for the size budget (header included, roughly)
        self.num_write_errors = 0
        self.num_rejected = 0

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h[2:4], h + ".kv")

    def exists(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def encode(self, key: bytes, payload: bytes) -> bytes:
        """``MAGIC | u32 header length | JSON header | payload`` for ``key``."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        hdr = dict(self.header, key=key.hex(), checksum=hashlib.blake2b(payload, digest_size=_DIGEST).hexdigest())
        blob = json.dumps(hdr, sort_keys=True).encode()
        return MAGIC + struct.pack("<I", len(blob)) + blob + payload

    def write(self, key: bytes, payload: bytes) -> bool:
        """Write one block atomically. Returns False (logged once) on an OS error."""
        data = self.encode(key, payload)
        path = self.path(key)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            if self.num_write_errors == 0:
                logger.warning("KV disk tier: cannot write %s (%s); blocks that fail to write are recomputed "
                               "when needed", path, exc)
            self.num_write_errors += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def read(self, key: bytes) -> Optional[bytes]:
        """The verified payload of ``key``'s file, or None (missing; or bad, and then deleted)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        payload = self._verify(key, data)
        if payload is None:
            self.num_rejected += 1
            logger.warning("KV disk tier: rejected %s (truncated, corrupted or another model/format); deleted",
                           path)
            try:
                os.unlink(path)
            except OSError:
                pass
        return payload

    def verify(self, key: bytes, data: bytes) -> Optional[bytes]:
        """The payload of ``data`` if it is a good block of ``key`` for this model and format."""
        return self._verify(key, data)

    def _verify(self, key: bytes, data: bytes) -> Optional[bytes]:
        if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
            return None
        (n,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
        start = len(MAGIC) + 4
        try:
            hdr = json.loads(data[start:start + n])
        except ValueError:
            return None
        if not isinstance(hdr, dict) or any(hdr.get(k) != v for k, v in self.header.items()) \
                or hdr.get("key") != key.hex():
            return None
        payload = data[start + n:]
        if len(payload) != self.payload_bytes:
            return None
        if hashlib.blake2b(payload, digest_size=_DIGEST).hexdigest() != hdr.get("checksum"):
            return None
        return payload

    def delete(self, key: bytes) -> None:
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def scan(self) -> list[tuple[bytes, float]]:
        """Keys of the files present, with their modification times (oldest first)."""
        out = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if name.endswith(".kv") and len(name) == 2 * _DIGEST + 3:
                    try:
                        out.append((bytes.fromhex(name[:-3]), os.path.getmtime(os.path.join(dirpath, name))))
                    except (ValueError, OSError):
                        continue
        out.sort(key=lambda x: x[1])
        return out
