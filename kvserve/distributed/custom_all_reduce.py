"""A custom all-reduce for small and medium messages over NVLink peer-to-peer, and its fusion
with the residual add and RMSNorm that follow a row-parallel projection.

At batch 1 a tensor-parallel decode step runs two all-reduces of a few KB per layer; NCCL's
ring costs several µs each. Here each rank sees its peers' buffers directly (symmetric memory
from ``torch.distributed._symmetric_memory``, without multicast) and one Triton kernel does
the exchange (``kvserve.distributed.all_reduce_kernels``):

- **one-shot** (small messages): each rank reads every peer's input and sums;
- **two-shot** (medium): reduce-scatter then all-gather, each rank reading ``1/W`` per peer;
- above ``max_size`` bytes, or whenever this path is unavailable, ``dist.all_reduce`` (NCCL).

Unavailable (``unavailable_reason`` says why, logged once): not CUDA, world size not in
{2, 4, 8}, no peer access between the GPUs, symmetric memory failing to initialize, or
turned off (``--disable-custom-all-reduce`` / ``KVSERVE_ALL_REDUCE=nccl``).

Buffers and flags are allocated once at start-up and every launch takes its barrier flag from
a counter on the device, so the kernels are captured in CUDA graphs by address and replay
correctly; no call synchronizes with the host or allocates (outputs of the fused op aside,
which come from the graph's pool like every other activation).

Environment: ``KVSERVE_ALL_REDUCE`` (``custom`` default, ``nccl`` turns it off),
``KVSERVE_CUSTOM_AR_MAX_BYTES`` (cut-over to NCCL, default 1 MiB),
``KVSERVE_CUSTOM_AR_ONE_SHOT_BYTES`` (cut-over from one-shot to two-shot; default by world
size). NVLink multicast stays off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set before any
symmetric allocation and no multimem instruction is used.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("kvserve")

SUPPORTED_WORLD_SIZES = (2, 4, 8)
DEFAULT_MAX_BYTES = 1 << 20
#: One-shot reads (W-1) whole messages from peers, two-shot 2(W-1)/W of one; one-shot wins
#: on latency below these sizes (bytes).
DEFAULT_ONE_SHOT_BYTES = {2: 512 << 10, 4: 256 << 10, 8: 128 << 10}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def choose_algorithm(nbytes: int, world_size: int, max_bytes: int, one_shot_bytes: int) -> Optional[str]:
    """``"one_shot"``, ``"two_shot"`` or None (use NCCL) for a message of ``nbytes`` bytes."""
    if world_size not in SUPPORTED_WORLD_SIZES or nbytes <= 0 or nbytes > max_bytes:
        return None
    return "one_shot" if nbytes <= one_shot_bytes else "two_shot"


def unavailable_reason(device: torch.device, world_size: int, enabled: bool = True,
                       peer_access=None) -> Optional[str]:
    """Why the custom all-reduce cannot run here, or None when it can (symmetric memory aside).

    ``peer_access(i, j) -> bool`` defaults to ``torch.cuda.can_device_access_peer``; the
    ranks' GPUs are assumed to be devices ``0 .. world_size-1`` of this node (as the executors
    place them).
    """
    if not enabled:
        return "turned off (--disable-custom-all-reduce or KVSERVE_ALL_REDUCE=nccl)"
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    if world_size not in SUPPORTED_WORLD_SIZES:
        return f"world size {world_size} is not one of {SUPPORTED_WORLD_SIZES}"
    if peer_access is None:
        peer_access = torch.cuda.can_device_access_peer
    n = torch.cuda.device_count() if peer_access is torch.cuda.can_device_access_peer else world_size
    if n < world_size:
        return f"{n} visible GPUs for {world_size} ranks (ranks on several nodes)"
    for i in range(world_size):
        for j in range(world_size):
            if i != j and not peer_access(i, j):
                return f"no peer-to-peer access from GPU {i} to GPU {j}"
    return None


def enabled_by_env() -> bool:
    """False when ``KVSERVE_ALL_REDUCE=nccl``; raises ValueError on another unknown value."""
    v = os.environ.get("KVSERVE_ALL_REDUCE", "custom").strip().lower()
    if v not in ("custom", "nccl"):
        raise ValueError(f"KVSERVE_ALL_REDUCE={v!r}: expected 'custom' or 'nccl'")
    return v == "custom"


class CustomAllReduce:
    """The custom all-reduce of one rank. Construct on every rank of ``group`` at once (it is a
    collective: symmetric allocation and rendezvous); raises RuntimeError when symmetric memory
    cannot be set up (the caller falls back to NCCL).

    Args:
        group: the tensor-parallel process group (NCCL).
        device: this rank's CUDA device.
        max_bytes: largest message handled (bytes); larger ones go to ``dist.all_reduce``.
        one_shot_bytes: largest message reduced one-shot; up to ``max_bytes`` two-shot.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                 one_shot_bytes: Optional[int] = None) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        from kvserve.distributed import all_reduce_kernels as K

        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = int(max_bytes)
        self.one_shot_bytes = int(DEFAULT_ONE_SHOT_BYTES[self.world_size] if one_shot_bytes is None
                                  else one_shot_bytes)
        self._k = K
        # 16-byte aligned regions; REGION is counted in elements of the call's dtype.
        self._region_bytes = (self.max_bytes + 15) // 16 * 16
        set_backend = getattr(symm_mem, "set_backend", None)
        if set_backend is not None:  # CUDA IPC-style peer mappings, not NVSHMEM (its heap, its NVLS)
            try:
                set_backend("CUDA")
            except Exception as e:  # noqa: BLE001 - already chosen by an earlier allocation
                logger.debug("symmetric memory backend not set: %s", e)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before torch 2.8-ish, deprecated (a no-op) after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(group.group_name)
        self._data = symm_mem.empty(3 * self._region_bytes, dtype=torch.uint8, device=device)
        self._flags = symm_mem.empty(K.MAX_BLOCKS * self.world_size, dtype=torch.int32, device=device)
        self._flags.zero_()
        data_h = symm_mem.rendezvous(self._data, group)
        flag_h = symm_mem.rendezvous(self._flags, group)
        self.data_ptrs = torch.tensor(list(data_h.buffer_ptrs), dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(list(flag_h.buffer_ptrs), dtype=torch.int64, device=device)
        self._handles = (data_h, flag_h)  # keep the mappings alive
        self.grid = K.GRID  # every launch, whatever its size: the block counters stay in step
        self.counters = torch.zeros(K.MAX_BLOCKS, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before anyone signals

    # -- choice -----------------------------------------------------------------------------

    def algorithm(self, x: torch.Tensor) -> Optional[str]:
        """The algorithm for ``x``, or None when it must go to NCCL (too large, odd dtype,
        not contiguous)."""
        if x.dtype not in _DTYPES or not x.is_contiguous() or x.device != self.device:
            return None
        return choose_algorithm(x.numel() * x.element_size(), self.world_size, self.max_bytes,
                                self.one_shot_bytes)

    def fusable(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``all_reduce_add_rms_norm`` runs as one one-shot kernel for these tensors."""
        return (x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
                and residual.is_contiguous() and weight.dtype == x.dtype and weight.is_contiguous()
                and self.algorithm(x) == "one_shot")

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, algorithm: Optional[str] = None) -> torch.Tensor:
        """Sum ``x`` (contiguous, bf16/fp16/fp32, at most ``max_bytes``) over the ranks, in
        place; returns ``x``. ``algorithm`` forces ``one_shot`` / ``two_shot`` (benchmarks)."""
        K = self._k
        algo = algorithm or self.algorithm(x)
        n = x.numel()
        if algo is None or n == 0:
            dist.all_reduce(x, group=self.group)
            return x
        if n * x.element_size() > self._region_bytes or not x.is_contiguous():
            raise ValueError(f"custom all-reduce: x must be contiguous and at most {self._region_bytes} bytes, "
                             f"got {tuple(x.shape)} {x.dtype}")
        dt = _tl_dtype(x.dtype)
        region = self._region_bytes // x.element_size()
        num_warps = 4 if n * x.element_size() <= (64 << 10) else 8
        if algo == "one_shot":
            block = max(256, min(1024, _next_pow2(-(-n // self.grid))))
            K._one_shot_kernel[(self.grid,)](
                x, x, self.data_ptrs, self.flag_ptrs, self.counters, self.err, n, self.rank,
                REGION=region, W=self.world_size, BLOCK=block, DT=dt, MAX_SPIN_=K.MAX_SPIN, num_warps=num_warps)
        elif algo == "two_shot":
            chunk = -(-n // (16 * self.world_size)) * 16  # 16-element chunks keep loads 16-byte aligned
            block = max(256, min(1024, _next_pow2(-(-chunk // self.grid))))
            K._two_shot_kernel[(self.grid,)](
                x, x, self.data_ptrs, self.flag_ptrs, self.counters, self.err, n, chunk, self.rank,
                REGION=region, W=self.world_size, BLOCK=block, DT=dt, MAX_SPIN_=K.MAX_SPIN, num_warps=num_warps)
        else:
            raise ValueError(f"unknown all-reduce algorithm {algo!r}; expected one_shot or two_shot")
        return x

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel for ``s = sum_ranks(x) + residual; (rms_norm(s) * weight, s)``.

        x, residual: ``[T, D]`` contiguous, same dtype (bf16/fp16/fp32); weight ``[D]``. Returns
        new tensors ``(normed, s)``; call only when ``fusable`` says so."""
        K = self._k
        rows, d = x.shape
        out = torch.empty_like(x)
        res_out = torch.empty_like(x)
        if rows == 0:
            return out, res_out
        block_d = _next_pow2(d)
        K._one_shot_add_rms_norm_kernel[(self.grid,)](
            x, residual, weight, out, res_out, self.data_ptrs, self.flag_ptrs, self.counters, self.err,
            rows, d, eps, self.rank, REGION=self._region_bytes // x.element_size(), W=self.world_size,
            BLOCK_D=block_d, DT=_tl_dtype(x.dtype), MAX_SPIN_=K.MAX_SPIN, num_warps=max(1, min(16, block_d // 256)))
        return out, res_out

    def check(self) -> None:
        """Raise RuntimeError when a barrier timed out since start-up (a peer stopped
        answering). Synchronizes with the device: for tests and benchmarks, not the hot path."""
        if int(self.err.item()):
            raise RuntimeError("custom all-reduce: a peer did not reach a barrier (results are wrong)")

    def close(self) -> None:
        self._handles = ()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def create(group: dist.ProcessGroup, device: torch.device, world_size: int, enabled: bool = True
           ) -> Optional[CustomAllReduce]:
    """A ``CustomAllReduce`` for this rank, or None (the reason logged once on rank 0) when it
    cannot run here. Collective: call on every rank with the same arguments."""
    reason = unavailable_reason(device, world_size, enabled)
    if reason is None:
        car = None
        try:
            max_bytes = int(os.environ.get("KVSERVE_CUSTOM_AR_MAX_BYTES", DEFAULT_MAX_BYTES))
            one_shot = os.environ.get("KVSERVE_CUSTOM_AR_ONE_SHOT_BYTES")
            car = CustomAllReduce(group, device, max_bytes, int(one_shot) if one_shot else None)
        except Exception as e:  # noqa: BLE001 - any failure means: use NCCL
            reason = f"symmetric memory failed to initialize ({type(e).__name__}: {e})"
        # All ranks must take the same path, or a kernel waits for a rank that is in NCCL.
        ok = torch.tensor([0 if car is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if int(ok.item()) == 1:
            return car
        reason = reason or "symmetric memory failed to initialize on another rank"
    if dist.is_initialized() and dist.get_rank() == 0 and device.type == "cuda":
        logger.info("custom all-reduce off, using dist.all_reduce: %s", reason)
    return None
