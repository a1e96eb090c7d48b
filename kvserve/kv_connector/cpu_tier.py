"""Worker half of the CPU tier: the host block pool and the copies to and from it.

The pool holds, per layer, a tensor shaped like that layer's device cache with
``num_host_blocks`` blocks on dim 1 (same dtype, so quantized blocks stay quantized; 1-byte
formats are copied as bytes). Pinned on CUDA.

Copies run off the decode critical path:

* CPU device: saves run on one transfer thread (``index_select`` + ``index_copy_``,
  which release the GIL) while the host samples and schedules; ``wait_for_save`` at the
  start of the next step orders them before the next forward can overwrite a block.
* CUDA: saves gather the blocks on a transfer stream (after the forward, by a stream
  wait), copy them to a pinned staging buffer in one DMA and the thread scatters them into
  the pool once the event fires. Loads gather from the pool into pinned staging, one H2D
  copy and a scatter on the transfer stream; the compute stream waits for that stream (no
  host sync).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

logger = logging.getLogger("kvserve")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


class CpuTierWorker:
    """Host pool + transfers for ``OffloadingConnector`` (worker role)."""

    def __init__(self, config, kv_cache_config, num_host_blocks: int, disk=None) -> None:
        self.num_host_blocks = num_host_blocks
        self.disk = disk  # a DiskStore under the pool, or None
        self._disk_exec = ThreadPoolExecutor(1, thread_name_prefix="kv-disk") if disk is not None else None
        self._disk_pending: list[Future] = []
        self.device = torch.device(config.device)
        self.layers: list[int] = []
        self.caches: list[torch.Tensor] = []
        self.pool: list[torch.Tensor] = []
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._pending: list[Future] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.Lock()
        # Cumulative transfer timings (seconds) and block counts, for the benchmarks.
        self.stats = dict(save_blocks=0, load_blocks=0, save_s=0.0, load_s=0.0)

    def register_kv_caches(self, kv_caches: dict[int, torch.Tensor]) -> None:
        """Allocate the pool after the device caches (one host tensor per layer)."""
        pin = self.device.type == "cuda"
        self.layers = sorted(kv_caches)
        self.caches = [_as_bytes(kv_caches[i]) for i in self.layers]
        for c in self.caches:
            shape = list(c.shape)
            shape[1] = self.num_host_blocks
            self.pool.append(torch.zeros(shape, dtype=c.dtype, pin_memory=pin))
        nbytes = sum(p.numel() * p.element_size() for p in self.pool)
        per_block = sum(p[:, 0].numel() * p.element_size() for p in self.pool)
        if self.disk is not None and per_block != self.disk.payload_bytes:
            raise ValueError(f"KV disk tier: a block is {per_block} bytes in the cache tensors, "
                             f"{self.disk.payload_bytes} in the KV cache config")
        logger.info("KV CPU tier: %d blocks, %.2f GiB host memory%s", self.num_host_blocks, nbytes / 2**30,
                    " (pinned)" if pin else "")

    # ---- saves ------------------------------------------------------------------------
    @torch.inference_mode()
    def save(self, pairs: list[tuple[int, int]], disk_saves: list[tuple[int, bytes]] = ()) -> None:
        """Copy device blocks to host slots (``(block, slot)`` pairs) off the critical path,
        then hand ``disk_saves`` ``(slot, key)`` to the disk thread."""
        blocks = torch.tensor([b for b, _ in pairs], dtype=torch.long)
        slots = torch.tensor([s for _, s in pairs], dtype=torch.long)
        if self._stream is None:
            self._pending.append(self._exec.submit(self._save_cpu, blocks, slots, list(disk_saves)))
            return
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            idx = blocks.to(self.device, non_blocking=True)
            staged = torch.stack([c.index_select(1, idx) for c in self.caches])
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
            staged.record_stream(self._stream)
        self._pending.append(self._exec.submit(self._scatter_host, ev, host, slots, len(pairs), list(disk_saves)))

    def _save_cpu(self, blocks: torch.Tensor, slots: torch.Tensor, disk_saves=()) -> None:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for c, p in zip(self.caches, self.pool):
                p.index_copy_(1, slots, c.index_select(1, blocks))
        self._count("save", len(slots), time.perf_counter() - t0)
        self._to_disk(disk_saves)

    def _scatter_host(self, ev, host: torch.Tensor, slots: torch.Tensor, n: int, disk_saves=()) -> None:
        t0 = time.perf_counter()
        ev.synchronize()
        with torch.inference_mode():
            for i, p in enumerate(self.pool):
                p.index_copy_(1, slots, host[i])
        self._count("save", n, time.perf_counter() - t0)
        self._to_disk(disk_saves)

    # ---- disk --------------------------------------------------------------------------
    def slot_bytes(self, slot: int) -> bytes:
        """One host slot's payload: its bytes in every layer, layer after layer."""
        return b"".join(p[:, slot].contiguous().view(torch.uint8).numpy().tobytes() for p in self.pool)

    def _to_disk(self, disk_saves) -> None:
        # The bytes are taken now (the slot may be reused after this step); files are written
        # by the disk thread, which nothing waits for.
        if disk_saves and self.disk is not None:
            items = [(key, self.slot_bytes(slot)) for slot, key in disk_saves]
            self._disk_pending = [f for f in self._disk_pending if not f.done()]
            self._disk_pending.append(self._disk_exec.submit(self._write_files, items))

    def _write_files(self, items) -> None:
        for key, payload in items:
            self.disk.write(key, payload)

    def flush_disk(self) -> None:
        """Wait until every queued block file is written (tests, shutdown)."""
        self.wait_for_save()
        pending, self._disk_pending = self._disk_pending, []
        for f in pending:
            f.result()

    @torch.inference_mode()
    def write_slots(self, items: list[tuple[int, bytes]]) -> None:
        """Fill host slots from verified disk payloads (before this step's loads read them)."""
        for slot, payload in items:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            off = 0
            for p in self.pool:
                dst = p[:, slot]
                n = dst.numel() * p.element_size()
                dst.copy_(buf[off:off + n].view(p.dtype).view(dst.shape))
                off += n

    def _count(self, kind: str, n: int, dt: float) -> None:
        with self._lock:
            self.stats[f"{kind}_blocks"] += n
            self.stats[f"{kind}_s"] += dt

    def wait_for_save(self) -> None:
        """Wait for pending saves (host scatter included); re-raises a copy's error."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    # ---- swap-out and loads (before the forward) ---------------------------------------
    @torch.inference_mode()
    def swap_out_and_load(self, swap_out: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Copy ``swap_out`` ``(block, slot)`` to the host, then ``loads`` ``(slot, block)`` to the
        device; both land before this step's forward."""
        if swap_out:
            blocks = torch.tensor([b for b, _ in swap_out], dtype=torch.long)
            slots = torch.tensor([s for _, s in swap_out], dtype=torch.long)
            if self._stream is None:
                self._save_cpu(blocks, slots)
            else:
                self.save(swap_out)
                self.wait_for_save()
        if not loads:
            return
        t0 = time.perf_counter()
        slots = torch.tensor([s for s, _ in loads], dtype=torch.long)
        blocks = torch.tensor([b for _, b in loads], dtype=torch.long)
        if self._stream is None:
            for c, p in zip(self.caches, self.pool):
                c.index_copy_(1, blocks, p.index_select(1, slots))
            self._count("load", len(loads), time.perf_counter() - t0)
            return
        first = self.pool[0]
        shape = [len(self.pool), first.shape[0], len(loads)] + list(first.shape[2:])
        host = torch.empty(shape, dtype=first.dtype, pin_memory=True)
        for i, p in enumerate(self.pool):
            torch.index_select(p, 1, slots, out=host[i])
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            dev = host.to(self.device, non_blocking=True)
            idx = blocks.to(self.device, non_blocking=True)
            for i, c in enumerate(self.caches):
                c.index_copy_(1, idx, dev[i])
            dev.record_stream(self._stream)
        cur.wait_stream(self._stream)
        self._count("load", len(loads), time.perf_counter() - t0)

    def shutdown(self) -> None:
        try:
            self.flush_disk()
        finally:
            self._exec.shutdown(wait=True)
            if self._disk_exec is not None:
                self._disk_exec.shutdown(wait=True)
