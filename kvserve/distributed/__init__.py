"""Tensor-parallel process group and its collectives (``torch.distributed``)."""

from kvserve.distributed.parallel_state import (
    destroy_distributed,
    get_custom_all_reduce,
    get_ep_size,
    get_pp_rank,
    get_pp_size,
    get_tp_rank,
    get_tp_size,
    init_distributed,
    kv_head_range,
    pp_recv,
    pp_send,
    set_expert_parallel,
    tp_all_gather,
    tp_all_reduce,
    tp_all_reduce_add_rms_norm,
)

__all__ = ["destroy_distributed", "get_ep_size", "set_expert_parallel", "get_tp_rank", "get_tp_size", "init_distributed", "kv_head_range",
           "tp_all_gather", "tp_all_reduce", "get_pp_rank", "get_pp_size", "pp_recv", "pp_send"]
__all__ += ["get_custom_all_reduce", "tp_all_reduce_add_rms_norm"]
