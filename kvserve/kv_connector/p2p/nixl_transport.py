"""P2P KV transfer over NIXL (``"transport": "nixl"``): one-sided READs of KV pages.

Each worker registers its per-layer KV cache tensors with one NIXL agent (UCX backend) at
start-up: device memory (``VRAM``) on CUDA, host memory (``DRAM``) on the CPU. The TCP
control channel (``wire.py``) still carries the handshake, the pull request, the lease and the
release; for a NIXL pull the producer answers with its agent metadata and the base address
and strides of every layer's cache, and the consumer READs the named blocks straight into its
own blocks (no staging copy, no producer CPU on the data path). UCX picks the wire: CUDA IPC /
NVLink between GPUs of one host, cross-memory attach (``cma``) between processes of one host
on the CPU, RDMA or TCP across hosts. ``UCX_PROTO_INFO=y`` prints its choice per protocol.

Page regions: a layer's cache is ``[2, num_blocks, block_size, kv_heads, row]`` (contiguous),
so K and V of block ``b`` are two regions of ``stride(1) * itemsize`` bytes at
``base + h * stride(0) * itemsize + b * stride(1) * itemsize`` (h = 0 for K, 1 for V); runs of
consecutive block ids on both sides merge into one region.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger("kvserve")

#: Remote agents kept loaded (oldest dropped first): one per producer engine seen.
MAX_REMOTE_AGENTS = 64


def load_nixl():
    """NIXL's Python API module (``nixl._api``). The ``nixl`` meta package picks
    ``nixl_cu12`` / ``nixl_cu13`` from torch's CUDA version; where only the other one is
    installed, that one is used. Raises ImportError when none imports."""
    try:
        return importlib.import_module("nixl._api")
    except ImportError as exc:
        first = exc
    for mod in ("nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(mod)
        except ImportError:
            continue
    raise first


def nixl_import_error() -> Optional[str]:
    """None when NIXL imports, else why not (one line)."""
    try:
        load_nixl()
    except Exception as exc:  # noqa: BLE001 - a broken install reports anything
        return f"{type(exc).__name__}: {exc}"
    return None


def _runs(loc: list[int], rem: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge block pairs into runs consecutive on both sides: (local starts, remote starts,
    lengths), int64 arrays."""
    a, b = np.asarray(loc, dtype=np.int64), np.asarray(rem, dtype=np.int64)
    brk = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [len(a)])))
    return a[starts], b[starts], lens


class NixlAgent:
    """One worker's NIXL agent with its KV caches registered.

    Args:
        name: agent name, unique among the peers (the engine id plus a random suffix).
        caches: layer index -> cache tensor ``[2, num_blocks, block_size, kv_heads, row]``,
            contiguous, all on one device (CPU or one CUDA device).

    Raises:
        ImportError: NIXL is not installed. RuntimeError: NIXL or UCX failed to start or
        to register the memory. ValueError: a cache tensor is not contiguous.
    """

    def __init__(self, name: str, caches: dict[int, torch.Tensor]) -> None:
        api = load_nixl()
        self.name = name
        t0 = time.perf_counter()
        # No progress thread: it spins a core even when idle. A READ's initiator progresses
        # while polling it, the producer (``progress``) while its blocks are being read.
        # STRICT: the pull / lend threads of one worker share the agent.
        # UCX turns cuda_ipc READs (get zcopy) off unless it sees NVLink, so two processes on
        # one GPU (or PCIe peers) fell back to TCP emulation: 0.47 GB/s vs ~700 GB/s with it
        # on (H100, docs/benchmarks/disaggregation.md). Set before the agent creates its UCX context; a user's
        # own setting wins.
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        conf = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self.agent = api.nixl_agent(name, conf)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            raise RuntimeError(f"NIXL agent {name} failed to start: {type(exc).__name__}: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL: the UCX backend plugin is missing")
        # layer -> [base address, K->V stride, block stride (bytes), device index]
        self.regions: dict[int, list[int]] = {}
        self.halves: dict[int, int] = {}  # 2 (K, V), or 1 (MLA's latent rows)
        self.mem, self.device = "DRAM", None
        self._reg = []
        for layer, cache in caches.items():
            if not cache.is_contiguous():
                raise ValueError(f"NIXL transport needs contiguous KV caches (layer {layer})")
            raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
            self.mem = "VRAM" if raw.is_cuda else "DRAM"
            self.device = raw.device if raw.is_cuda else None
            dev = max(raw.get_device(), 0)
            self.regions[layer] = [raw.data_ptr(), raw.stride(0), raw.stride(1), dev]
            self.halves[layer] = raw.shape[0]
            try:
                self._reg.append(self.agent.register_memory(raw))
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(f"NIXL could not register layer {layer}'s KV cache ({self.mem}): "
                                   f"{type(exc).__name__}: {exc}") from exc
        self._lock = threading.Lock()
        self._remote: OrderedDict[str, None] = OrderedDict()
        self.reads, self.read_bytes, self.read_seconds = 0, 0, 0.0  # completed READs (consumer)
        nbytes = sum(c.numel() * c.element_size() for c in caches.values())
        logger.info("P2P KV: NIXL agent %s registered %d layers (%.1f MiB of %s) in %.2f s, backend UCX "
                    "(UCX_PROTO_INFO=y prints the transports UCX picks)", name, len(caches), nbytes / 2**20,
                    self.mem, time.perf_counter() - t0)

    # ---- producer ----------------------------------------------------------------------
    def descriptor(self) -> tuple[dict[str, Any], bytes]:
        """``({"agent", "mem": "DRAM" | "VRAM", "regions": {str(layer): [base address, K->V
        stride, block stride (bytes), device index]}}, agent metadata bytes)``: what a consumer
        needs to READ this worker's blocks."""
        return ({"agent": self.name, "mem": self.mem, "regions": {str(k): v for k, v in self.regions.items()}},
                self.agent.get_agent_metadata())

    def bind_thread(self) -> None:
        """Make the caches' CUDA device current in the calling thread (UCX's CUDA transports
        use the thread's current context; a fresh Python thread has none)."""
        if self.device is not None:
            torch.cuda.set_device(self.device)

    def progress(self) -> None:
        """Drive UCX on this agent once (the target side of a READ needs it for its
        completion, and for the data too over UCX's TCP transport)."""
        self.agent.get_new_notifs()

    # ---- consumer ----------------------------------------------------------------------
    def _load_remote(self, name: str, metadata: bytes) -> None:
        with self._lock:
            if name in self._remote:
                self._remote.move_to_end(name)
                return
            got = self.agent.add_remote_agent(bytes(metadata))
            got = got.decode() if isinstance(got, bytes) else got
            if got != name:
                raise ValueError(f"NIXL metadata names agent {got!r}, expected {name!r}")
            self._remote[name] = None
            while len(self._remote) > MAX_REMOTE_AGENTS:
                old, _ = self._remote.popitem(last=False)
                try:
                    self.agent.remove_remote_agent(old)
                except Exception:  # noqa: BLE001 - best effort
                    pass

    def forget_remote(self, name: str) -> None:
        """Drop a remote agent (after a failed READ: the producer may have restarted)."""
        with self._lock:
            if name in self._remote:
                del self._remote[name]
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001 - best effort
                    pass

    def descs(self, remote: dict, pairs: list[tuple[list[int], list[int]]],
              group_layers: list[list[int]]) -> tuple[np.ndarray, np.ndarray, int]:
        """The READ's local and remote ``[N, 3]`` uint64 descriptor arrays (address, bytes,
        device) and the total bytes. Raises ValueError when the producer's regions do not
        cover a layer or its block size differs."""
        loc_rows, rem_rows = [], []
        regions = remote["regions"]
        for gid, (loc, rem) in enumerate(pairs):
            if not loc:
                continue
            ls, rs, n = _runs(loc, rem)
            for layer in group_layers[gid]:
                lb, lkv, lblk, ldev = self.regions[layer]
                r = regions.get(str(layer))
                if r is None or int(r[2]) != lblk:
                    raise ValueError(f"NIXL: producer regions do not match layer {layer}")
                rb, rkv, rblk, rdev = (int(x) for x in r)
                for h in range(self.halves[layer]):
                    loc_rows.append(np.stack([lb + h * lkv + ls * lblk, n * lblk, np.full_like(n, ldev)], 1))
                    rem_rows.append(np.stack([rb + h * rkv + rs * rblk, n * rblk, np.full_like(n, rdev)], 1))
        if not loc_rows:
            return np.zeros((0, 3), np.uint64), np.zeros((0, 3), np.uint64), 0
        la, ra = np.concatenate(loc_rows).astype(np.uint64), np.concatenate(rem_rows).astype(np.uint64)
        return la, ra, int(la[:, 1].sum())

    def read(self, remote: dict, metadata: bytes, pairs: list[tuple[list[int], list[int]]],
             group_layers: list[list[int]], cancel: threading.Event, timeout_s: float) -> int:
        """READ the producer's blocks into this worker's: per group ``(local ids, remote ids)``
        pairs, for every layer of the group. Blocks until the READ completed; returns the
        bytes read.

        Raises:
            InterruptedError: ``cancel`` was set (the READ was stopped first).
            TimeoutError: not done within ``timeout_s`` seconds.
            RuntimeError: NIXL reported an error (e.g. the producer went away).
        """
        name = str(remote["agent"])
        self.bind_thread()
        self._load_remote(name, metadata)
        la, ra, nbytes = self.descs(remote, pairs, group_layers)
        if not nbytes:
            return 0
        mem, rmem = self.mem, str(remote.get("mem", "DRAM"))
        t0 = time.perf_counter()
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(la, mem),
                                            self.agent.get_xfer_descs(ra, rmem), name)
        try:
            state = self.agent.transfer(handle)
            deadline, pause, stop = time.monotonic() + timeout_s, 20e-6, None
            while state == "PROC":
                if stop is None:
                    if cancel.is_set():
                        stop = InterruptedError("cancelled")
                    elif time.monotonic() > deadline:
                        stop = TimeoutError(f"NIXL READ not done after {timeout_s:.0f} s")
                    if stop is not None:
                        try:  # releasing an active request aborts it where UCX can
                            handle.release()
                        except Exception:  # noqa: BLE001 - cannot abort: wait for it to end
                            pass
                        else:
                            raise stop
                time.sleep(pause)
                pause = min(pause * 2, 2e-3)
                state = self.agent.check_xfer_state(handle)
            if stop is not None:
                raise stop
            if state != "DONE":
                raise RuntimeError(f"NIXL READ from {name} failed ({state})")
        finally:
            try:
                handle.release()
            except Exception:  # noqa: BLE001 - already released or unreleasable
                pass
        dt = time.perf_counter() - t0
        with self._lock:
            self.reads += 1
            self.read_bytes += nbytes
            self.read_seconds += dt
        logger.debug("P2P KV: NIXL READ %d bytes in %d regions from %s: %.2f ms (%.1f GB/s)", nbytes, len(la),
                     name, dt * 1e3, nbytes / max(dt, 1e-9) / 1e9)
        return nbytes

    def close(self) -> None:
        """Deregister the caches and drop the remote agents (best effort)."""
        with self._lock:
            for name in list(self._remote):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass
            self._remote.clear()
            for reg in self._reg:
                try:
                    self.agent.deregister_memory(reg)
                except Exception:  # noqa: BLE001
                    pass
            self._reg = []
