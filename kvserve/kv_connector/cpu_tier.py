"""Worker half of the CPU tier: the host block pool and the copies to and from it.

The pool is one tensor ``(num_host_blocks, num_layers, *layer block shape)`` in the device
cache's dtype (1-byte formats as bytes, so quantized blocks stay quantized): a slot is one
block in every layer, contiguous, so a slot is one DMA and one disk file payload. Pinned
on CUDA.

Copies run off the decode critical path:

* CPU device: saves run on one transfer thread (``index_select`` / ``index_copy_``, which
  release the GIL) while the host samples and schedules; ``wait_for_save`` at the start of
  the next step orders them before the next forward can overwrite a block.
* CUDA: on a transfer stream that first waits for the compute stream, the saved blocks are
  gathered into a slot-major staging tensor on the device and copied to their pinned slots
  (one DMA per run of consecutive slots); the next step's compute stream waits for that
  stream's event (no host sync). Loads: pinned slots -> device staging (one DMA per run) ->
  scatter into the caches, on the same stream, which the compute stream then waits for.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger("kvserve")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


#: Blocks per device staging tensor on CUDA (bounds the transient device memory of a transfer).
_CHUNK = 64


def _runs(dst: list[int], src: list[int]) -> list[tuple[int, int, int]]:
    """``(dst start, src start, length)`` runs where both index lists are consecutive."""
    out = []
    i = 0
    while i < len(dst):
        j = i + 1
        while j < len(dst) and dst[j] == dst[j - 1] + 1 and src[j] == src[j - 1] + 1:
            j += 1
        out.append((dst[i], src[i], j - i))
        i = j
    return out


class CpuTierWorker:
    """Host pool + transfers for ``OffloadingConnector`` (worker role)."""

    def __init__(self, config, kv_cache_config, num_host_blocks: int, disk=None) -> None:
        self.num_host_blocks = num_host_blocks
        self.device = torch.device(config.device)
        self.disk = disk  # a DiskStore under the pool, or None
        self.caches: list[torch.Tensor] = []
        self.pool: torch.Tensor | None = None
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._disk_exec = ThreadPoolExecutor(1, thread_name_prefix="kv-disk") if disk is not None else None
        self._pending: list[Future] = []
        self._disk_pending: list[Future] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._save_event = None
        self._disk_after: list = []  # CUDA: (event, disk saves) whose slot bytes are taken next step
        self._lock = threading.Lock()
        # Cumulative transfer counts and times (seconds), for benchmarks.
        self.stats = dict(save_blocks=0, load_blocks=0, save_s=0.0, load_s=0.0)

    def register_kv_caches(self, kv_caches: dict[int, torch.Tensor]) -> None:
        """Allocate the pool after the device caches (every layer must share one block shape).

        Raises ValueError if the layers' caches differ in shape or dtype, or a block's bytes
        differ from the disk tier's payload size.
        """
        pin = self.device.type == "cuda"
        self.caches = [_as_bytes(kv_caches[i]) for i in sorted(kv_caches)]
        c0 = self.caches[0]
        if any(c.shape != c0.shape or c.dtype != c0.dtype for c in self.caches):
            raise ValueError("the CPU tier needs every layer's KV cache in one shape and dtype")
        # Layer block shape: the cache is (2, num_blocks, block_size, heads, head_size).
        blk = (c0.shape[0],) + tuple(c0.shape[2:])
        self.pool = torch.zeros((self.num_host_blocks, len(self.caches)) + blk, dtype=c0.dtype, pin_memory=pin)
        per_block = self.pool[0].numel() * self.pool.element_size()
        if self.disk is not None and per_block != self.disk.payload_bytes:
            raise ValueError(f"KV disk tier: a block is {per_block} bytes in the cache tensors, "
                             f"{self.disk.payload_bytes} in the KV cache config")
        logger.info("KV CPU tier: %d blocks, %.2f GiB host memory%s", self.num_host_blocks,
                    self.pool.numel() * self.pool.element_size() / 2**30, " (pinned)" if pin else "")

    def _count(self, kind: str, n: int, dt: float) -> None:
        with self._lock:
            self.stats[f"{kind}_blocks"] += n
            self.stats[f"{kind}_s"] += dt

    # ---- saves ------------------------------------------------------------------------
    @torch.inference_mode()
    def save(self, pairs: list[tuple[int, int]], disk_saves=()) -> None:
        """Copy device blocks to host slots (``(block, slot)`` pairs) off the critical path,
        then hand ``disk_saves`` ``(slot, key)`` to the disk thread."""
        blocks = [b for b, _ in pairs]
        slots = [s for _, s in pairs]
        if self._stream is None:
            self._pending.append(self._exec.submit(self._save_cpu, blocks, slots, list(disk_saves)))
            return
        t0 = time.perf_counter()
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            order = sorted(range(len(slots)), key=slots.__getitem__)  # consecutive slots -> one DMA
            slots_all = [slots[i] for i in order]
            blocks_all = [blocks[i] for i in order]
            for c0 in range(0, len(slots_all), _CHUNK):
                sl = slots_all[c0:c0 + _CHUNK]
                idx = torch.tensor(blocks_all[c0:c0 + _CHUNK], dtype=torch.long).to(self.device, non_blocking=True)
                staged = torch.stack([c.index_select(1, idx) for c in self.caches], dim=1)  # (2, L, n, ...)
                staged = staged.permute(2, 1, 0, *range(3, staged.dim())).contiguous()  # (n, L, 2, ...)
                for s, i, n in _runs(sl, list(range(len(sl)))):
                    self.pool[s:s + n].copy_(staged[i:i + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._save_event = ev
        self._count("save", len(slots), time.perf_counter() - t0)
        if disk_saves and self.disk is not None:
            self._disk_after.append((ev, list(disk_saves)))

    def _save_cpu(self, blocks: list[int], slots: list[int], disk_saves=()) -> None:
        t0 = time.perf_counter()
        b = torch.tensor(blocks, dtype=torch.long)
        s = torch.tensor(slots, dtype=torch.long)
        with torch.inference_mode():
            for layer, c in enumerate(self.caches):
                self.pool[:, layer].index_copy_(0, s, c.index_select(1, b).transpose(0, 1))
        self._count("save", len(slots), time.perf_counter() - t0)
        if disk_saves and self.disk is not None:
            # Bytes taken now: the slot may be reused after this step; nothing waits for files.
            items = [(key, self.slot_bytes(slot)) for slot, key in disk_saves]
            self._disk_pending = [f for f in self._disk_pending if not f.done()]
            self._disk_pending.append(self._disk_exec.submit(self._write_files, items))

    def wait_for_save(self) -> None:
        """Earlier saves no longer read the device cache: the CPU thread is joined; on CUDA the
        compute stream waits for the save event (no host sync). Re-raises a copy's error."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        if self._save_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._save_event)
            self._save_event = None
        if self._disk_after:
            # Before this step can reuse a slot: its bytes are taken once its DMA is done.
            after, self._disk_after = self._disk_after, []
            for ev, disk_saves in after:
                ev.synchronize()
                items = [(key, self.slot_bytes(slot)) for slot, key in disk_saves]
                self._disk_pending = [f for f in self._disk_pending if not f.done()]
                self._disk_pending.append(self._disk_exec.submit(self._write_files, items))

    # ---- disk --------------------------------------------------------------------------
    def slot_bytes(self, slot: int) -> bytes:
        """One host slot's payload (every layer of the block, layer after layer)."""
        return self.pool[slot].view(torch.uint8).numpy().tobytes()

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
        if self._stream is not None:
            self._stream.synchronize()  # no DMA still reads or writes a slot
        for slot, payload in items:
            self.pool[slot].view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    # ---- swap-out and loads (before the forward) ---------------------------------------
    @torch.inference_mode()
    def swap_out_and_load(self, swap_out: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Copy ``swap_out`` ``(block, slot)`` to the host, then ``loads`` ``(slot, block)`` to the
        device; both land before this step's forward (the compute stream waits for them)."""
        if swap_out:
            if self._stream is None:
                self._save_cpu([b for b, _ in swap_out], [s for _, s in swap_out])
            else:
                self.save(swap_out)
                # The freed blocks may be rewritten by this step's forward: it waits for the copy.
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
                self._save_event = None
        if not loads:
            return
        t0 = time.perf_counter()
        loads = sorted(loads)
        slots = [s for s, _ in loads]
        blocks = torch.tensor([b for _, b in loads], dtype=torch.long)
        if self._stream is None:
            s = torch.tensor(slots, dtype=torch.long)
            for layer, c in enumerate(self.caches):
                c.index_copy_(1, blocks, self.pool[:, layer].index_select(0, s).transpose(0, 1))
            self._count("load", len(loads), time.perf_counter() - t0)
            return
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            for c0 in range(0, len(slots), _CHUNK):
                sl = slots[c0:c0 + _CHUNK]
                staged = torch.empty((len(sl),) + tuple(self.pool.shape[1:]), dtype=self.pool.dtype,
                                     device=self.device)
                for s, i, n in _runs(sl, list(range(len(sl)))):
                    staged[i:i + n].copy_(self.pool[s:s + n], non_blocking=True)
                idx = blocks[c0:c0 + _CHUNK].to(self.device, non_blocking=True)
                for layer, c in enumerate(self.caches):
                    c.index_copy_(1, idx, staged[:, layer].transpose(0, 1))
        cur.wait_stream(self._stream)
        self._count("load", len(loads), time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Write the queued block files, stop the copy threads, then drop the host pool
        (pinned on CUDA) and the views of the device caches."""
        try:
            self.flush_disk()
        finally:
            self._exec.shutdown(wait=True)
            if self._disk_exec is not None:
                self._disk_exec.shutdown(wait=True)
            self.caches, self.pool = [], None
