"""CPU tier: a host block pool under the device prefix cache (``--kv-offloading-size GiB``).

Scheduler half (this module, pure Python): an LRU index ``content key -> host slot`` over
``num_host_blocks`` slots (``kv_offloading_size / bytes_per_block``, every layer of a block
in one slot, in the device cache's format). Keys are the deterministic chain of
``block_hash.py``.

* **Write-through at fill**: every block that becomes full (its tokens known, its KV
  written by a scheduled step) is copied to the host after that step's forward, once per
  key (an existing key is only touched). Write-back on device eviction would save fewer
  copies but needs the copy *before* the evicting step's forward, i.e. on the critical
  path; write-through copies are off it (a transfer thread / CUDA stream) and a block is
  already safe when the device evicts it.
* **Lookup**: after the device prefix cache misses, ``get_num_new_matched_tokens`` walks the
  same chain into the index; hits are loaded into freshly allocated device blocks before
  the step's forward. A key is served only from the step after the one that saved it.
* **Swap preemption** (``--preemption-mode swap``): a preempted request's full blocks are
  in the tier already; its partly filled last block is copied to a slot owned by the
  request before the step's forward (before anyone can reuse the device block), and comes
  back with the full blocks when the request resumes: nothing is recomputed unless the
  tier had to evict the request's blocks meanwhile.

The worker half (host pool, copies) is ``cpu_tier.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from kvserve.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvserve.kv_connector.block_hash import chain_keys, model_fingerprint, root_key

if TYPE_CHECKING:
    from kvserve.request import Request

logger = logging.getLogger("kvserve")


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """A step's CPU-tier transfers (block ids of group 0, host slots).

    Attributes:
        swap_out: ``(device block, host slot)`` copied to the host *before* the forward.
        loads: ``(host slot, device block)`` copied to the device before the forward
            (after ``swap_out``).
        saves: ``(device block, host slot)`` copied to the host after the forward.
    """

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    disk_loads: list[tuple[int, bytes]] = field(default_factory=list)  # (host slot, verified payload)
    disk_saves: list[tuple[int, bytes]] = field(default_factory=list)  # (host slot, key): after its save

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.loads or self.saves or self.disk_loads or self.disk_saves)


class _ReqState:
    __slots__ = ("keys", "num_saved", "lookup")

    def __init__(self) -> None:
        self.keys: list[bytes] = []  # content keys of its full known blocks so far
        self.num_saved = 0  # leading blocks offered to the tier
        self.lookup: Optional[tuple] = None  # (start block, host slots, disk (key, payload)s, swap tail)


class _SwapEntry:
    __slots__ = ("slot", "block_idx", "num_tokens", "step")

    def __init__(self, slot: int, block_idx: int, num_tokens: int, step: int) -> None:
        self.slot, self.block_idx, self.num_tokens, self.step = slot, block_idx, num_tokens, step


def num_host_blocks(config, kv_cache_config) -> int:
    """Host slots for ``--kv-offloading-size`` GiB (one slot = one block in every layer)."""
    size = config.cache_config.kv_offloading_size
    return int(size * 2**30 // kv_cache_config.bytes_per_block)


class OffloadingConnector(KVConnectorBase_V1):
    """The CPU tier as a KV connector (vLLM's ``OffloadingConnector`` role split).

    Raises:
        ValueError: with several KV cache groups, or a tier smaller than one block.
    """

    def __init__(self, config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(config, role, kv_cache_config)
        if len(kv_cache_config.groups) != 1:
            raise ValueError("--kv-offloading-size supports one KV cache group (full attention) today")
        self.block_size = kv_cache_config.block_size
        self.num_host_blocks = num_host_blocks(config, kv_cache_config)
        if self.num_host_blocks < 1:
            raise ValueError(f"--kv-offloading-size {config.cache_config.kv_offloading_size} GiB holds no block "
                             f"of {kv_cache_config.bytes_per_block} bytes")
        self.swap_mode = config.scheduler_config.preemption_mode == "swap"
        self.worker = None
        spec = kv_cache_config.groups[0].spec
        self.fingerprint = model_fingerprint(config)
        self._kv_format = f"{spec.dtype}/{spec.num_kv_heads}x{spec.head_size}/{kv_cache_config.num_layers}"
        cc = config.cache_config
        self.disk = None
        # The tier under the CPU tier ("disk_*" counters): local files or a remote server.
        if cc.kv_disk_path:
            from kvserve.kv_connector.disk_tier import DiskStore

            self.disk = DiskStore(cc.kv_disk_path, self.fingerprint, self._kv_format, self.block_size,
                                  kv_cache_config.bytes_per_block)
        elif cc.kv_remote_url:
            from kvserve.kv_connector.remote_tier import RemoteStore

            self.disk = RemoteStore(cc.kv_remote_url, self.fingerprint, self._kv_format, self.block_size,
                                    kv_cache_config.bytes_per_block)
        if role == KVConnectorRole.WORKER:
            from kvserve.kv_connector.cpu_tier import CpuTierWorker

            self.worker = CpuTierWorker(config, kv_cache_config, self.num_host_blocks, self.disk)
            return
        # Disk index: keys of files written by this engine or found at start-up, oldest first.
        self.disk_index: OrderedDict[bytes, None] = OrderedDict()
        self.disk_budget = int(cc.kv_disk_size * 2**30 // self.disk.file_bytes) if self.disk and cc.kv_disk_size \
            else None
        if self.disk is not None:
            for key, _ in self.disk.scan():
                self.disk_index[key] = None
            if cc.kv_disk_path:
                logger.info("KV disk tier at %s: %d block files found", cc.kv_disk_path, len(self.disk_index))
            else:
                logger.info("KV remote tier at %s", cc.kv_remote_url)
        self._roots: dict[Optional[str], bytes] = {}
        # key -> (slot, step saved); LRU order, oldest first.
        self.index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.free_slots: list[int] = list(range(self.num_host_blocks - 1, -1, -1))
        self._owner: dict[int, bytes] = {}  # slot -> key (index entries only)
        self._reqs: dict[str, _ReqState] = {}
        self._swap: dict[str, _SwapEntry] = {}
        self._pinned: set[int] = set()  # slots read by this step's loads
        self._release: list[int] = []  # swap slots to free once this step's loads are built
        self._meta = OffloadingConnectorMetadata()
        self.step = 0
        self._warned = False
        self.requests: dict[str, "Request"] = {}
        self.kv = None
        self.bytes_per_block = kv_cache_config.bytes_per_block
        # Cumulative counters (blocks unless named tokens).
        self.stats = dict(queries=0, hit_tokens=0, blocks_stored=0, blocks_loaded=0, blocks_evicted=0,
                          swap_out_blocks=0, swap_in_blocks=0, disk_hit_tokens=0, disk_blocks_stored=0,
                          disk_blocks_loaded=0, disk_blocks_rejected=0)

    def bind_scheduler(self, requests: dict[str, "Request"], kv_cache_manager) -> None:
        """The scheduler's request map and KV cache manager (to read block ids at build time)."""
        self.requests = requests
        self.kv = kv_cache_manager

    # ---- keys ----------------------------------------------------------------------------
    def _keys(self, request: "Request", num_blocks: int) -> list[bytes]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState()
        keys = st.keys
        if len(keys) < num_blocks:
            salt = request.cache_salt
            if keys:
                parent = keys[-1]
            else:
                parent = self._roots.get(salt)
                if parent is None:
                    parent = self._roots[salt] = root_key(self.fingerprint, self._kv_format, self.block_size, salt)
            keys.extend(chain_keys(parent, request.all_token_ids, len(keys), num_blocks, self.block_size))
        return keys

    # ---- slots ---------------------------------------------------------------------------
    def _alloc_slot(self) -> Optional[int]:
        if self.free_slots:
            return self.free_slots.pop()
        for key, (slot, _) in self.index.items():  # least recently used first
            if slot not in self._pinned:
                del self.index[key]
                del self._owner[slot]
                self.stats["blocks_evicted"] += 1
                return slot
        return None

    # ---- scheduler role ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        start = num_computed_tokens // bs
        max_blocks = (request.num_tokens - 1) // bs
        slots: list[int] = []
        if max_blocks > start and self.index:
            keys = self._keys(request, max_blocks)
            index, step = self.index, self.step
            for i in range(start, max_blocks):
                e = index.get(keys[i])
                if e is None or e[1] >= step:
                    break
                slots.append(e[0])
        disk: list[tuple[bytes, bytes]] = []
        end = start + len(slots)
        if self.disk is not None and max_blocks > end:
            keys = self._keys(request, max_blocks)
            # Stop where the CPU tier has the key but not yet written, and keep room for slots.
            room = self.num_host_blocks - len(self._pinned) - len(slots) - 1
            for i in range(end, min(max_blocks, end + max(room, 0))):
                k = keys[i]
                if k in self.index or (k not in self.disk_index and not self.disk.exists(k)):
                    break
                payload = self.disk.read(k)
                if payload is None:
                    self.disk_index.pop(k, None)
                    self.stats["disk_blocks_rejected"] += 1
                    break
                disk.append((k, payload))
        num = (len(slots) + len(disk)) * bs
        tail = None
        sw = self._swap.get(request.request_id)
        if sw is not None and sw.block_idx == start + len(slots) + len(disk) and sw.step < self.step:
            n = min(sw.num_tokens, request.num_tokens - 1 - sw.block_idx * bs)
            if n > 0:
                tail = (sw.slot, n)
                num += n
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState()
        st.lookup = (start, slots, disk, tail)
        return num, False

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.lookup is None:
            return
        start, slots, disk, tail = st.lookup
        st.lookup = None
        self.stats["queries"] += 1
        if self.stats["queries"] == 200 and not self.stats["hit_tokens"] and not self._warned:
            self._warned = True
            logger.warning("KV CPU tier: no hits after 200 requests (%d blocks stored); prompts do not repeat past "
                           "the device prefix cache, or --kv-offloading-size is too small", self.stats["blocks_stored"])
        if num_external_tokens <= 0:
            return
        self.stats["hit_tokens"] += num_external_tokens
        loads = self._meta.loads
        index = self.index
        for j, slot in enumerate(slots):
            loads.append((slot, block_ids[start + j]))
            self._pinned.add(slot)
            index.move_to_end(self._owner[slot])
        self.stats["blocks_loaded"] += len(slots)
        for j, (k, payload) in enumerate(disk):
            slot = self._alloc_slot()  # room was kept at lookup
            self._pinned.add(slot)
            index[k] = (slot, self.step - 1)  # written from the payload before this step's loads
            self._owner[slot] = k
            self._meta.disk_loads.append((slot, payload))
            loads.append((slot, block_ids[start + len(slots) + j]))
        if disk:
            self.stats["disk_blocks_loaded"] += len(disk)
            self.stats["disk_hit_tokens"] += len(disk) * self.block_size
        if tail is not None:
            loads.append((tail[0], block_ids[start + len(slots) + len(disk)]))
            self._pinned.add(tail[0])
            self._release.append(self._swap.pop(request.request_id).slot)
            self.stats["swap_in_blocks"] += 1

    def request_preempted(self, request: "Request", block_ids: list[int]) -> None:
        if not self.swap_mode or not block_ids:
            return
        bs = self.block_size
        known = min(request.num_computed_tokens, request.num_tokens)
        full = known // bs
        # Full blocks not saved yet (with async scheduling the block of the in-flight step's
        # token fills after the scheduler last saw it) are copied before this step's forward,
        # as the tail is: the freed blocks may be rewritten by that forward.
        self._save_full(request, block_ids, full, self._meta.swap_out)
        tail = known - full * bs
        if tail and full < len(block_ids):
            slot = self._alloc_slot()
            if slot is None:
                return  # tier full of pinned slots: the tail is recomputed
            self._pinned.add(slot)
            old = self._swap.pop(request.request_id, None)
            if old is not None:
                self.free_slots.append(old.slot)
            self._swap[request.request_id] = _SwapEntry(slot, full, tail, self.step)
            self._meta.swap_out.append((block_ids[full], slot))
            self.stats["swap_out_blocks"] += 1

    def _save_full(self, request: "Request", block_ids: list[int], full: int, into: list | None = None) -> None:
        """Offer the request's first ``full`` blocks to the tier; new ``(block, slot)`` copies go to
        ``into`` (default: this step's saves, which run after its forward)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState()
        if full <= st.num_saved:
            return
        keys = self._keys(request, full)
        index, step = self.index, self.step
        saves = self._meta.saves if into is None else into
        for i in range(st.num_saved, full):
            k = keys[i]
            e = index.get(k)
            if e is not None:
                index.move_to_end(k)
                continue
            slot = self._alloc_slot()
            if slot is None:
                break
            index[k] = (slot, step)
            self._owner[slot] = k
            saves.append((block_ids[i], slot))
            self.stats["blocks_stored"] += 1
            if self.disk is not None and k not in self.disk_index:
                self._meta.disk_saves.append((slot, k))
                self.disk_index[k] = None
                self.stats["disk_blocks_stored"] += 1
                if self.disk_budget is not None and len(self.disk_index) > self.disk_budget:
                    old, _ = self.disk_index.popitem(last=False)
                    self.disk.delete(old)
        st.num_saved = full

    def build_connector_meta(self, scheduler_output) -> OffloadingConnectorMetadata:
        reqs, bs = self.requests, self.block_size
        for rid in scheduler_output.num_scheduled_tokens:
            req = reqs.get(rid)
            if req is None:
                continue
            full = min(req.num_computed_tokens, req.num_tokens) // bs
            st = self._reqs.get(rid)
            if full > (st.num_saved if st is not None else 0):
                self._save_full(req, self.kv.get_block_ids(rid)[0], full)
        meta, self._meta = self._meta, OffloadingConnectorMetadata()
        self._pinned.clear()
        self.free_slots.extend(self._release)
        self._release.clear()
        self.step += 1
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]):
        self._reqs.pop(request.request_id, None)
        sw = self._swap.pop(request.request_id, None)
        if sw is not None:
            self._release.append(sw.slot)
        return False, None

    def get_stats(self) -> dict[str, float]:
        s = dict(self.stats)
        s["blocks_used"] = len(self.index) + len(self._swap)
        s["blocks_total"] = self.num_host_blocks
        s["bytes_stored"] = s["blocks_stored"] * self.bytes_per_block
        s["bytes_loaded"] = s["blocks_loaded"] * self.bytes_per_block
        return s

    def check_invariants(self) -> None:
        """Every slot is free, indexed or a swap slot, exactly once (for tests)."""
        used = [s for s, _ in self.index.values()] + [e.slot for e in self._swap.values()]
        allslots = used + self.free_slots + self._release
        assert sorted(allslots) == list(range(self.num_host_blocks)), (len(allslots), self.num_host_blocks)
        assert {s: k for k, (s, _) in self.index.items()} == self._owner

    # ---- worker role ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        meta = self._meta
        self.worker.wait_for_save()
        if meta:
            if meta.disk_loads:
                self.worker.write_slots(meta.disk_loads)
            self.worker.swap_out_and_load(meta.swap_out, meta.loads)

    def start_save_kv(self) -> None:
        meta = self._meta
        if meta is not None and (meta.saves or meta.disk_saves):
            self.worker.save(meta.saves, meta.disk_saves)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
