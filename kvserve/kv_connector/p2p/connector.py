"""``P2PKVConnector``: disaggregated prefill/decode, the engine side (vLLM's NixlConnector
pull model; pages move over TCP through host memory, or with NIXL READs between the caches).

* **Producer** (``kv_producer`` / ``kv_both``): a request that carries
  ``kv_transfer_params = {"do_remote_decode": true}`` runs normally; when it finishes,
  ``request_finished`` returns ``delay_free=True`` and the params for the consumer
  (``do_remote_prefill``, host, port, request id, block ids per group, ``kv_layout``). Its
  blocks stay held until the consumer releases them, the lease (``lease_s``) expires, or
  the producer aborts; the worker reports that in ``KVConnectorOutput.finished_sending``.
* **Consumer** (``kv_consumer`` / ``kv_both``): a request carrying those params is told by
  ``get_num_new_matched_tokens`` that the remote holds its prompt past the local prefix
  hit up to ``num_prompt_tokens - 1`` (the last prompt token is recomputed for the first
  token's logits), asynchronously. It waits (``WAITING_FOR_REMOTE_KVS``) while a worker
  thread pulls the pages; ``finished_recving`` lets the scheduler resume it. A failed pull
  recomputes the prompt in the same blocks (``kv_load_failure_policy: "recompute"``, the
  default) or ends the request with finish_reason ``"abort"`` (``"fail"``). Params whose
  ``cache_salt_digest`` differs from the request's salt are not pulled (computed instead).

Extra config (``kv_connector_extra_config``): ``kv_host`` (default 127.0.0.1), ``kv_port``
(0: a free port, resolved once at start-up by ``prepare_config``; the TCP control channel),
``lease_s`` (30), ``transport`` (``"tcp"``, the default, or ``"nixl"``: each worker registers
its KV caches with a NIXL agent and a consumer READs the pages cache to cache, GPU memory to
GPU memory on CUDA; it needs ``pip install nixl``, see ``nixl_transport.py``),
``kv_load_failure_policy``. Tensor parallelism is refused (ValueError): every rank would need
its own port and handshake.

Authentication: with an internal secret (``$KVSERVE_INTERNAL_SECRET``, or a file named by
``$KVSERVE_INTERNAL_SECRET_FILE`` / ``kvserve serve --internal-secret-file``; see
``kvserve.utils.internal_auth``) every handshake, pull and release is authenticated with
HMAC-SHA256 both ways (``wire``); peers must hold the same secret. Without one the channel is
open, as before: keep ``kv_host`` on loopback or a private network.
"""

from __future__ import annotations

import hashlib
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from kvserve.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvserve.kv_connector.p2p.wire import free_port, kv_layout

if TYPE_CHECKING:
    from kvserve.request import Request

logger = logging.getLogger("kvserve")

_KNOWN_KEYS = {"kv_host", "kv_port", "lease_s", "transport", "kv_load_failure_policy", "engine_id"}


@dataclass
class RecvSpec:
    """One pull: the local request, the producer's address and request id, and per KV cache
    group ``(local block ids, remote block ids)`` of equal length (null blocks skipped)."""

    request_id: str
    host: str
    port: int
    remote_request_id: str
    pairs: list[tuple[list[int], list[int]]]


@dataclass
class P2PMetadata(KVConnectorMetadata):
    """A step's P2P work: ``send`` (request id, block ids per group) to lend, ``recv`` pulls
    to start, ``cancel`` pulls to abandon or blocks to stop lending (their requests were
    aborted), ``release`` ``(host, port, remote request id)`` remote blocks not needed."""

    send: list[tuple[str, list[list[int]]]] = field(default_factory=list)
    recv: list[RecvSpec] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    # Remote blocks this engine will not pull (prompt cached here, bad params): release them.
    release: list[tuple[str, int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.send or self.recv or self.cancel or self.release)


def salt_digest(salt: Optional[str]) -> Optional[str]:
    """SHA-256 (hex) of a ``cache_salt`` (None for none): in ``kv_transfer_params`` a consumer
    pulls only KV computed under its own request's salt, without the salt itself travelling."""
    return None if salt is None else hashlib.sha256(salt.encode()).hexdigest()


def parse_extra_config(config) -> dict[str, Any]:
    """The validated extra config with defaults. Raises ValueError for unknown keys, a bad
    role, transport or policy, or tensor parallelism."""
    kvt = config.kv_transfer_config
    extra = dict(kvt.kv_connector_extra_config or {})
    unknown = set(extra) - _KNOWN_KEYS
    if unknown:
        raise ValueError(f"P2PKVConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                         f"known: {sorted(_KNOWN_KEYS - {'engine_id'})}")
    if kvt.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError("P2PKVConnector needs kv_role kv_producer, kv_consumer or kv_both")
    transport = extra.get("transport", "tcp")
    if transport == "nixl":
        from kvserve.kv_connector.p2p.nixl_transport import nixl_import_error

        err = nixl_import_error()
        if err:
            raise ValueError(f"P2PKVConnector: transport 'nixl' is not available ({err}); install it "
                             "(pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1) or use transport 'tcp'")
    elif transport != "tcp":
        raise ValueError(f"P2PKVConnector: transport must be 'tcp' (or 'nixl'), got {transport!r}")
    policy = extra.get("kv_load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ValueError(f"kv_load_failure_policy must be 'recompute' or 'fail', got {policy!r}")
    if config.parallel_config.world_size > 1:
        raise ValueError("P2PKVConnector does not support tensor/pipeline parallelism yet "
                         f"(world_size={config.parallel_config.world_size}); run one rank per engine")
    lease = float(extra.get("lease_s", 30))
    if not lease > 0:
        raise ValueError(f"lease_s must be > 0, got {lease}")
    return {"kv_host": str(extra.get("kv_host", "127.0.0.1")), "kv_port": int(extra.get("kv_port", 0)),
            "lease_s": lease, "transport": transport, "kv_load_failure_policy": policy,
            "engine_id": extra.get("engine_id")}


class P2PKVConnector(KVConnectorBase_V1):
    """Prefill/decode KV transfer between engines (both roles; see the module docstring).

    Raises:
        ValueError: bad extra config, tensor parallelism, or transport ``nixl`` without NIXL
            installed. RuntimeError (worker start-up): NIXL / UCX failed to register the caches.
    """

    @staticmethod
    def prepare_config(config) -> None:
        """Resolve ``engine_id`` and ``kv_port`` 0 in the config once, before the workers start
        (every process then reads the same values)."""
        extra = config.kv_transfer_config.kv_connector_extra_config
        parse_extra_config(config)
        extra.setdefault("engine_id", uuid.uuid4().hex[:16])
        if int(extra.get("kv_port", 0) or 0) == 0:
            extra["kv_port"] = free_port(str(extra.get("kv_host", "127.0.0.1")))

    def __init__(self, config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(config, role, kv_cache_config)
        cfg = parse_extra_config(config)
        if not cfg["engine_id"] or not cfg["kv_port"]:
            self.prepare_config(config)
            cfg = parse_extra_config(config)
        self.cfg = cfg
        self.kv_role = config.kv_transfer_config.kv_role
        self.engine_id = cfg["engine_id"]
        self.layout = kv_layout(config, kv_cache_config)
        self.block_size = kv_cache_config.block_size
        self.load_failure_policy = cfg["kv_load_failure_policy"]
        self.producer = self.kv_role in ("kv_producer", "kv_both")
        self.consumer = self.kv_role in ("kv_consumer", "kv_both")
        self.worker = None
        if role == KVConnectorRole.WORKER:
            from kvserve.kv_connector.p2p.worker_side import P2PWorker
            from kvserve.utils.internal_auth import load_internal_secret

            self.worker = P2PWorker(self.kv_role, cfg["kv_host"], cfg["kv_port"], cfg["lease_s"], self.layout,
                                    self.engine_id, [list(g.layer_indices) for g in kv_cache_config.groups],
                                    transport=cfg["transport"], secret=load_internal_secret())
            return
        self.requests: dict[str, "Request"] = {}
        self.kv = None
        self._meta = P2PMetadata()
        self._lookups: dict[str, tuple[int, dict]] = {}  # rid -> (device hit, params) until allocation
        self._consumed: set[str] = set()  # consumer requests whose params were used (no second pull)
        self._receiving: set[str] = set()
        self._sending: set[str] = set()
        self._worker_stats: dict[str, float] = dict(transfer_bytes=0, transfer_seconds=0.0, transfers=0,
                                                    transfer_failures=0, transfer_requests=0)
        self.stats = dict(remote_prefill_requests=0, remote_prefill_tokens=0, load_failures=0,
                          remote_decode_requests=0)

    def bind_scheduler(self, requests: dict[str, "Request"], kv_cache_manager) -> None:
        self.requests = requests
        self.kv = kv_cache_manager

    def transfer_info(self) -> dict[str, Any]:
        """``{"kv_role", "engine_id", "kv_connector", "kv_transport", "kv_layout"}``
        (``GET /v1/kv_transfer``)."""
        return {"kv_role": self.kv_role, "engine_id": self.engine_id, "kv_connector": "P2PKVConnector",
                "kv_transport": self.cfg["transport"], "kv_layout": self.layout}

    # ---- scheduler role ----------------------------------------------------------------
    @staticmethod
    def _params(request: "Request") -> Optional[dict]:
        ea = request.sampling_params.extra_args
        p = ea.get("kv_transfer_params") if ea else None
        return p if isinstance(p, dict) else None

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        p = self._params(request)
        rid = request.request_id
        if not self.consumer or p is None or not p.get("do_remote_prefill") or rid in self._consumed:
            return 0, False
        try:
            n_prompt = int(p["num_prompt_tokens"])
            p["remote_block_ids"], p["remote_host"], int(p["remote_port"]), p["remote_request_id"]
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("P2P KV: request %s: bad kv_transfer_params (%s); computing the prompt", rid, exc)
            self._consumed.add(rid)
            return 0, False
        if p.get("cache_salt_digest") != salt_digest(request.cache_salt):
            # KV computed under another tenant's salt never enters this request's cache.
            logger.warning("P2P KV: request %s: kv_transfer_params come from another cache_salt; computing the "
                           "prompt", rid)
            self._skip(rid, p)
            return 0, False
        if n_prompt != request.num_prompt_tokens:
            logger.warning("P2P KV: request %s: remote prompt has %d tokens, this one %d; computing the prompt",
                           rid, n_prompt, request.num_prompt_tokens)
            self._skip(rid, p)
            return 0, False
        n = n_prompt - 1 - num_computed_tokens
        if n <= 0:  # the local prefix cache holds it all
            self._skip(rid, p)
            return 0, False
        self._lookups[rid] = (num_computed_tokens, p)
        return n, True

    def _skip(self, rid: str, p: dict) -> None:
        """Pull nothing for ``rid``; tell the producer it may free the blocks now."""
        self._consumed.add(rid)
        self._meta.release.append((str(p["remote_host"]), int(p["remote_port"]), str(p["remote_request_id"])))

    def release_held(self, request_id: str) -> None:
        if request_id in self._sending:
            self._meta.cancel.append(request_id)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        look = self._lookups.pop(rid, None)
        if look is None:
            return
        base, p = look
        if num_external_tokens <= 0:  # the scheduler kept its own (longer) prefix hit
            self._skip(rid, p)
            return
        self._consumed.add(rid)
        bs = self.block_size
        first, end = base // bs, math.ceil((base + num_external_tokens) / bs)
        local = self.kv.get_block_ids(rid)
        remote = p["remote_block_ids"]
        pairs = []
        for gid, loc in enumerate(local):
            rem = remote[gid] if gid < len(remote) else []
            pl, pr = [], []
            for i in range(first, min(end, len(loc), len(rem))):
                if loc[i] and rem[i]:  # id 0 is the null block (an evicted window entry)
                    pl.append(loc[i])
                    pr.append(int(rem[i]))
            pairs.append((pl, pr))
        self._meta.recv.append(RecvSpec(rid, str(p["remote_host"]), int(p["remote_port"]),
                                        str(p["remote_request_id"]), pairs))
        self._receiving.add(rid)
        self.stats["remote_prefill_requests"] += 1
        self.stats["remote_prefill_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output) -> P2PMetadata:
        meta, self._meta = self._meta, P2PMetadata()
        return meta

    def has_unsent_meta(self) -> bool:
        """Whether work waits for the next step's metadata (lend blocks, start / cancel pulls)."""
        return bool(self._meta)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        rid = request.request_id
        self._consumed.discard(rid)
        self._lookups.pop(rid, None)
        if rid in self._receiving:  # aborted while its pages land: free once the pull stopped
            self._meta.cancel.append(rid)
            return True, None
        p = self._params(request)
        if not self.producer or p is None or not p.get("do_remote_decode") or request.finish_reason == "abort":
            return False, None
        ids = [list(g) for g in self.kv.get_block_ids(rid)]
        self._meta.send.append((rid, ids))
        self._sending.add(rid)
        self.stats["remote_decode_requests"] += 1
        return True, {
            "do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_host": self.cfg["kv_host"],
            "remote_port": self.cfg["kv_port"], "remote_request_id": rid, "remote_block_ids": ids,
            "num_prompt_tokens": request.num_prompt_tokens, "kv_layout": self.layout,
            "cache_salt_digest": salt_digest(request.cache_salt),
        }

    def on_kv_connector_output(self, out) -> None:
        """Scheduler role: note the worker's finished transfers and counters."""
        self._receiving -= out.finished_recving
        self._sending -= out.finished_sending
        self.stats["load_failures"] += len(out.failed_recving)
        if out.stats:
            self._worker_stats = out.stats

    def get_stats(self) -> dict[str, float]:
        """Cumulative counters: ``remote_prefill_requests`` / ``remote_prefill_tokens`` (pulls
        scheduled, prompt tokens they carry), ``load_failures`` (pulls that ended without KV,
        cancelled ones included), ``remote_decode_requests`` (requests whose blocks were lent);
        the worker's ``kv_transfer_bytes`` (sent + received), ``kv_transfer_seconds``,
        ``kv_transfers`` (completed), ``kv_transfer_failures``, ``kv_transfer_requests`` (pulls
        made + served), ``kv_requests_expired``; gauges ``receiving`` / ``sending`` (requests)."""
        s = dict(self.stats)
        s.update({f"kv_{k}": v for k, v in self._worker_stats.items()})
        s["receiving"] = len(self._receiving)
        s["sending"] = len(self._sending)
        return s

    # ---- worker role -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        self.worker.handle_meta(self._meta)

    def wait_for_save(self) -> None:
        pass

    def take_kv_connector_output(self, wait_s: float = 0.0):
        return self.worker.take_output(wait_s) if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
