"""P2P KV transfer: the layout descriptor, its comparison, and the TCP control/data protocol.

A frame is a 4-byte big-endian header length, a JSON header, then ``header["nbytes"]`` raw
bytes when the header names them. One TCP connection carries one pull:

1. consumer -> ``{"op": "hello", "layout": {...}, "engine_id": str}``; producer ->
   ``{"op": "hello", "ok": true, "transports": ["tcp"] (+ "nixl")}`` or ``{"ok": false,
   "error": "kv_layout mismatch: ..."}`` (then it closes the connection).
2. consumer -> ``{"op": "pull", "req": remote_request_id, "blocks": [[int, ...] per group]}``;
   producer -> one ``{"op": "layer", "layer": i, "group": g, "nbytes": n}`` frame per layer
   (raw pages of the named blocks, ``cache[:, ids]`` bytes), then ``{"op": "done"}``, or
   ``{"op": "error", "error": str}`` (unknown id, lease expired).
   With ``"transport": "nixl"`` in the pull (only when the producer offered it), the
   producer instead answers ``{"op": "nixl", "agent", "mem", "regions", "nbytes"}`` plus its
   NIXL agent metadata as payload (``nixl_transport.NixlAgent.descriptor``), keeps the blocks
   pinned while the consumer READs them, and waits for ``{"op": "read_done", "ok": bool,
   "bytes_read": int}`` (``nbytes`` always names a frame's payload).
3. consumer -> ``{"op": "release", "req": remote_request_id}`` once the pages landed (or
   the consumer gave up): the producer frees the blocks.

With an internal secret (``kvserve.utils.internal_auth``) on both sides every step is
authenticated with HMAC-SHA256, mutually: the hello carries ``ts``, a fresh ``nonce`` and
``mac`` = HMAC("kv-hello", engine id, ts, nonce); the producer checks it before it compares
layouts and answers with its own fresh ``challenge`` and ``mac`` = HMAC("kv-hello-ok",
consumer nonce, challenge, producer engine id), so the consumer knows the producer holds the
secret. Each pull and release then carries ``mac`` over (label, challenge, request id, block
ids, transport), bound to this connection; the producer checks it before it looks the id
up, and a failure is answered ``"authentication failed"`` whether or not the id exists. The
``done`` frame of a TCP pull carries ``mac``: HMAC over the consumer nonce and every layer
frame (header and pages), so pages altered in flight fail the pull (recomputed); a NIXL
descriptor frame carries ``mac`` over its fields and the SHA-256 of the agent metadata.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Any, Optional

from kvserve.utils import internal_auth as auth

_HDR = struct.Struct(">I")
MAX_HEADER = 1 << 24


class KVLayoutMismatch(ValueError):
    """The producer refused the consumer's KV layout; the message names the differing fields."""


class KVTransferAuthError(PermissionError):
    """A KV transfer peer failed authentication (wrong or missing internal secret)."""


AUTH_FAILED = "authentication failed"


def kv_layout(config, kv_cache_config) -> dict[str, Any]:
    """A JSON-able descriptor of this engine's KV cache pages.

    Keys: ``model`` (basename), ``fingerprint`` (``block_hash.model_fingerprint``),
    ``num_layers``, ``block_size``, ``kv_cache_dtype``, ``dtype`` (model torch dtype name),
    ``tp_size``, and ``groups``: per KV cache group ``{"kind", "layers", "num_kv_heads",
    "head_size", "sliding_window", "page_shape" (one block of one layer: [2, block_size,
    kv_heads, row elements]; [1, ...] for MLA's latent rows, ``kind`` MLAAttentionSpec), "page_bytes" (per layer)}``; for rotated formats (int4 / int2)
    also ``kv_rotation``: the basis the pages hold K/V in (``kv_rotation.ROTATION_NAME``). It
    is absent otherwise, so unrotated layouts are unchanged and a peer from before the
    rotation, which sends no such field, is refused on int4 / int2 only. Likewise
    ``kv_scales`` (``"head-major"``, quantized formats only): where a page keeps its scales.
    """
    from kvserve.attention.kv_rotation import ROTATION_NAME
    from kvserve.kv_connector.block_hash import model_fingerprint

    mc, cc = config.model_config, config.cache_config
    groups = []
    for g in kv_cache_config.groups:
        s = g.spec
        groups.append({
            "kind": type(s).__name__, "layers": list(g.layer_indices), "num_kv_heads": s.num_kv_heads,
            "head_size": s.head_size, "sliding_window": getattr(s, "sliding_window", None),
            "page_shape": [s.format.kv_halves, s.block_size, s.num_kv_heads, s.format.row_elems(s.head_size)],
            "page_bytes": s.page_size_bytes,
        })
    layout = {
        "model": os.path.basename(str(mc.model or "").rstrip("/")), "fingerprint": model_fingerprint(config),
        "num_layers": kv_cache_config.num_layers, "block_size": kv_cache_config.block_size,
        "kv_cache_dtype": str(cc.kv_cache_dtype), "dtype": str(mc.dtype),
        "tp_size": config.parallel_config.tensor_parallel_size, "groups": groups,
    }
    if any(g.spec.format.rotated for g in kv_cache_config.groups):
        layout["kv_rotation"] = ROTATION_NAME
    if any(g.spec.format.quantized for g in kv_cache_config.groups):
        layout["kv_scales"] = "head-major"  # kv_quant page layout v4: a peer from before is refused
    return layout


def layout_mismatch(mine: dict, theirs: Any) -> Optional[str]:
    """None when the layouts match, else ``"field (here X, remote Y), ..."`` naming each
    differing field (``model`` alone is informational and never compared)."""
    if not isinstance(theirs, dict):
        return f"kv_layout must be an object, got {type(theirs).__name__}"
    diffs = []
    for k in sorted(set(mine) | set(theirs)):
        if k == "model":
            continue
        a, b = mine.get(k), theirs.get(k)
        if k == "groups" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (ga, gb) in enumerate(zip(a, b)):
                for f in sorted(set(ga) | set(gb if isinstance(gb, dict) else {})):
                    va, vb = ga.get(f), gb.get(f) if isinstance(gb, dict) else None
                    if va != vb:
                        diffs.append(f"groups[{i}].{f} (here {va!r}, remote {vb!r})")
        elif a != b:
            diffs.append(f"{k} (here {a!r}, remote {b!r})")
    return ", ".join(diffs) if diffs else None


def send_frame(sock: socket.socket, header: dict, payload: Optional[memoryview | bytes] = None) -> None:
    """Send one frame; ``payload`` (if any) must have ``header["nbytes"]`` bytes."""
    h = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_HDR.pack(len(h)) + h)
    if payload is not None and len(payload):
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int, into: Optional[bytearray] = None) -> bytearray:
    """Read exactly ``n`` bytes. Raises ConnectionError when the peer closes early."""
    buf = into if into is not None else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the KV transfer connection")
        got += k
    return buf


def recv_frame(sock: socket.socket, with_payload: bool = True) -> tuple[dict, Optional[bytearray]]:
    """Read one frame: ``(header, payload or None)``. Raises ConnectionError / ValueError."""
    (n,) = _HDR.unpack(bytes(recv_exact(sock, 4)))
    if n > MAX_HEADER:
        raise ValueError(f"KV transfer header of {n} bytes")
    header = json.loads(bytes(recv_exact(sock, n)))
    payload = None
    nbytes = header.get("nbytes")
    if with_payload and nbytes:
        payload = recv_exact(sock, int(nbytes))
    return header, payload


def client_handshake(sock: socket.socket, layout: dict, engine_id: str, secret: Optional[bytes] = None) -> dict:
    """Consumer side of step 1: the producer's reply (``transports`` it serves; with
    ``secret``, also ``client_nonce``, this side's nonce, and the producer's ``challenge``).

    Raises:
        KVTransferAuthError: refused for authentication, or (with ``secret``) the producer
            did not prove it holds the secret.
        KVLayoutMismatch: refused for the layout. ConnectionError on I/O.
    """
    hello = {"op": "hello", "layout": layout, "engine_id": engine_id}
    nonce = None
    if secret is not None:
        nonce, ts = auth.new_nonce(), time.time()
        hello.update(ts=ts, nonce=nonce, mac=auth.sign(secret, "kv-hello", engine_id, ts, nonce))
    send_frame(sock, hello)
    reply, _ = recv_frame(sock)
    if not reply.get("ok"):
        err = reply.get("error") or "KV transfer handshake refused"
        if err == AUTH_FAILED:
            raise KVTransferAuthError(f"the KV transfer producer refused this consumer: {err} "
                                      f"(is ${auth.ENV_SECRET} the same on both sides?)")
        raise KVLayoutMismatch(err)
    if secret is not None:
        if not auth.verify(secret, reply.get("mac"), "kv-hello-ok", nonce, reply.get("challenge"),
                           reply.get("engine_id")):
            raise KVTransferAuthError("the KV transfer producer did not authenticate (no or another internal "
                                      "secret there)")
        reply["client_nonce"] = nonce
    return reply


def pull_mac(secret: bytes, label: str, challenge: Any, req: Any, blocks: Any = None, transport: Any = None) -> str:
    """The ``mac`` of a pull (``label`` "kv-pull") or release ("kv-release") frame."""
    return auth.sign(secret, label, challenge, req, blocks, transport)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
