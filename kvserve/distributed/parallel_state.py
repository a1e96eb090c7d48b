"""The tensor-parallel group of this process: rank, size and the two collectives the model uses.

One group per process (every rank of a model runs in its own process, as in vLLM and
Megatron-LM, arXiv:1909.08053). Without ``init_distributed`` the size is 1 and the
collectives are identities, so single-process engines never touch ``torch.distributed``.
Backends: NCCL on CUDA, gloo on the CPU. Under pipeline parallelism the world is stages of
tensor-parallel groups, and neighbouring stages exchange hidden states with ``pp_send`` / ``pp_recv``.
On CUDA, small and medium all-reduces go through the custom peer-to-peer all-reduce
(``kvserve.distributed.custom_all_reduce``) when it can run.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

_RANK = 0
_SIZE = 1
_EXPERT_PARALLEL = False
# Pipeline parallelism: this process's stage, the stage count, and its tensor-parallel group
# (None: the whole world, i.e. one stage).
_PP_RANK = 0
_PP_SIZE = 1
_TP_GROUP = None
_CUSTOM_AR: Optional[Any] = None  # a custom_all_reduce.CustomAllReduce on CUDA when it can run


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     pipeline_parallel_size: int = 1, custom_all_reduce: Optional[bool] = None) -> None:
    """Join the tensor-parallel group (``init_method`` e.g. ``tcp://127.0.0.1:29500``).

    With ``pipeline_parallel_size`` P > 1 the world of ``world_size`` ranks is P stages of
    ``world_size / P`` tensor-parallel ranks, ordered tensor-parallel first (vLLM's layout:
    global rank = stage * tp_size + tp_rank); each stage gets its own tensor-parallel group.

    With the NCCL backend and one stage, also sets up the custom all-reduce unless
    ``custom_all_reduce`` is False (``--disable-custom-all-reduce``) or ``KVSERVE_ALL_REDUCE=nccl``;
    when it cannot run (no P2P, world size, symmetric memory, several stages) the reason is
    logged once and NCCL is used. Call after ``torch.cuda.set_device``.

    Raises RuntimeError when the rendezvous fails (``torch.distributed`` times out), ValueError
    when P does not divide ``world_size``.
    """
    global _RANK, _SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _CUSTOM_AR
    if world_size % pipeline_parallel_size:
        raise ValueError(f"pipeline_parallel_size {pipeline_parallel_size} must divide world size {world_size}")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    tp = world_size // pipeline_parallel_size
    _RANK, _SIZE = rank % tp, tp
    _PP_RANK, _PP_SIZE, _TP_GROUP = rank // tp, pipeline_parallel_size, None
    if pipeline_parallel_size > 1 and tp > 1:
        for stage in range(pipeline_parallel_size):  # every rank creates every group, in order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == _PP_RANK:
                _TP_GROUP = group
    if tp > 1 and backend == "nccl" and _CUSTOM_AR is None:
        from kvserve.distributed import custom_all_reduce as car

        # Several stages: NCCL inside each stage (the custom buffers are set up on the whole world).
        enabled = custom_all_reduce is not False and car.enabled_by_env() and pipeline_parallel_size == 1
        _CUSTOM_AR = car.create(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()),
                                world_size, enabled)


def destroy_distributed() -> None:
    """Leave the group (idempotent)."""
    global _RANK, _SIZE, _EXPERT_PARALLEL, _PP_RANK, _PP_SIZE, _TP_GROUP, _CUSTOM_AR
    _EXPERT_PARALLEL = False
    if _CUSTOM_AR is not None:
        _CUSTOM_AR.close()
        _CUSTOM_AR = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE = 0, 1
    _PP_RANK, _PP_SIZE, _TP_GROUP = 0, 1, None


def set_expert_parallel(enabled: bool) -> None:
    """Split MoE experts across the ranks of the group (``--enable-expert-parallel``) instead of
    splitting each expert's intermediate dimension. Set before the model is built."""
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = bool(enabled)


def get_ep_size() -> int:
    """Ranks the experts are split across: the group size under expert parallelism, else 1."""
    return _SIZE if _EXPERT_PARALLEL else 1


def get_tp_rank() -> int:
    return _RANK


def get_tp_size() -> int:
    return _SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``."""
    if _SIZE > 1:
        car = _CUSTOM_AR
        algo = car.algorithm(x) if car is not None else None
        if algo is not None:
            return car.all_reduce(x, algo)
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def get_custom_all_reduce() -> Optional[Any]:
    """This rank's ``CustomAllReduce``, or None when all-reduces go to ``dist.all_reduce``."""
    return _CUSTOM_AR


def tp_all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: Any
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = sum_ranks(x) + residual``, returns ``(norm(s), s)``: a row-parallel layer's
    partial output reduced, added to the residual stream and normalized.

    x, residual: ``[T, D]`` in the model dtype; ``norm`` an ``RMSNorm`` (its ``weight`` and
    ``variance_epsilon``). One kernel when the custom all-reduce takes this message one-shot;
    otherwise ``norm(tp_all_reduce(x), residual)`` (NCCL/gloo, then the fused add + RMSNorm).
    ``x`` may be overwritten.
    """
    car = _CUSTOM_AR
    if _SIZE > 1 and car is not None and car.fusable(x, residual, norm.weight):
        return car.all_reduce_add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    return norm(tp_all_reduce(x), residual)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all) along ``dim``, in rank order."""
    if _SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def get_pp_rank() -> int:
    """This process's pipeline stage (0 without pipeline parallelism)."""
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send ``tensors`` to the same tensor-parallel rank of the next stage (blocking until
    handed to the backend; the receiver knows their shapes and dtypes)."""
    dst = (_PP_RANK + 1) * _SIZE + _RANK
    for t in tensors:
        dist.send(t.contiguous(), dst)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Receive one tensor per shape from the same tensor-parallel rank of the previous stage."""
    src = (_PP_RANK - 1) * _SIZE + _RANK
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t)
    return out


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads rank ``rank`` holds: a contiguous ``num_kv_heads /
    tp_size`` of them, or one head replicated on ``tp_size / num_kv_heads`` ranks when there
    are fewer KV heads than ranks. Raises ValueError when neither divides the other."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} must divide the {num_kv_heads} KV heads "
                             f"(or be a multiple of them)")
        n = num_kv_heads // tp_size
        return rank * n, n
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} must be a multiple of the {num_kv_heads} KV heads "
                         f"(or divide them)")
    return rank // (tp_size // num_kv_heads), 1
