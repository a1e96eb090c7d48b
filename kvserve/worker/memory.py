"""How many bytes the KV cache gets: ``--kv-cache-memory``, the CPU default, or a GPU profile.

On a GPU the largest step runs once over a throwaway cache to measure the activation
peak (with the logits of every row the sampler may see: ``profile_logit_rows``); the budget
is ``total x gpu_memory_utilization`` minus what is in use (weights), that
peak, what CUDA graphs will keep (an estimate measured on H100 shapes) and a fixed headroom for
what loads later outside PyTorch's allocator (``RUNTIME_HEADROOM_BYTES``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvserve.attention.forward_context import forward_context
from kvserve.attention.kv_format import KVCacheView, format_of_spec
from kvserve.core.kv_cache_spec import KVCacheSpec
from kvserve.layers.attention import attention_layers

logger = logging.getLogger("kvserve")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
#: Device memory taken after start-up outside PyTorch's allocator: kernel modules loaded on first
#: use (Triton's per-shape MoE / GEMM configs), cuBLAS workspaces of new streams. On an H200 the
#: Qwen3-30B-A3B shape's peak ended 0.31 GiB past a 0.85 budget without it
#: (benchmarks/gpu_memory_stress.py, docs/reliability.md).
RUNTIME_HEADROOM_BYTES = 512 << 20


def available_kv_bytes(runner) -> int:
    """KV cache bytes for ``runner`` (a ``ModelRunner`` with its model loaded)."""
    cc = runner.config.cache_config
    if cc.kv_cache_memory is not None:
        return cc.kv_cache_memory
    if runner.device.type == "cuda":
        return _profile_gpu_kv_bytes(runner)
    return DEFAULT_CPU_KV_CACHE_BYTES


@torch.inference_mode()
def _profile_gpu_kv_bytes(runner) -> int:
    """Run the largest step once with a throwaway cache to measure peak activations."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = runner.config
    sc = cfg.scheduler_config
    bs = runner.block_size
    t = min(sc.max_num_batched_tokens, sc.max_model_len * sc.max_num_seqs)
    nb = -(-t // bs) + 1
    specs: dict[int, KVCacheSpec] = runner.get_kv_cache_spec()
    layers = attention_layers(runner.model)
    saved = [(layer.kv, layer.kv_cache_group_id) for layer in layers]
    for layer in layers:
        spec = specs[layer.layer_idx]
        # int4/int2: the view's rotation, whose float32 temporaries count among the activations.
        layer.kv = KVCacheView.bind(runner.backend.allocate_kv_cache(spec, nb, runner.device), format_of_spec(spec))
        layer.kv_cache_group_id = 0
    base = torch.cuda.memory_allocated()
    try:
        # One request per max_model_len tokens, over consecutive blocks.
        lens = [min(sc.max_model_len, t - s) for s in range(0, t, sc.max_model_len)]
        blocks_per = [-(-n // bs) for n in lens]
        bt = np.zeros((len(lens), max(blocks_per)), dtype=np.int32)
        nxt = 1
        for i, n in enumerate(blocks_per):
            bt[i, :n] = np.arange(nxt, nxt + n)
            nxt += n
        meta, pos = runner.backend.metadata_builder_cls.dummy(bt, lens, bs, runner.device)
        ids = torch.randint(0, 100, (sum(lens),), device=runner.device)
        with forward_context(meta):
            hidden = runner.model(ids, pos)
        n_logits = min(profile_logit_rows(cfg), t)
        if not isinstance(hidden, tuple):  # a pipeline stage before the last has no LM head
            runner.model.compute_logits(hidden[:n_logits]).softmax(-1)
        torch.cuda.synchronize()
        peak_act = torch.cuda.max_memory_allocated() - base
        del hidden
    finally:
        for layer, (kv, gid) in zip(layers, saved):
            layer.kv, layer.kv_cache_group_id = kv, gid
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    budget = total * cfg.cache_config.gpu_memory_utilization
    used_now = total - free
    graph_bytes = estimate_graph_bytes(runner, peak_act)
    res_bytes = residual_bytes(runner)
    kv_bytes = int(budget - used_now - peak_act - graph_bytes - res_bytes - RUNTIME_HEADROOM_BYTES)
    logger.info(
        "memory: total %.2f GiB x %.2f = %.2f GiB budget; in use %.2f GiB (weights, context); "
        "peak activations %.2f GiB; CUDA graphs (estimate) %.2f GiB; exact filling blocks %.2f GiB; "
        "runtime headroom %.2f GiB; KV cache %.2f GiB",
        total / 2**30, cfg.cache_config.gpu_memory_utilization, budget / 2**30,
        used_now / 2**30, peak_act / 2**30, graph_bytes / 2**30, res_bytes / 2**30, RUNTIME_HEADROOM_BYTES / 2**30,
        kv_bytes / 2**30,
    )
    return max(kv_bytes, 0)


def profile_logit_rows(config) -> int:
    """Rows of logits the largest step computes: one per running request, and with speculative
    decoding one per verified position (1 + k per request). The profile computes (and softmaxes)
    that many, so the sampler's float32 ``[rows, vocab]`` temporaries count in the activation peak."""
    sc, spec = config.scheduler_config, config.speculative_config
    k = spec.max_draft_tokens if spec is not None else 0
    return sc.max_num_seqs * (1 + k)


def residual_bytes(runner) -> int:
    """Bytes of the layers' exact filling blocks (``kvserve/attention/kv_residual.py``): one
    residual slot per ``--max-num-seqs`` request for formats with ``KVFormat.residual``."""
    from kvserve.attention.kv_residual import residual_bytes_per_layer
    from kvserve.core.kv_cache_spec import BoundedKVSpec

    n = runner.config.scheduler_config.max_num_seqs
    item = torch.empty((), dtype=runner.dtype).element_size()
    return sum(residual_bytes_per_layer(n, s.block_size, s.num_kv_heads, s.head_size, item)
               for s in runner.get_kv_cache_spec().values()
               if s.format.residual and not isinstance(s, BoundedKVSpec))


def estimate_graph_bytes(runner, peak_act: int) -> int:
    """Memory CUDA graphs keep beyond the profiled activation peak (0 if none are captured).

    The piecewise graphs' pool holds the activations of the largest token count (measured
    at about 3x ``peak_act``, the eager peak, which is reserved apart); on top come their
    static q/k/v/o/hidden buffers, and the decode graphs' own pool and outputs.
    """
    cfg = runner.config
    if cfg.enforce_eager or not runner.backend.cuda_graph_safe:
        return 0
    hf = cfg.model_config.hf_config
    sc = cfg.scheduler_config
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    layer = attention_layers(runner.model)[0]
    q = layer.num_heads * layer.head_size
    kv = layer.num_kv_heads * layer.head_size
    static = sc.max_num_batched_tokens * (2 * q + 2 * kv + hf.hidden_size) * itemsize
    per_row = 4 * hf.hidden_size + 2 * q + 2 * kv + 3 * hf.intermediate_size
    rows = sc.max_num_seqs * runner.max_query_len_decode
    decode = rows * per_row * itemsize * 2  # pool peak + outputs of every size
    p = runner.proposer
    if p is not None and p.uses_hidden_states:
        # EAGLE / MTP: the target's mid-layer states in static buffers (EAGLE-3), the draft
        # graphs' one layer over the same rows and their float32 draft logits.
        aux = 3 * hf.hidden_size * (sc.max_num_batched_tokens + rows) * itemsize
        decode += aux + rows * per_row * itemsize + 2 * sc.max_num_seqs * hf.vocab_size * 4
    # Measured on an H100 (Qwen3-0.6B and Llama-3.1-8B shapes, 8192 tokens): the piecewise
    # pool ends near 3x the eager activation peak, i.e. 2x beyond what is already reserved.
    return static + decode + 2 * peak_act + (64 << 20)  # plus graph objects, workspaces
