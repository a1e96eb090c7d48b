"""Applies a SchedulerOutput: builds flat varlen inputs, runs the model, samples.

Makes no policy: which requests run and how many tokens each computes was decided by
the scheduler. Owns the model, the per-layer paged KV tensors and the sampler.
"""

from __future__ import annotations

import itertools
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
from kvserve.worker.cuda_graphs import to_device

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
        self.graph_runner = None  # set by maybe_capture_cuda_graphs: decode-only steps
        self.piecewise_runner = None  # ... and steps with prefill tokens
        # The last step's sampled ids on the device, and request id -> row (async scheduling).
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

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
        graph_bytes = self._estimate_graph_bytes(peak_act)
        kv_bytes = int(budget - used_now - peak_act - graph_bytes)
        logger.info(
            "memory: total %.2f GiB x %.2f = %.2f GiB budget; in use %.2f GiB (weights, context); "
            "peak activations %.2f GiB; CUDA graphs (estimate) %.2f GiB; KV cache %.2f GiB",
            total / 2**30, self.config.cache_config.gpu_memory_utilization, budget / 2**30,
            used_now / 2**30, peak_act / 2**30, graph_bytes / 2**30, kv_bytes / 2**30,
        )
        return max(kv_bytes, 0)

    def _estimate_graph_bytes(self, peak_act: int) -> int:
        """Memory CUDA graphs keep beyond the profiled activation peak (0 if none are captured).

        The piecewise graphs' pool holds the activations of the largest token count (measured
        at about 3x ``peak_act``, the eager peak, which is reserved apart); on top come their
        static q/k/v/o/hidden buffers, and the decode graphs' own pool and outputs.
        """
        if self.config.enforce_eager or not self.backend.cuda_graph_safe:
            return 0
        hf = self.config.model_config.hf_config
        sc = self.config.scheduler_config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        q = hf.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        static = sc.max_num_batched_tokens * (2 * q + 2 * kv + hf.hidden_size) * itemsize
        per_row = 4 * hf.hidden_size + 2 * q + 2 * kv + 3 * hf.intermediate_size
        decode = sc.max_num_seqs * per_row * itemsize * 2  # pool peak + outputs of every size
        # Measured on an H100 (Qwen3-0.6B and Llama-3.1-8B shapes, 8192 tokens): the piecewise
        # pool ends near 3x the eager activation peak, i.e. 2x beyond what is already reserved.
        return static + decode + 2 * peak_act + (64 << 20)  # plus graph objects, workspaces

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
        if self.device.type == "cuda" and hasattr(self.backend, "warmup"):
            from kvserve.layers.attention import Attention

            windows = {m.sliding_window for m in self.model.modules() if isinstance(m, Attention)}
            self.backend.warmup(self.kv_caches[0], self.config.model_config.hf_config.num_attention_heads,
                                self.dtype, windows)

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
        src_t = to_device(src, self.device, torch.long)
        dst_t = to_device(dst, self.device, torch.long)
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

    def _build_metadata(self, block_table: np.ndarray, ctx_lens: list[int], query_lens: list[int],
                        pad_to: int | None = None):
        q, qsl, positions, slots, seq_lens = self._flat_arrays(block_table, ctx_lens, query_lens)
        if pad_to is not None and pad_to > len(slots):  # padding rows store nothing
            slots = np.concatenate([slots, np.full(pad_to - len(slots), -1, dtype=np.int64)])
        num_decodes = 0
        while num_decodes < len(q) and q[num_decodes] == 1:
            num_decodes += 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, dev), block_tables=to_device(block_table, dev),
            query_start_loc=to_device(qsl.astype(np.int32), dev), seq_lens=to_device(seq_lens.astype(np.int32), dev),
            query_lens_cpu=q.tolist(), seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(q.max()), max_seq_len=int(seq_lens.max()), num_decodes=num_decodes,
        )
        return meta, to_device(positions, dev)

    def maybe_capture_cuda_graphs(self) -> None:
        """On CUDA unless ``--enforce-eager`` or the backend can't be captured: whole-model graphs
        for decode-only steps and piecewise graphs, attention eager, for steps with prefill."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.cuda_graph_safe:
            return
        from kvserve.worker.cuda_graphs import CUDAGraphRunner, PiecewiseCUDAGraphRunner

        sc = self.config.scheduler_config
        self.piecewise_runner = PiecewiseCUDAGraphRunner(self.model, self.kv_caches, sc.max_num_batched_tokens)
        self.piecewise_runner.capture()
        self.graph_runner = CUDAGraphRunner(
            self.model, self.kv_caches, sc.max_num_seqs, -(-sc.max_model_len // self.block_size),
            sc.max_model_len, self.block_size,
        )
        self.graph_runner.capture()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens and sample where a request reached its last token."""
        return self.execute_model_async(sched).get()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> "AsyncModelRunnerOutput":
        """Launch a step; the sampled tokens come back through ``.get()``.

        A decode whose input token is still pending (async scheduling: sampled by the
        previous step, not yet seen by the host) reads it from that step's sampled-token
        tensor on the device. Raises RuntimeError if such a token is not from the previous step.
        """
        if sched.is_empty:
            return AsyncModelRunnerOutput([], None, None, None, self.sampler)
        self.copy_kv_slots(sched.kv_copies)
        # Decodes (1 token) first so the backend can batch them.
        items = sorted(zip(sched.scheduled, sched.num_computed, sched.samples), key=lambda x: x[0][1] != 1)
        reqs = [r for (r, _), _, _ in items]
        query_lens = [n for (_, n), _, _ in items]
        ctx_lens = [c for _, c, _ in items]
        block_ids = [sched.block_ids[r.request_id] for r in reqs]
        bt = _block_table(block_ids)
        token_ids: list[int] = []
        pending_dst: list[int] = []
        pending_src: list[int] = []
        for r, c, n in zip(reqs, ctx_lens, query_lens):
            if c + n <= r.num_tokens:
                token_ids.extend(r.all_token_ids[c : c + n])
                continue
            row = self._last_rows.get(r.request_id)
            if n != 1 or c != r.num_tokens or row is None:
                raise RuntimeError(f"{r}: token {c} is neither known nor sampled by the previous step")
            pending_dst.append(len(token_ids))
            pending_src.append(row)
            token_ids.append(0)
        gr, pw = self.graph_runner, self.piecewise_runner
        decode_only = query_lens[-1] == 1
        if gr is not None and decode_only and gr.can_run(len(reqs)):
            _, _, positions, slots, seq_lens = self._flat_arrays(bt, ctx_lens, query_lens)
            pending = (np.asarray(pending_dst), np.asarray(pending_src), self._last_sampled) if pending_dst else None
            hidden = gr.run(np.asarray(token_ids, dtype=np.int64), positions, slots, bt, seq_lens, pending)
            return self._sample(reqs, items, query_lens, hidden)
        input_ids = to_device(token_ids, self.device, torch.long)
        if pending_dst:
            dst = to_device(pending_dst, self.device, torch.long)
            src = to_device(pending_src, self.device, torch.long)
            input_ids.index_copy_(0, dst, self._last_sampled.index_select(0, src))
        tp = pw.padded_size(len(token_ids)) if pw is not None else None
        if tp is not None:
            meta, positions = self._build_metadata(bt, ctx_lens, query_lens, pad_to=tp)
            hidden = pw.run(input_ids, positions, meta)
        else:
            meta, positions = self._build_metadata(bt, ctx_lens, query_lens)
            with forward_context(meta, self.kv_caches):
                hidden = self.model(input_ids, positions)
        return self._sample(reqs, items, query_lens, hidden)

    def _sample(self, reqs, items, query_lens, hidden: torch.Tensor) -> "AsyncModelRunnerOutput":
        rows = [i for i, (_, _, smp) in enumerate(items) if smp]
        if not rows:
            self._last_rows = {}
            return AsyncModelRunnerOutput([], None, None, None, self.sampler)
        if len(rows) == len(reqs) and query_lens[-1] == 1:  # all decodes sample: every row
            logits = self.model.compute_logits(hidden)
        else:
            ends = np.cumsum(query_lens) - 1
            logits = self.model.compute_logits(hidden[to_device(ends[rows], self.device)])
        sample_reqs = [reqs[i] for i in rows]
        sampled, packed, md = self.sampler.launch(logits, sample_reqs)
        self._last_sampled = sampled
        self._last_rows = {r.request_id: i for i, r in enumerate(sample_reqs)}
        event = None
        if packed.is_cuda:  # copy to pinned memory without blocking; .get() waits for it
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host
        return AsyncModelRunnerOutput([r.request_id for r in sample_reqs], packed, md, event, self.sampler)


def _block_table(block_ids: list[list[int]]) -> np.ndarray:
    """Ragged block-id lists -> ``[R, max_len]`` int32, zero-padded (no per-row Python copies)."""
    lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    flat = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int32, count=int(lens.sum()))
    bt = np.zeros((len(block_ids), int(lens.max())), dtype=np.int32)
    bt[np.arange(bt.shape[1]) < lens[:, None]] = flat
    return bt


class AsyncModelRunnerOutput:
    """A launched step's sampled tokens; ``get()`` waits for their copy to the host."""

    def __init__(self, req_ids: list[str], packed, md, event, sampler: Sampler) -> None:
        self.req_ids = req_ids
        self._packed = packed
        self._md = md
        self._event = event
        self._sampler = sampler

    def get(self) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        if not self.req_ids:
            return out
        if self._event is not None:
            self._event.synchronize()
        s = self._sampler.unpack(self._packed.tolist(), self._md)
        for rid, tok, lp in zip(self.req_ids, s.sampled_token_ids, s.logprobs):
            out.sampled[rid] = tok
            if lp is not None:
                out.logprobs[rid] = lp
        return out
