"""P2P KV transfer, worker half: a TCP server that lends held blocks (producer) and pull
threads that write remote pages into freshly allocated device blocks (consumer).

Pages move as raw bytes of ``cache[:, block_ids]`` per layer (shape ``[2, n, block_size,
kv_heads, row]``, the cache's own dtype: float, fp8 or packed int4 codes with their scales),
so every KV format round-trips bit for bit. Over TCP layers stream one frame each, written as
they arrive; with ``transport="nixl"`` (and a producer offering it) the TCP connection only
controls the pull and the consumer READs the pages with NIXL (``nixl_transport.py``).
Nothing here blocks the engine loop: the scheduler learns of finished transfers from
``take_output`` (``KVConnectorOutput``) on its next step or poll.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
import threading
import time
from typing import Optional

import torch

from kvserve.core.sched_output import KVConnectorOutput
from kvserve.kv_connector.p2p.wire import (
    AUTH_FAILED, KVLayoutMismatch, KVTransferAuthError, client_handshake, layout_mismatch, pull_mac, recv_frame,
    send_frame,
)
from kvserve.utils import internal_auth as auth

logger = logging.getLogger("kvserve")

#: Seconds a pull for a not-yet-registered request id waits for the producer's engine to
#: register it (the HTTP response may reach the consumer before the next producer step).
REGISTER_WAIT_S = 5.0
CONNECT_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 60.0
#: Seconds between UCX progress calls of a producer whose blocks a NIXL READ reads.
NIXL_PROGRESS_S = 2e-4


def _bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as raw bytes ``[2, num_blocks, block_size, kv_heads, row * itemsize]`` uint8
    (copies of uint8 pages work for every KV dtype, fp8 included, and are bit exact)."""
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def _nixl_mac(secret: bytes, nonce, rid: str, desc: dict, md: bytes) -> str:
    """MAC of a NIXL descriptor frame: its agent, memory kind, regions and metadata digest."""
    return auth.sign(secret, "kv-nixl", nonce, rid, desc.get("agent"), desc.get("mem"), desc.get("regions"),
                     hashlib.sha256(bytes(md)).hexdigest())


class _Exposed:
    __slots__ = ("block_ids", "deadline", "busy", "released")

    def __init__(self, block_ids: list[list[int]], deadline: float) -> None:
        self.block_ids, self.deadline, self.busy, self.released = block_ids, deadline, 0, False


class P2PWorker:
    """Both transfer roles of one rank.

    Args:
        role: ``kv_producer`` | ``kv_consumer`` | ``kv_both``.
        host / port: where the producer listens (port resolved, not 0).
        lease_s: seconds held blocks wait for their consumer.
        layout: this engine's ``kv_layout`` (the handshake compares it).
        engine_id: this engine's id (logged by the peer).
        group_layers: per KV cache group, its layer indices.
        transport: ``"tcp"`` or ``"nixl"`` (a NIXL agent registers the caches in
            ``register_kv_caches``; pulls from producers without NIXL fall back to TCP).
        secret: the internal secret (``internal_auth.load_internal_secret``): every
            connection, pull and release is authenticated with it (see ``wire``); None: open.
    """

    def __init__(self, role: str, host: str, port: int, lease_s: float, layout: dict, engine_id: str,
                 group_layers: list[list[int]], transport: str = "tcp", secret: Optional[bytes] = None) -> None:
        self.role, self.host, self.port, self.lease_s = role, host, port, lease_s
        self.secret = secret
        self.transport = transport
        self.nixl = None  # NixlAgent once the caches are registered (transport nixl)
        self._warned_tcp_fallback = False
        self.layout, self.engine_id, self.group_layers = layout, engine_id, group_layers
        self.caches: dict[int, torch.Tensor] = {}
        self._lock = threading.Condition()
        self._exposed: dict[str, _Exposed] = {}
        self._sending_done: set[str] = set()
        self._recving_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._cancel: dict[str, threading.Event] = {}
        self._early_release: set[str] = set()  # released before registered (bounded below)
        self._progress = threading.Event()
        self.stats = dict(transfer_bytes=0, transfer_seconds=0.0, transfers=0, transfer_failures=0,
                          transfer_requests=0, bytes_sent=0, blocks_expired=0, requests_expired=0,
                          auth_failures=0)
        self._stop = threading.Event()
        self._srv: Optional[socket.socket] = None

    # ---- set-up ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[int, torch.Tensor]) -> None:
        """Keep the caches (layer -> tensor); transport nixl: register them with a NIXL agent
        (RuntimeError / ImportError when NIXL cannot start); producer: start listening."""
        self.caches = kv_caches
        if self.transport == "nixl" and self.nixl is None:
            import uuid

            from kvserve.kv_connector.p2p.nixl_transport import NixlAgent

            self.nixl = NixlAgent(f"kvserve-{self.engine_id}-{uuid.uuid4().hex[:8]}", kv_caches)
        if self.role in ("kv_producer", "kv_both") and self._srv is None:
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((self.host, self.port))
            srv.listen(64)
            self._srv = srv
            threading.Thread(target=self._accept_loop, name="kvserve-p2p-accept", daemon=True).start()
            logger.info("P2P KV producer listening on %s:%d (lease %.1f s, %s)", self.host, self.port, self.lease_s,
                        "authenticated" if self.secret else "unauthenticated")
            if self.secret is None and not self.host.startswith("127.") and self.host not in ("localhost", "::1"):
                logger.warning("P2P KV producer on %s without an internal secret: anyone who reaches the port and "
                               "learns a request id within its lease can pull its KV pages; set $%s",
                               self.host, auth.ENV_SECRET)

    # ---- per step ----------------------------------------------------------------------
    def handle_meta(self, meta) -> None:
        """Register blocks to lend, start pulls, cancel pulls (``P2PMetadata``)."""
        if meta is None:
            return
        now = time.monotonic()
        with self._lock:
            for rid, block_ids in meta.send:
                if rid in self._early_release:  # its consumer released before we lent it
                    self._early_release.discard(rid)
                    self._sending_done.add(rid)
                    continue
                self._exposed[rid] = _Exposed(block_ids, now + self.lease_s)
            if meta.send:
                self._lock.notify_all()
        for spec in meta.recv:
            ev = self._cancel[spec.request_id] = threading.Event()
            threading.Thread(target=self._pull, args=(spec, ev), name=f"kvserve-p2p-pull-{spec.request_id}",
                             daemon=True).start()
        for rid in meta.cancel:
            ev = self._cancel.get(rid)
            if ev is not None:
                ev.set()
            else:  # a producer-side abort of lent blocks
                self.release_local(rid)
        for host, port, remote_rid in meta.release:
            threading.Thread(target=self._release_remote, args=(host, port, remote_rid),
                             name="kvserve-p2p-release", daemon=True).start()

    def take_output(self, wait_s: float = 0.0) -> Optional[KVConnectorOutput]:
        """Transfers finished since the last call (lease expiry applied first), and the
        cumulative counters. With ``wait_s`` > 0 and nothing finished yet, waits up to that
        many seconds for progress (so an otherwise idle engine does not spin)."""
        if wait_s > 0 and (self._cancel or self._exposed):
            with self._lock:
                idle = not (self._sending_done or self._recving_done)
            if idle:
                self._progress.wait(wait_s)
        self._progress.clear()
        now = time.monotonic()
        with self._lock:
            for rid, e in list(self._exposed.items()):
                if e.deadline <= now and not e.busy:
                    del self._exposed[rid]
                    self._sending_done.add(rid)
                    if e.released:
                        continue
                    self.stats["requests_expired"] += 1
                    self.stats["blocks_expired"] += sum(len(g) for g in e.block_ids)
                    logger.warning("P2P KV: lease of %s expired after %.1f s with no consumer; blocks freed",
                                   rid, self.lease_s)
            out = KVConnectorOutput(self._sending_done, self._recving_done, self._recv_failed, dict(self.stats))
            self._sending_done, self._recving_done, self._recv_failed = set(), set(), set()
        return out

    def release_local(self, rid: str, early_ok: bool = False) -> None:
        """Stop lending ``rid``'s blocks (reported as finished sending). ``early_ok``: a
        consumer's release may arrive before this engine registered the blocks; remember it."""
        with self._lock:
            e = self._exposed.get(rid)
            if e is None:
                if early_ok and len(self._early_release) < 4096:
                    self._early_release.add(rid)
            elif e.busy:  # a pull reads the blocks now: freed once it is over (take_output)
                e.deadline, e.released = 0.0, True
            else:
                del self._exposed[rid]
                self._sending_done.add(rid)

    # ---- producer ----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvserve-p2p-serve", daemon=True).start()

    def _refuse(self, conn: socket.socket, peer, what: str, hello: bool = False) -> None:
        """Answer an authentication failure (the same words whatever the request id) and log it."""
        with self._lock:
            self.stats["auth_failures"] += 1
        logger.warning("P2P KV: refused %s from %s: %s (wrong or missing internal secret)", what, peer, AUTH_FAILED)
        send_frame(conn, {"op": "hello", "ok": False, "error": AUTH_FAILED} if hello
                   else {"op": "error", "error": AUTH_FAILED})

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IO_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                peer = "%s:%d" % conn.getpeername()[:2]
            except OSError:
                peer = "?"
            hello, _ = recv_frame(conn)
            secret, challenge, nonce = self.secret, None, None
            if secret is not None:
                nonce = hello.get("nonce")
                if not (hello.get("op") == "hello" and auth.fresh(hello.get("ts")) and isinstance(nonce, str)
                        and auth.verify(secret, hello.get("mac"), "kv-hello", hello.get("engine_id"),
                                        hello.get("ts"), nonce)):
                    self._refuse(conn, peer, "a consumer's handshake", hello=True)
                    return
                challenge = auth.new_nonce()
            diff = layout_mismatch(self.layout, hello.get("layout"))
            if hello.get("op") != "hello" or diff:
                msg = f"kv_layout mismatch between producer {self.engine_id} and consumer " \
                      f"{hello.get('engine_id')}: {diff}" if diff else "expected a hello frame"
                logger.error("P2P KV: refused a consumer: %s", msg)
                send_frame(conn, {"op": "hello", "ok": False, "error": msg})
                return
            reply = {"op": "hello", "ok": True, "engine_id": self.engine_id,
                     "transports": ["tcp", "nixl"] if self.nixl is not None else ["tcp"]}
            if secret is not None:
                reply.update(challenge=challenge,
                             mac=auth.sign(secret, "kv-hello-ok", nonce, challenge, self.engine_id))
            send_frame(conn, reply)
            while True:
                msg, _ = recv_frame(conn)
                op = msg.get("op")
                if secret is not None and op in ("pull", "release"):
                    label = "kv-pull" if op == "pull" else "kv-release"
                    want = pull_mac(secret, label, challenge, msg.get("req"), msg.get("blocks"), msg.get("transport"))
                    if not hmac.compare_digest(str(msg.get("mac")).encode(), want.encode()):
                        self._refuse(conn, peer, f"a {op}")  # before any look-up of the id
                        return
                if op == "pull" and msg.get("transport") == "nixl" and self.nixl is not None:
                    self._lend_nixl(conn, str(msg.get("req")), msg.get("blocks") or [], nonce)
                elif op == "pull":
                    self._send_blocks(conn, str(msg.get("req")), msg.get("blocks") or [], nonce)
                elif op == "release":
                    self.release_local(str(msg.get("req")), early_ok=True)
                    self._progress.set()
                elif op == "bye":
                    return
        except (ConnectionError, OSError, ValueError):
            return
        finally:
            conn.close()

    def _acquire(self, conn: socket.socket, rid: str, blocks: list[list[int]]) -> Optional[_Exposed]:
        """Pin ``rid``'s lent blocks for one pull (``busy``), or send an error frame and
        return None (unknown id, lease expired, released, blocks not held)."""
        deadline = time.monotonic() + REGISTER_WAIT_S
        with self._lock:
            while rid not in self._exposed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            e = self._exposed.get(rid)
            if e is not None and (e.deadline <= time.monotonic() or e.released):
                e = None  # expired or released: take_output frees it
            if e is not None:
                e.busy += 1
            self.stats["transfer_requests"] += 1
        if e is None:
            send_frame(conn, {"op": "error", "error": f"unknown or expired KV transfer id {rid!r}"})
            return None
        held = [set(g) for g in e.block_ids]
        if len(blocks) > len(held) or any(b not in held[gid] for gid, ids in enumerate(blocks) for b in ids):
            self._unpin(e, 0, 0.0, count=False)
            send_frame(conn, {"op": "error", "error": f"block ids not held for {rid!r}"})
            return None
        return e

    def _unpin(self, e: _Exposed, sent: int, secs: float, count: bool = True) -> None:
        with self._lock:
            e.busy -= 1
            if count:
                self.stats["bytes_sent"] += sent
                self.stats["transfer_bytes"] += sent
                self.stats["transfer_seconds"] += secs
                self.stats["transfers"] += 1

    def _pages_mac(self, nonce: Optional[str]):
        """The running HMAC over a TCP pull's layer frames (None without a secret)."""
        if self.secret is None:
            return None
        return hmac.new(self.secret, b"kv-pages|" + str(nonce).encode(), hashlib.sha256)

    def _send_blocks(self, conn: socket.socket, rid: str, blocks: list[list[int]], nonce: Optional[str] = None) -> None:
        e = self._acquire(conn, rid, blocks)
        if e is None:
            return
        t0 = time.perf_counter()
        sent = 0
        mac = self._pages_mac(nonce)
        try:
            for gid, ids in enumerate(blocks):
                if not ids:
                    continue
                for layer in self.group_layers[gid]:
                    cache = _bytes_view(self.caches[layer])
                    idx = torch.tensor(ids, dtype=torch.long, device=cache.device)
                    pages = cache.index_select(1, idx)
                    if pages.device.type != "cpu":
                        pages = pages.cpu()
                    raw = pages.reshape(-1).numpy()
                    if mac is not None:
                        mac.update(f"{layer},{gid},{raw.nbytes};".encode())
                        mac.update(raw.data)
                    send_frame(conn, {"op": "layer", "layer": layer, "group": gid, "nbytes": raw.nbytes}, raw.data)
                    sent += raw.nbytes
            send_frame(conn, {"op": "done"} if mac is None else {"op": "done", "mac": mac.hexdigest()})
        finally:
            self._unpin(e, sent, time.perf_counter() - t0)
        logger.debug("P2P KV: sent %s: %d bytes in %.1f ms", rid, sent, (time.perf_counter() - t0) * 1e3)

    def _lend_nixl(self, conn: socket.socket, rid: str, blocks: list[list[int]], nonce: Optional[str] = None) -> None:
        """A NIXL pull: send the agent descriptor, keep the blocks pinned until the consumer
        reports its READ over (or the connection drops / times out)."""
        e = self._acquire(conn, rid, blocks)
        if e is None:
            return
        t0 = time.perf_counter()
        sent = 0
        try:
            self.nixl.bind_thread()
            desc, md = self.nixl.descriptor()
            if self.secret is not None:  # the consumer checks the descriptor came from this producer
                desc = dict(desc, mac=_nixl_mac(self.secret, nonce, rid, desc, md))
            send_frame(conn, {"op": "nixl", **desc, "nbytes": len(md)}, md)
            deadline = time.monotonic() + IO_TIMEOUT_S
            poller = select.poll()  # poll, not select: no FD_SETSIZE limit
            poller.register(conn, select.POLLIN)
            # Progress this agent until the consumer reports its READ over.
            while not poller.poll(NIXL_PROGRESS_S * 1e3):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no end of the NIXL READ of {rid!r} after {IO_TIMEOUT_S:.0f} s")
                self.nixl.progress()
            reply, _ = recv_frame(conn)
            if reply.get("op") == "read_done" and reply.get("ok"):
                sent = int(reply.get("bytes_read") or 0)
        finally:
            self._unpin(e, sent, time.perf_counter() - t0, count=sent > 0)
        logger.debug("P2P KV: lent %s over NIXL: %d bytes in %.1f ms", rid, sent, (time.perf_counter() - t0) * 1e3)

    # ---- consumer ----------------------------------------------------------------------
    def _pull(self, spec, cancel: threading.Event) -> None:
        rid = spec.request_id
        t0 = time.perf_counter()
        ok, nbytes, err = False, 0, None
        with self._lock:
            self.stats["transfer_requests"] += 1
        sock, hello = None, None
        try:
            sock = socket.create_connection((spec.host, spec.port), timeout=CONNECT_TIMEOUT_S)
            sock.settimeout(IO_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = client_handshake(sock, self.layout, self.engine_id, self.secret)
            if self.nixl is not None and "nixl" in (hello.get("transports") or ()):
                nbytes = self._pull_nixl(sock, spec, cancel, hello)
            else:
                if self.nixl is not None and not self._warned_tcp_fallback:
                    self._warned_tcp_fallback = True
                    logger.warning("P2P KV: producer %s:%d offers no NIXL transport; pulling over TCP",
                                   spec.host, spec.port)
                nbytes = self._pull_tcp(sock, spec, cancel, hello)
            ok = True
        except KVLayoutMismatch as exc:
            err = f"handshake refused: {exc}"
        except KVTransferAuthError as exc:
            err = str(exc)
        except InterruptedError:
            err = "cancelled (request aborted)"
        except Exception as exc:  # noqa: BLE001 - any failure is a load failure (recompute / fail)
            err = f"{type(exc).__name__}: {exc}"
        finally:
            if sock is not None and hello is not None:
                try:  # done or giving up: either way the producer may free the blocks
                    send_frame(sock, self._release_frame(hello, spec.remote_request_id))
                    send_frame(sock, {"op": "bye"})
                except OSError:
                    pass
                sock.close()
        dt = time.perf_counter() - t0
        with self._lock:
            self._cancel.pop(rid, None)
            self._recving_done.add(rid)
            if ok:
                self.stats["transfer_bytes"] += nbytes
                self.stats["transfer_seconds"] += dt
                self.stats["transfers"] += 1
            else:
                self._recv_failed.add(rid)
                if not cancel.is_set():
                    self.stats["transfer_failures"] += 1
        self._progress.set()
        if ok:
            logger.debug("P2P KV: pulled %s from %s:%d: %d bytes in %.1f ms (%.1f MB/s)", rid, spec.host,
                         spec.port, nbytes, dt * 1e3, nbytes / max(dt, 1e-9) / 1e6)
        elif not cancel.is_set():
            logger.warning("P2P KV: pull of %s from %s:%d failed: %s", rid, spec.host, spec.port, err)

    def _pull_frame(self, hello: dict, rid: str, blocks: list, transport: Optional[str] = None) -> dict:
        msg = {"op": "pull", "req": rid, "blocks": blocks}
        if transport is not None:
            msg["transport"] = transport
        if self.secret is not None:
            msg["mac"] = pull_mac(self.secret, "kv-pull", hello.get("challenge"), rid, blocks, transport)
        return msg

    def _release_frame(self, hello: dict, rid: str) -> dict:
        msg = {"op": "release", "req": rid}
        if self.secret is not None:
            msg["mac"] = pull_mac(self.secret, "kv-release", hello.get("challenge"), rid)
        return msg

    def _pull_tcp(self, sock: socket.socket, spec, cancel: threading.Event, hello: dict) -> int:
        """Pages streamed over the control connection, written per layer; returns the bytes.
        With a secret, the ``done`` frame's MAC over the layer frames is checked (a mismatch
        raises KVTransferAuthError: the pull fails and the prompt is recomputed)."""
        blocks = [r for _, r in spec.pairs]
        send_frame(sock, self._pull_frame(hello, spec.remote_request_id, blocks))
        local = [torch.tensor(loc, dtype=torch.long) for loc, _ in spec.pairs]
        nbytes = 0
        mac = self._pages_mac(hello.get("client_nonce"))
        while True:
            h, payload = recv_frame(sock)
            op = h.get("op")
            if op == "done":
                if cancel.is_set():
                    raise InterruptedError("cancelled")
                if mac is not None and not hmac.compare_digest(str(h.get("mac")).encode(), mac.hexdigest().encode()):
                    raise KVTransferAuthError("KV pages failed their MAC check (altered in flight?)")
                break
            if op == "error":
                if h.get("error") == AUTH_FAILED:
                    raise KVTransferAuthError(f"the KV transfer producer refused the pull: {AUTH_FAILED}")
                raise LookupError(h.get("error"))
            if op != "layer":
                raise ValueError(f"unexpected KV transfer frame {op!r}")
            if cancel.is_set():  # aborted: drain the stream (the connection then releases)
                continue
            layer, gid = int(h["layer"]), int(h["group"])
            if mac is not None:
                mac.update(f"{layer},{gid},{len(payload)};".encode())
                mac.update(payload)
            cache = _bytes_view(self.caches[layer])
            n = len(spec.pairs[gid][0])
            src = torch.frombuffer(payload, dtype=torch.uint8).view(cache.shape[0], n, *cache.shape[2:])  # K/V or a latent
            idx = local[gid]
            if cache.device.type != "cpu":
                src, idx = src.to(cache.device), idx.to(cache.device)
            cache.index_copy_(1, idx, src)
            nbytes += len(payload)
        if any(c.device.type == "cuda" for c in self.caches.values()):
            torch.cuda.synchronize()
        return nbytes

    def _pull_nixl(self, sock: socket.socket, spec, cancel: threading.Event, hello: dict) -> int:
        """Ask for the producer's NIXL descriptor, READ the pages, report the READ over (the
        producer unpins the blocks then); returns the bytes read."""
        send_frame(sock, self._pull_frame(hello, spec.remote_request_id, [r for _, r in spec.pairs], "nixl"))
        h, md = recv_frame(sock)
        if h.get("op") == "error":
            if h.get("error") == AUTH_FAILED:
                raise KVTransferAuthError(f"the KV transfer producer refused the pull: {AUTH_FAILED}")
            raise LookupError(h.get("error"))
        if h.get("op") != "nixl" or md is None:
            raise ValueError(f"unexpected KV transfer frame {h.get('op')!r}")
        if self.secret is not None:
            desc = {k: h.get(k) for k in ("agent", "mem", "regions")}
            want = _nixl_mac(self.secret, hello.get("client_nonce"), spec.remote_request_id, desc, md)
            if not hmac.compare_digest(str(h.get("mac")).encode(), want.encode()):
                raise KVTransferAuthError("the producer's NIXL descriptor failed its MAC check")
        nbytes = 0
        try:
            nbytes = self.nixl.read(h, md, spec.pairs, self.group_layers, cancel, IO_TIMEOUT_S)
        except Exception:
            if not cancel.is_set():
                self.nixl.forget_remote(str(h.get("agent")))
            raise
        finally:  # the READ is over (done, failed or stopped): the producer may unpin
            try:
                send_frame(sock, {"op": "read_done", "ok": nbytes > 0, "bytes_read": nbytes})
            except OSError:
                pass
        return nbytes

    def _release_remote(self, host: str, port: int, remote_rid: str) -> None:
        """Tell a producer that ``remote_rid``'s blocks will not be pulled (best effort)."""
        try:
            with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
                sock.settimeout(IO_TIMEOUT_S)
                hello = client_handshake(sock, self.layout, self.engine_id, self.secret)
                send_frame(sock, self._release_frame(hello, remote_rid))
                send_frame(sock, {"op": "bye"})
        except (OSError, ValueError) as exc:
            logger.warning("P2P KV: could not release %s at %s:%d: %s", remote_rid, host, port, exc)

    def shutdown(self) -> None:
        self._stop.set()
        for ev in list(self._cancel.values()):
            ev.set()
        if self._srv is not None:
            try:
                self._srv.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._srv.close()
            self._srv = None
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
