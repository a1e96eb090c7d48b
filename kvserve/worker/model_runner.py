"""Applies a SchedulerOutput: builds flat varlen inputs, runs the model, samples.

Makes no policy: which requests run and how many tokens each computes was decided by
the scheduler. Owns the model, the per-layer paged KV tensors and the sampler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.attention.backend import get_attn_backend
from kvserve.attention.forward_context import AttentionMetadata, forward_context
from kvserve.config import EngineConfig
from kvserve.core.scheduler import SchedulerOutput
from kvserve.layers.attention import set_attn_backend
from kvserve.model_loader import get_model
from kvserve.sample.sampler import Sampler

logger = logging.getLogger("kvserve")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name to torch; raises ValueError for unknown names."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (request id -> token id) and, where asked, their logprobs."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)


class ModelRunner:
    """Loads the model on ``config.device`` and executes scheduled steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model_config
        hf = mc.hf_config
        self.dtype = torch_dtype(mc.dtype)
        self.kv_dtype = torch_dtype(config.cache_config.kv_cache_dtype)
        self.block_size = config.cache_config.block_size
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.backend = get_attn_backend(config.attention_backend)
        set_attn_backend(self.backend)
        torch.manual_seed(mc.seed)
        self.model = get_model(mc, config.device)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner = None  # set by maybe_capture_cuda_graphs

    # ---- KV cache ---------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget (``--kv-cache-memory`` or GPU profiling)."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        block_bytes = self.bytes_per_token * self.block_size
        if cc.kv_cache_memory is not None:
            kv_bytes = cc.kv_cache_memory
        elif self.device.type == "cuda":
            kv_bytes = self._profile_gpu_kv_bytes()
        else:
            kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        return max(int(kv_bytes // block_bytes), 0)

    @torch.inference_mode()
    def _profile_gpu_kv_bytes(self) -> int:
        """Run the largest step once with a throwaway cache to measure peak activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        sc = self.config.scheduler_config
        t = min(sc.max_num_batched_tokens, sc.max_model_len * sc.max_num_seqs)
        nb = -(-t // self.block_size) + 1
        scratch = [torch.zeros(self.backend.kv_cache_shape(nb, self.block_size, self.num_kv_heads, self.head_dim),
                               dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]
        base = torch.cuda.memory_allocated()
        # One request per max_model_len tokens.
        lens = [min(sc.max_model_len, t - s) for s in range(0, t, sc.max_model_len)]
        meta, ids, pos = self._dummy_batch(lens)
        with forward_context(meta, scratch):
            hidden = self.model(ids, pos)
        n_logits = min(sc.max_num_seqs, t)
        self.model.compute_logits(hidden[:n_logits]).softmax(-1)
        torch.cuda.synchronize()
        peak_act = torch.cuda.max_memory_allocated() - base
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = total * self.config.cache_config.gpu_memory_utilization
        used_now = total - free
        kv_bytes = int(budget - used_now - peak_act)
        logger.info(
            "memory: total %.2f GiB x %.2f = %.2f GiB budget; in use %.2f GiB (weights, context); "
            "peak activations %.2f GiB; KV cache %.2f GiB",
            total / 2**30, self.config.cache_config.gpu_memory_utilization, budget / 2**30,
            used_now / 2**30, peak_act / 2**30, kv_bytes / 2**30,
        )
        return max(kv_bytes, 0)

    def _dummy_batch(self, lens: list[int]):
        bs = self.block_size
        blocks_per = [-(-n // bs) for n in lens]
        bt = np.zeros((len(lens), max(blocks_per)), dtype=np.int32)
        nxt = 1
        for i, nb in enumerate(blocks_per):
            bt[i, :nb] = np.arange(nxt, nxt + nb)
            nxt += nb
        t = sum(lens)
        ids = torch.randint(0, 100, (t,), device=self.device)
        meta, pos = self._build_metadata(bt, [0] * len(lens), lens)
        return meta, ids, pos

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate per-layer KV tensors once; zeroed so masked slots never hold NaN."""
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]

    # ---- prefix cache copy-on-write (before the forward) --------------------------------
    @torch.inference_mode()
    def copy_kv_slots(self, copies: list[tuple[int, int, int]]) -> None:
        """For each ``(src_block, dst_block, n)``, copy slots ``[0, n)`` of ``src_block`` into
        the same slots of ``dst_block``, K and V, on every layer (one index copy per layer)."""
        if not copies:
            return
        bs = self.block_size
        src = [s * bs + j for s, _, n in copies for j in range(n)]
        dst = [d * bs + j for _, d, n in copies for j in range(n)]
        src_t = torch.tensor(src, dtype=torch.long).to(self.device, non_blocking=True)
        dst_t = torch.tensor(dst, dtype=torch.long).to(self.device, non_blocking=True)
        for cache in self.kv_caches:  # (2, num_blocks, block_size, kv_heads, head_dim)
            if cache.element_size() == 1:  # fp8: copy the bytes
                cache = cache.view(torch.uint8)
            flat = cache.flatten(1, 2)
            flat.index_copy_(1, dst_t, flat.index_select(1, src_t))

    # ---- one step ----------------------------------------------------------------------
    def _flat_arrays(self, block_table: np.ndarray, ctx_lens: list[int], query_lens: list[int]):
        """Host arrays of a flat varlen batch: query lens, prefix sums, positions, slots, seq lens."""
        q = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(ctx_lens, dtype=np.int64)
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        req_idx = np.repeat(np.arange(len(q)), q)
        positions = np.arange(int(qsl[-1])) - qsl[:-1][req_idx] + ctx[req_idx]
        slots = block_table[req_idx, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        return q, qsl, positions, slots, ctx + q

    def _build_metadata(self, block_table: np.ndarray, ctx_lens: list[int], query_lens: list[int]):
        q, qsl, positions, slots, seq_lens = self._flat_arrays(block_table, ctx_lens, query_lens)
        num_decodes = 0
        while num_decodes < len(q) and q[num_decodes] == 1:
            num_decodes += 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(block_table).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            query_lens_cpu=q.tolist(), seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(q.max()), max_seq_len=int(seq_lens.max()), num_decodes=num_decodes,
        )
        return meta, torch.from_numpy(positions).to(dev, non_blocking=True)

    def maybe_capture_cuda_graphs(self) -> None:
        """Capture decode graphs on CUDA unless ``--enforce-eager`` or the backend can't be captured."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.cuda_graph_safe:
            return
        from kvserve.worker.cuda_graphs import CUDAGraphRunner

        sc = self.config.scheduler_config
        self.graph_runner = CUDAGraphRunner(
            self.model, self.kv_caches, sc.max_num_seqs, -(-sc.max_model_len // self.block_size),
            sc.max_model_len, self.block_size,
        )
        self.graph_runner.capture()

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens and sample where a request reached its last token."""
        if sched.is_empty:
            return ModelRunnerOutput()
        self.copy_kv_slots(sched.kv_copies)
        # Decodes (1 token) first so the backend can batch them.
        items = sorted(sched.scheduled, key=lambda x: x[1] != 1)
        reqs = [r for r, _ in items]
        query_lens = [n for _, n in items]
        ctx_lens = [r.num_computed_tokens for r in reqs]
        block_ids = [sched.block_ids[r.request_id] for r in reqs]
        bt = np.zeros((len(reqs), max(len(b) for b in block_ids)), dtype=np.int32)
        for i, b in enumerate(block_ids):
            bt[i, : len(b)] = b
        token_ids: list[int] = []
        for r, c, n in zip(reqs, ctx_lens, query_lens):
            token_ids.extend(r.all_token_ids[c : c + n])
        gr = self.graph_runner
        if gr is not None and query_lens[-1] == 1 and gr.can_run(len(reqs)):
            _, _, positions, slots, seq_lens = self._flat_arrays(bt, ctx_lens, query_lens)
            hidden = gr.run(np.asarray(token_ids, dtype=np.int64), positions, slots, bt, seq_lens.astype(np.int32))
        else:
            meta, positions = self._build_metadata(bt, ctx_lens, query_lens)
            input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
            with forward_context(meta, self.kv_caches):
                hidden = self.model(input_ids, positions)
        ends = np.cumsum(query_lens) - 1
        rows = [i for i, (r, c, n) in enumerate(zip(reqs, ctx_lens, query_lens)) if c + n == r.num_tokens]
        out = ModelRunnerOutput()
        if not rows:
            return out
        idx = torch.as_tensor(ends[rows], device=self.device)
        logits = self.model.compute_logits(hidden[idx])
        sample_reqs = [reqs[i] for i in rows]
        s = self.sampler(logits, sample_reqs)
        for r, tok, lp in zip(sample_reqs, s.sampled_token_ids, s.logprobs):
            out.sampled[r.request_id] = tok
            if lp is not None:
                out.logprobs[r.request_id] = lp
        return out
