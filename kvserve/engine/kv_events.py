"""KV event publishers of the engine core: ``null`` and ``zmq`` (``--kv-events-config``).

``ZmqEventPublisher`` sends each step's ``KVEventBatch`` (``kvserve.core.kv_events``) from a
background thread as one ZMQ multipart message on a PUB socket, the frames vLLM's
``ZmqEventPublisher`` sends:

    (topic: bytes, seq: 8-byte big-endian unsigned, payload: msgpack KVEventBatch)

``seq`` counts batches from 0. The last ``buffer_steps`` batches are kept; with a
``replay_endpoint`` a ROUTER socket answers a replay request (one frame: the first wanted ``seq``,
8 bytes big-endian, sent by a REQ socket or a DEALER after an empty delimiter frame) with one
``(b"", seq, payload)`` reply per buffered batch from that ``seq`` on, then ``(b"", -1 as 8 signed
bytes, b"")``. A consumer that joins late or sees a gap in ``seq`` asks for what it missed.

With an internal secret (``$KVSERVE_INTERNAL_SECRET`` / ``--internal-secret-file``, see
``kvserve.utils.internal_auth``) each message and replay reply carries a fourth frame, the
batch's HMAC-SHA256 (``batch_mac``), and a replay request needs a third frame, an internal-auth
token for ``REPLAY kv_events/<seq>``; consumers without the secret ignore the extra frame. The
events are authenticated, not encrypted (they hold block hashes, and token ids only with
``include_token_ids``): keep the endpoints on loopback or a private network.

The engine never blocks on the consumers: a batch that finds ``max_queue_size`` batches queued is
dropped (``num_dropped``), and the PUB socket drops past its ``hwm`` as ZMQ does.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Optional

import msgspec

from kvserve.config import KVEventsConfig
from kvserve.core.kv_events import KVEventBatch

logger = logging.getLogger("kvserve")

#: The end-of-replay marker's sequence frame (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    """Publishes ``KVEventBatch`` es in order. Counters: events published / dropped (cumulative)."""

    def __init__(self) -> None:
        self.num_published = 0  # events (not batches) handed to the socket
        self.num_dropped = 0  # events of batches dropped on a full queue

    def publish(self, batch: KVEventBatch) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """``{"published": events, "dropped": events}``, cumulative."""
        return {"published": self.num_published, "dropped": self.num_dropped}

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch was sent. Returns whether it was."""
        return True

    def shutdown(self) -> None:
        pass


class NullEventPublisher(EventPublisher):
    """Drops everything (``publisher: "null"``)."""

    def publish(self, batch: KVEventBatch) -> None:
        return


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or an ipc / inproc address binds (stable side), else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher(EventPublisher):
    """PUB socket + replay ROUTER socket, fed by a queue from a background thread.

    Raises:
        ValueError: an endpoint cannot be bound / connected (named, with ZMQ's reason).
    """

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, secret: Optional[bytes] = None) -> None:
        import zmq  # here: importing kvserve stays free of zmq

        super().__init__()
        self.config = config
        self._secret = secret
        self._replay_verifier = None
        if secret is not None:
            from kvserve.utils.internal_auth import TokenVerifier

            self._replay_verifier = TokenVerifier(secret)
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[Optional[KVEventBatch]] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open endpoint {config.endpoint!r} / replay_endpoint "
                             f"{config.replay_endpoint!r}: {exc}") from None
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._topic = config.topic.encode()
        self._seq = 0
        self._num_queued = self._num_done = 0  # batches
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s (topic %r)", config.endpoint,
                    f", replay on {config.replay_endpoint}" if self._replay is not None else "", config.topic)

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one step's batch (never blocks; dropped and counted when the queue is full)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
            self._num_queued += 1
        except queue.Full:
            self.num_dropped += len(batch.events)

    def _run(self) -> None:
        import zmq

        enc = msgspec.msgpack.Encoder()
        q = self._queue
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as exc:
                    if not self._running:
                        break
                    logger.warning("KV events: replay request failed: %s", exc)
            try:
                batch = q.get(timeout=0.02)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if batch is None:
                break
            payload = enc.encode(batch)
            seq = self._seq
            try:
                self._pub.send_multipart(self._frames(seq, payload))
            except zmq.ZMQError as exc:
                logger.warning("KV events: send failed (%s); batch %d dropped", exc, seq)
                self.num_dropped += len(batch.events)
            else:
                self._seq = seq + 1
                self._buffer.append((seq, payload))
                self.num_published += len(batch.events)
            self._num_done += 1

    def _frames(self, seq: int, payload: bytes) -> tuple[bytes, ...]:
        """``(topic, seq, payload)``, plus the batch's MAC (``batch_mac``) with an internal secret."""
        head = (self._topic, seq.to_bytes(8, "big"), payload)
        return head if self._secret is None else (*head, batch_mac(self._secret, self._topic, seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) not in (3, 4) or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        ident, start = frames[0], frames[2]
        start_seq = int.from_bytes(start, "big")
        if self._replay_verifier is not None:
            token = frames[3].decode(errors="replace") if len(frames) == 4 else None
            if not self._replay_verifier.verify(token, "REPLAY", f"kv_events/{start_seq}"):
                logger.warning("KV events: replay request without a valid internal-auth token refused")
                self._replay.send_multipart((ident, b"", END_SEQ, b""))
                return
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((ident, b"", *self._frames(seq, payload)[1:]))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch was sent (tests, shutdown). Returns whether it was."""
        end = time.monotonic() + timeout
        while self._num_done < self._num_queued and time.monotonic() < end:
            time.sleep(0.005)
        return self._num_done >= self._num_queued

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    def shutdown(self) -> None:
        """Send what is queued (up to a second), stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT_S + 1.0)
        if not self._thread.is_alive():
            self._close_sockets()


def batch_mac(secret: bytes, topic: bytes, seq: int, payload: bytes) -> bytes:
    """HMAC-SHA256 (hex, ASCII) of one published batch: its topic, sequence number and the
    SHA-256 of its payload (``kvserve.utils.internal_auth.sign``, label ``kv_events``)."""
    from kvserve.utils.internal_auth import sign

    return sign(secret, "kv_events", topic.decode(errors="replace"), seq, hashlib.sha256(payload).hexdigest()).encode()


def make_event_publisher(config: Optional[KVEventsConfig], data_parallel_rank: int = 0) -> Optional[EventPublisher]:
    """The publisher ``config`` asks for, or None when KV events are off (no recorder is attached then).

    With an internal secret (``kvserve.utils.internal_auth.load_internal_secret``) every batch
    carries a fourth frame, its MAC, and replay requests need an internal-auth token.
    """
    if config is None or not config.enabled:
        return None
    from kvserve.utils.internal_auth import load_internal_secret

    return ZmqEventPublisher(config, data_parallel_rank, secret=load_internal_secret())
