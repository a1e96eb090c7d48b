"""Remote tier: KV blocks in a key-value server (Redis or Valkey) shared by engines on many hosts.

``--kv-remote-url redis://HOST:PORT[/DB]``. Same keys and value format as the disk tier
(``disk_tier.py``: magic, JSON header with model fingerprint, KV format, block size, payload
length and BLAKE2b checksum, then the payload), under the key ``kvserve:kv:<hex key>``. A
value is written with one ``SET`` (atomic for readers); a read verifies it, and a bad value is
deleted and reported as a miss. Eviction is the server's (``maxmemory-policy allkeys-lru``).

Faults: an unreachable server is a ValueError at start-up; an error at run time logs one
warning and counts as a miss (reads) or a dropped block (writes): the tokens are recomputed.
"""

from __future__ import annotations

import logging
from typing import Optional

from kvserve.kv_connector.disk_tier import DiskStore

logger = logging.getLogger("kvserve")

_PREFIX = b"kvserve:kv:"


class RemoteStore:
    """Blocks in a Redis-protocol server; the interface of ``DiskStore`` (read/write/exists/delete/scan).

    Raises:
        ValueError: a URL that is not ``redis://`` / ``rediss://``, or a server that does not answer.
    """

    def __init__(self, url: str, fingerprint: str, kv_format: str, block_size: int, payload_bytes: int) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--kv-remote-url must be redis://HOST:PORT (or rediss://, unix://), got {url!r}")
        import redis

        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        try:
            self.client.ping()
        except self._errors as exc:
            raise ValueError(f"--kv-remote-url {url}: cannot reach the server ({exc})") from None
        self.url = url
        # The value format (and its checks) are the disk tier's; no directory is used.
        self._fmt = DiskStore.__new__(DiskStore)
        self._fmt.header = {"fingerprint": fingerprint, "kv_format": kv_format, "block_size": block_size,
                            "payload_bytes": payload_bytes}
        self._fmt.payload_bytes = payload_bytes
        self.payload_bytes = payload_bytes
        self.file_bytes = payload_bytes + 512
        self.num_write_errors = 0
        self.num_read_errors = 0
        self.num_rejected = 0

    def _warn(self, what: str, exc: Exception) -> None:
        if self.num_write_errors + self.num_read_errors == 1:
            logger.warning("KV remote tier %s: %s failed (%s); those blocks are recomputed", self.url, what, exc)

    def write(self, key: bytes, payload: bytes) -> bool:
        data = self._fmt.encode(key, payload)
        try:
            self.client.set(_PREFIX + key.hex().encode(), data)
            return True
        except self._errors as exc:
            self.num_write_errors += 1
            self._warn("write", exc)
            return False

    def read(self, key: bytes) -> Optional[bytes]:
        try:
            data = self.client.get(_PREFIX + key.hex().encode())
        except self._errors as exc:
            self.num_read_errors += 1
            self._warn("read", exc)
            return None
        if data is None:
            return None
        payload = self._fmt.verify(key, data)
        if payload is None:
            self.num_rejected += 1
            logger.warning("KV remote tier: rejected the value of %s (truncated, corrupted or another "
                           "model/format); deleted", key.hex())
            self.delete(key)
        return payload

    def exists(self, key: bytes) -> bool:
        try:
            return bool(self.client.exists(_PREFIX + key.hex().encode()))
        except self._errors:
            return False

    def delete(self, key: bytes) -> None:
        try:
            self.client.delete(_PREFIX + key.hex().encode())
        except self._errors:
            pass

    def scan(self) -> list:
        return []  # lookups ask the server (EXISTS); no local index to warm

    def raw_key(self, key: bytes) -> bytes:
        """The server-side key of a block (tests)."""
        return _PREFIX + key.hex().encode()
