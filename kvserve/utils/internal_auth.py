"""A shared secret for kvserve's internal channels: the P/D KV transfer (``kv_connector.p2p``)
and the router's calls to its workers.

The secret comes from a file (``--internal-secret-file PATH`` or ``$KVSERVE_INTERNAL_SECRET_FILE``)
or from ``$KVSERVE_INTERNAL_SECRET``; never from a command-line value (``ps`` and
``/proc/*/cmdline`` show those to every local user). Without one the channels stay
unauthenticated, as before, and bind to loopback by default.

Messages are authenticated with HMAC-SHA256 (RFC 2104) over a canonical JSON list of their
fields, led by a label naming the message kind (a MAC for one kind never verifies as
another); MACs are compared with ``hmac.compare_digest``. HTTP calls carry
``x-kvserve-internal-auth: <unix time>.<nonce>.<mac over method, path, time, nonce>``; the
receiver accepts a token within ``MAX_SKEW_S`` of its clock, once (a replay cache of nonces).
The channels are authenticated, not encrypted: on an untrusted network run them in a
private network or a tunnel (WireGuard, IPsec).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import threading
import time
from typing import Any, Optional

logger = logging.getLogger("kvserve")

ENV_SECRET = "KVSERVE_INTERNAL_SECRET"
ENV_SECRET_FILE = "KVSERVE_INTERNAL_SECRET_FILE"
HEADER = "x-kvserve-internal-auth"
#: Shortest secret accepted (bytes): HMAC keys shorter than this are guessable offline.
MIN_SECRET_BYTES = 16
#: Seconds a signed timestamp may differ from the receiver's clock (hosts run NTP).
MAX_SKEW_S = 60.0
#: Nonces remembered by a ``TokenVerifier`` (tokens past that many within the window are refused).
MAX_NONCES = 1 << 18


def load_internal_secret(path: Optional[str] = None) -> Optional[bytes]:
    """The internal secret: the file ``path``, else ``$KVSERVE_INTERNAL_SECRET_FILE``, else
    ``$KVSERVE_INTERNAL_SECRET``, else None (no authentication). A file's trailing newline is
    stripped; a file that group or others can read gets a warning.

    Raises:
        ValueError: the file cannot be read, or the secret is shorter than 16 bytes.
    """
    path = path or os.environ.get(ENV_SECRET_FILE) or None
    if path:
        try:
            with open(path, "rb") as f:
                raw = f.read().rstrip(b"\r\n")
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ValueError(f"cannot read the internal secret file {path!r}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("internal secret file %s is readable by group/others (mode %o); chmod 600 it",
                           path, mode & 0o777)
        where = f"the internal secret file {path!r}"
    else:
        env = os.environ.get(ENV_SECRET)
        if not env:
            return None
        raw, where = env.encode(), f"${ENV_SECRET}"
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{where} holds {len(raw)} bytes; an internal secret needs at least {MIN_SECRET_BYTES} "
                         "(e.g. `openssl rand -hex 32`)")
    return raw


def sign(secret: bytes, label: str, *fields: Any) -> str:
    """HMAC-SHA256 (hex) of ``[label, *fields]`` as compact JSON (fields must be JSON-able)."""
    msg = json.dumps([label, *fields], separators=(",", ":"), sort_keys=True).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def verify(secret: bytes, mac: Any, label: str, *fields: Any) -> bool:
    """Whether ``mac`` is ``sign(secret, label, *fields)`` (constant-time compare)."""
    if not isinstance(mac, str):
        return False
    return hmac.compare_digest(mac.encode(), sign(secret, label, *fields).encode())


def fresh(ts: Any, now: Optional[float] = None, max_skew_s: float = MAX_SKEW_S) -> bool:
    """Whether ``ts`` (unix seconds) is within ``max_skew_s`` of ``now``."""
    try:
        return abs((time.time() if now is None else now) - float(ts)) <= max_skew_s
    except (TypeError, ValueError):
        return False


def new_nonce() -> str:
    """128 random bits, hex."""
    return secrets.token_hex(16)


def request_token(secret: bytes, method: str, path: str) -> str:
    """The ``x-kvserve-internal-auth`` value for one HTTP call of ``method`` on ``path``."""
    ts, nonce = f"{time.time():.3f}", new_nonce()
    return f"{ts}.{nonce}.{sign(secret, 'http', method.upper(), path, ts, nonce)}"


class TokenVerifier:
    """Checks ``x-kvserve-internal-auth`` tokens: MAC, clock skew, and each nonce once
    (thread-safe)."""

    def __init__(self, secret: bytes, max_skew_s: float = MAX_SKEW_S) -> None:
        self.secret, self.max_skew_s = secret, max_skew_s
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def verify(self, token: Optional[str], method: str, path: str) -> bool:
        """Whether ``token`` authenticates one call of ``method`` on ``path`` (False: refuse)."""
        if not token or token.count(".") != 3:  # the timestamp holds one dot
            return False
        sec, frac, nonce, mac = token.split(".")
        ts = f"{sec}.{frac}"
        now = time.time()
        if not fresh(ts, now, self.max_skew_s) or not verify(self.secret, mac, "http", method.upper(), path, ts, nonce):
            return False
        with self._lock:
            if nonce in self._seen:
                return False
            if len(self._seen) >= MAX_NONCES:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                if len(self._seen) >= MAX_NONCES:
                    return False
            self._seen[nonce] = now + 2 * self.max_skew_s
        return True

