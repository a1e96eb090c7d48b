"""Applies a ``SchedulerOutput``: builds flat varlen inputs, runs the model, samples.

Makes no policy: which requests run and how many tokens each computes was decided by the
scheduler. It holds the model (each attention layer bound to its backend and its own KV
tensor), the persistent input batch (``input_batch.py``), the sampler, the CUDA graph
runners and, with speculative decoding, the proposer. A step's diff is applied to the input
batch, block operations run, the inputs are built with numpy over the batch rows, the
forward runs eagerly or through CUDA graphs, and the sampled tokens travel back in one
non-blocking copy (``runner_output.py``).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from kvserve.attention.forward_context import forward_context
from kvserve.attention.kv_format import format_of_spec
from kvserve.attention.metadata import AttentionMetadataBuilder
from kvserve.attention.registry import get_attn_backend
from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import BoundedKVSpec, FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from kvserve.core.sched_output import BlockOp, SchedulerOutput
from kvserve.layers.attention import attention_layers, bind_attention, bind_kv_cache
from kvserve.model_loader import get_model
from kvserve.sample.sampler import Sampler
from kvserve.spec_decode.rejection_sampler import draft_positions
from kvserve.structured_output.bitmask import apply_grammar_bitmask
from kvserve.worker.cpu_threads import apply_cpu_threads
from kvserve.worker.cuda_graphs import to_device
from kvserve.worker.input_batch import BatchInputs, InputBatch
from kvserve.worker.memory import available_kv_bytes
from kvserve.worker.runner_output import AsyncModelRunnerOutput, copy_to_host

logger = logging.getLogger("kvserve")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name to torch; raises ValueError for unknown names."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


class ModelRunner:
    """Loads the model on ``config.device`` and executes scheduled steps.

    Raises ValueError when the attention backend cannot serve the KV cache format.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model_config
        self.dtype = torch_dtype(mc.dtype)
        self.block_size = config.cache_config.block_size
        self.backend = get_attn_backend(config.attention_backend)
        self.backend.configure(config.attention_config)
        apply_cpu_threads(config.device_config.cpu_threads)
        torch.manual_seed(mc.seed)
        self.model = get_model(mc, config.device)
        from kvserve.models.moe_stats import ExpertLoadReader

        self.expert_load = ExpertLoadReader.for_model(self.model)  # None for a dense model
        bind_attention(self.model, self.backend)
        for spec in set(self.get_kv_cache_spec().values()):
            self.backend.validate_spec(spec)
        self.sampler = Sampler()
        self.proposer = None  # set by the worker with speculative decoding
        spec_cfg = config.speculative_config
        self.max_query_len_decode = 1 + (spec_cfg.num_speculative_tokens if spec_cfg else 0)
        self.tree_drafts = spec_cfg is not None and spec_cfg.speculative_eagle_topk > 1  # kvserve/spec_decode/tree.py
        self.kv_caches: dict[int, torch.Tensor] = {}
        self.kv_cache_config: Optional[KVCacheConfig] = None
        self.input_batch: Optional[InputBatch] = None
        self.graph_runner = None  # set by maybe_capture_cuda_graphs: decode-only steps
        self.piecewise_runner = None  # ... and steps with prefill tokens
        # The last step's sampled ids on the device, and request id -> row (async scheduling).
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self.kv_connector = None  # worker half of a KV connector (tiers), set with the KV cache
        self.attn_builder: Optional[AttentionMetadataBuilder] = None  # the backend's, with the KV cache

    # ---- KV cache ---------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[int, KVCacheSpec]:
        """Per attention layer, the spec of its cache: ``SlidingWindowSpec`` for a layer with
        a window shorter than ``max_model_len`` (its blocks outside the window are freed),
        ``FullAttentionSpec`` otherwise, or for every layer with
        ``--disable-hybrid-kv-cache-manager`` (window layers then mask by position only).

        Raises ValueError for a window below 1.
        """
        cc = self.config.cache_config
        max_len = self.config.scheduler_config.max_model_len
        specs: dict[int, KVCacheSpec] = {}
        for layer in attention_layers(self.model):
            make_spec = getattr(layer, "kv_cache_spec", None)
            if make_spec is not None:  # a layer that names its own cache format (MLA's latent rows)
                specs[layer.layer_idx] = make_spec(self.block_size, self.config)
                continue
            w = layer.sliding_window
            if w is not None and w < 1:
                raise ValueError(f"layer {layer.layer_idx}: sliding_window must be >= 1, got {w}")
            args = (self.block_size, layer.num_kv_heads, layer.head_size, cc.kv_cache_dtype,
                    self.config.model_config.dtype)
            if cc.kv_eviction_policy != "none":
                if w is not None:
                    raise ValueError(f"--kv-eviction-policy {cc.kv_eviction_policy}: layer {layer.layer_idx} "
                                     f"has its own sliding window ({w}); bounded KV serves full-attention layers")
                specs[layer.layer_idx] = BoundedKVSpec(
                    *args, policy=cc.kv_eviction_policy, sink_tokens=cc.attention_sinks,
                    window=cc.max_attention_window, budget_tokens=cc.kv_budget_tokens)
            elif w is not None and w < max_len and not cc.disable_hybrid_kv_cache_manager:
                specs[layer.layer_idx] = SlidingWindowSpec(*args, sliding_window=w)
            else:
                specs[layer.layer_idx] = FullAttentionSpec(*args)
        return specs

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache (``--kv-cache-memory``, the CPU default, or a GPU profile)."""
        return available_kv_bytes(self)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate each layer's cache (its group's block count), bind it, build the input
        batch, compile kernels and capture CUDA graphs."""
        self.kv_cache_config = kv_cache_config
        specs = self.get_kv_cache_spec()
        for g in kv_cache_config.groups:
            for layer in g.layer_indices:
                if layer not in specs:  # a layer of another pipeline stage
                    continue
                self.kv_caches[layer] = self.backend.allocate_kv_cache(specs[layer], g.num_blocks, self.device)
        bind_kv_cache(self.model, self.kv_caches, kv_cache_config.layer_group(), specs)
        from kvserve.kv_connector import KVConnectorRole, make_kv_connector

        self.kv_connector = make_kv_connector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        sc = self.config.scheduler_config
        # Block tables keep their logical layout in window groups too (freed entries: null).
        width = -(-sc.max_model_len // self.block_size)
        # Bounded KV may run with a huge max_model_len: token rows start smaller and grow.
        rows = min(sc.max_model_len, 8192) if self.config.cache_config.kv_eviction_policy != "none" \
            else sc.max_model_len
        self.input_batch = InputBatch(sc.max_num_seqs, rows, self.block_size,
                                      [width] * len(kv_cache_config.groups),
                                      [getattr(g.spec, "sliding_window", None) for g in kv_cache_config.groups])
        layers = attention_layers(self.model)
        self.attn_builder = self.backend.metadata_builder_cls(layers, kv_cache_config.groups, self.input_batch,
                                                              self.model, self.device, self.dtype, sc.max_num_seqs)
        if self.device.type == "cuda":
            self.backend.warmup(layers[0].kv, layers[0].num_heads, self.dtype,
                                {layer.sliding_window for layer in layers})
        self.maybe_capture_cuda_graphs()

    def release(self) -> None:
        """Drop every tensor this runner owns, whoever still holds the runner or the engine:
        CUDA graphs (reset, so their private pool goes back at once), the KV caches (also
        unbound from the attention layers), the model, the draft model, the batch and
        metadata buffers; on CUDA then ``gc.collect`` and ``torch.cuda.empty_cache``.
        The runner cannot run again (the engine's ``shutdown``)."""
        import gc

        if self.device.type == "cuda":  # a launched step (async scheduling) may still read them
            torch.cuda.synchronize(self.device)
        for gr in (self.graph_runner, self.piecewise_runner):
            for g in (getattr(gr, "graphs", None) or {}).values():
                for graph in (g if isinstance(g, list) else [g[0]]):
                    if graph is not None:  # None: the CPU stand-in's
                        graph.reset()
        self.graph_runner = self.piecewise_runner = None
        if self.proposer is not None:
            self.proposer.release_cuda_graphs()
        if self.model is not None:
            for layer in attention_layers(self.model):
                layer.kv = None
        self.kv_caches.clear()  # the dict the KV connector registered: its view goes too
        self.model = self.proposer = self.input_batch = self.attn_builder = None
        self._last_sampled, self._last_rows = None, {}
        if self.device.type == "cuda":  # a full collection costs ~1 s in a big process: CUDA only
            gc.collect()
            torch.cuda.empty_cache()

    # ---- block operations (before the forward) -------------------------------------------
    @torch.inference_mode()
    def run_block_ops(self, ops: list[BlockOp]) -> None:
        """Copy-on-write: for each op, copy slots ``[0, n)`` of block ``src`` into the same
        slots of block ``dst``, K and V, in every layer of the op's group."""
        if not ops:
            return
        bs = self.block_size
        for gid in sorted({op.group_id for op in ops}):
            mine = [op for op in ops if op.group_id == gid]
            if any(op.op != "copy" for op in mine):
                raise ValueError(f"unknown block op in {mine}")
            src = [op.src * bs + j for op in mine for j in range(op.num_tokens)]
            dst = [op.dst * bs + j for op in mine for j in range(op.num_tokens)]
            src_t = to_device(src, self.device, torch.long)
            dst_t = to_device(dst, self.device, torch.long)
            group = self.kv_cache_config.groups[gid]
            fmt = format_of_spec(group.spec)
            for layer in group.layer_indices:
                if layer not in self.kv_caches:  # a layer of another pipeline stage
                    continue
                # quantized pages keep codes and scales apart: the format copies both
                fmt.copy_slots(self.kv_caches[layer], src_t, dst_t)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def maybe_capture_cuda_graphs(self) -> None:
        """On CUDA unless ``--enforce-eager`` or the backend can't be captured: whole-model graphs
        for decode-only steps and piecewise graphs, attention eager, for steps with prefill."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.cuda_graph_safe:
            return
        if self.config.parallel_config.pipeline_parallel_size > 1:
            logger.info("pipeline parallel: stages run eagerly (no CUDA graphs around the send/recv)")
            return
        if self.proposer is not None and self.proposer.needs_eager_target:
            logger.info("the proposer reads target states the CUDA graphs do not return: CUDA graphs off")
            return
        from kvserve.worker.cuda_graphs import CUDAGraphRunner, PiecewiseCUDAGraphRunner

        sc = self.config.scheduler_config
        self.piecewise_runner = PiecewiseCUDAGraphRunner(self.model, sc.max_num_batched_tokens, self.device)
        self.piecewise_runner.capture()
        if self.proposer is not None:
            self.proposer.capture_cuda_graphs()
        if not self.attn_builder.decode_graphs_supported:
            # e.g. bounded KV: attention reads per-step host plans, so it stays eager between
            # the graphed pieces, for decode steps too.
            logger.info("attention metadata of this KV cache is per-step host work: piecewise CUDA graphs only")
            return
        widths = [-(-sc.max_model_len // self.block_size)] * len(self.kv_cache_config.groups)
        self.graph_runner = CUDAGraphRunner(self.model, self.attn_builder, sc.max_num_seqs, widths, sc.max_model_len,
                                            self.device, self.max_query_len_decode)
        self.graph_runner.capture()

    def _recapture_cuda_graphs(self) -> None:
        """A metadata buffer that graphs read by address was reallocated (a grown exact
        filling block, grown rotary tables): capture the graphs again."""
        logger.info("attention buffers moved: capturing CUDA graphs again")
        if self.piecewise_runner is not None:
            self.piecewise_runner.capture()
        gr = self.graph_runner
        if gr is not None:
            from kvserve.worker.cuda_graphs import CUDAGraphRunner

            self.graph_runner = CUDAGraphRunner(self.model, self.attn_builder, gr.max_num_seqs, gr.max_blocks_per_group,
                                                gr.max_model_len, self.device, max(gr.query_lens), eager=gr.eager)
            del gr
            self.graph_runner.capture()

    # ---- one step ----------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput):
        """Compute the scheduled tokens and sample; returns the ``ModelRunnerOutput``."""
        return self.execute_model_async(sched).get()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Apply the step's diff, launch the step; its tokens come back through ``.get()``.

        A decode whose input token is still pending (async scheduling: sampled by the
        previous step, not yet seen by the host) reads it from that step's sampled-token
        tensor on the device. Raises RuntimeError if such a token is not from the previous step.
        """
        batch = self.input_batch
        batch.apply(sched)
        if self.proposer is not None and sched.num_speculative_tokens is not None:
            self.proposer.num_drafts_allowed = sched.num_speculative_tokens
        if self.proposer is not None and (sched.finished_req_ids or sched.preempted_req_ids):
            self.proposer.remove_requests(list(sched.finished_req_ids) + list(sched.preempted_req_ids))
        conn = self.kv_connector
        if conn is not None:
            # Copy-on-write sources are untouched by loads (they load into fresh blocks).
            conn.bind_connector_metadata(sched.kv_connector_metadata)
            conn.start_load_kv()
        if sched.is_empty:
            res = AsyncModelRunnerOutput([], None, None, None, None, self)
            res.poll = True
            return res
        self.run_block_ops(sched.block_ops)
        inp = batch.prepare(sched)
        if self.attn_builder.prepare(sched, inp):
            self._recapture_cuda_graphs()
        tree = None  # tree drafts: positions by depth, an ancestor mask (kvserve/spec_decode/tree.py)
        if self.tree_drafts and sched.scheduled_spec_decode_tokens and self.proposer is not None:
            from kvserve.spec_decode.tree import TreeVerification

            tree = TreeVerification.build(self.proposer, inp, sched.scheduled_spec_decode_tokens)
        pending = None
        if len(inp.pending_idx):
            rows = self._last_rows
            src = list(map(rows.get, inp.pending_req))
            if None in src or self._last_sampled is None:
                missing = src.index(None) if None in src else 0
                raise RuntimeError(f"{inp.pending_req[missing]}: pending token not sampled by the previous step")
            pending = (inp.pending_idx, np.asarray(src), self._last_sampled)
        gr, pw = self.graph_runner, self.piecewise_runner
        num_reqs = len(inp.req_ids)
        drafts = sched.scheduled_spec_decode_tokens
        grammar = (sched.structured_output_request_ids, sched.grammar_bitmask) \
            if sched.structured_output_request_ids else None
        # EAGLE-3's mid-layer states only for a step the proposer records (speculation on);
        # with it off the step runs the plain engine's forward / decode graph.
        aux = self._keep_aux_states()
        if gr is not None and tree is None and gr.can_run(inp):
            hidden, row_start = gr.run(inp, pending, aux)
            self._record_hidden(inp, hidden, row_start)
            if conn is not None:
                conn.start_save_kv()
            return self._sample(inp, hidden, row_start, drafts, grammar)
        input_ids = to_device(inp.token_ids, self.device, torch.long)
        if pending is not None:
            dst = to_device(pending[0], self.device, torch.long)
            src = to_device(pending[1], self.device, torch.long)
            input_ids.index_copy_(0, dst, self._last_sampled.index_select(0, src))
        positions = to_device(inp.positions, self.device)
        tp = pw.padded_size(len(inp.token_ids)) if pw is not None else None
        metas = self.attn_builder.build(inp, pad_to=tp)
        if tree is not None:
            tree.attach(metas, self.device)
        if tp is not None:
            hidden = pw.run(input_ids, positions, metas)
        elif self.config.parallel_config.pipeline_parallel_size > 1:
            from kvserve.worker.pipeline_stage import stage_forward

            hidden = stage_forward(self.model, input_ids, positions, metas, self.dtype)
            if hidden is None:  # a stage before the last: the last one samples
                return AsyncModelRunnerOutput([], None, None, None, None, self)
        else:
            with forward_context(metas):
                hidden = self.model(input_ids, positions)
        mass = self.attn_builder.kv_block_mass(inp, metas)
        self._record_hidden(inp, hidden, inp.query_start_loc[:num_reqs])
        if conn is not None:
            conn.start_save_kv()
        res = self._sample(inp, hidden, inp.query_start_loc[:num_reqs], drafts, grammar, tree)
        if mass:
            res.kv_block_mass = mass
        return res

    def _keep_aux_states(self) -> bool:
        """Whether this step keeps the target's EAGLE-3 mid-layer states (a model that has them):
        with a proposer that reads them, only when it records the step (``Proposer.
        wants_hidden_states``; not while dynamic speculation is off); always without one. Sets the
        model's switch for an eager forward (piecewise graphs keep them as captured); returns it
        for the decode graphs."""
        inner = getattr(self.model, "model", None)
        if not getattr(inner, "aux_hidden_state_layers", ()):
            return False
        p = self.proposer
        on = p.wants_hidden_states if p is not None and p.uses_hidden_states else True
        inner.keep_aux_hidden_states = on
        return on

    def _record_hidden(self, inp: BatchInputs, hidden: torch.Tensor, row_start: np.ndarray) -> None:
        """Hand the step's target hidden states to a proposer that drafts from them (EAGLE)."""
        p = self.proposer
        if p is not None and p.wants_hidden_states:  # nothing is kept while k == 0
            p.record_hidden_states(inp.req_ids, inp.seq_lens - inp.query_lens, inp.query_lens, hidden, row_start)

    def _sample(self, inp: BatchInputs, hidden: torch.Tensor, row_start: np.ndarray,
                drafts: dict[str, list[int]], grammar=None, tree=None) -> AsyncModelRunnerOutput:
        """Logits where requests sample (the last row; the last ``1 + k`` rows with drafts),
        one sampler launch over all of them, one copy to the host. ``grammar`` (the step's
        request id -> bitmask row, and the bitmask) masks constrained requests' logits first.

        A request with ``k`` drafts samples each of its ``1 + k`` positions as if the drafts
        before it had been accepted (penalties, min_tokens and logprobs see those tokens);
        ``runner_output`` then keeps the drafts up to the first one that differs from the
        sample there, plus that sample (see ``kvserve.spec_decode.rejection_sampler``).
        """
        states = self.input_batch.states
        prompt_lps = self._prompt_logprobs(inp, hidden, row_start)
        ends = row_start + inp.query_lens - 1
        # Over the batch with numpy: no per-request Python on the plain (no draft) rows.
        plain = np.flatnonzero(inp.samples & (inp.num_drafts == 0))
        spec_idx = np.flatnonzero(inp.samples & (inp.num_drafts != 0))
        spec = spec_idx.tolist()
        if not len(plain) and not spec:
            self._last_rows = {}
            return AsyncModelRunnerOutput([], None, None, None, None, self, prompt_lps)
        rows = ends[plain]
        if spec:  # each spec request's last 1 + k rows, in order
            n = inp.num_drafts[spec_idx] + 1
            first = ends[spec_idx] - n + 1
            off = np.cumsum(n) - n
            rows = np.concatenate([rows, np.arange(int(n.sum())) + np.repeat(first - off, n)])
        if len(rows) == hidden.shape[0] and (rows == np.arange(len(rows))).all():
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[to_device(rows, self.device)])
        req_ids = inp.req_ids
        # Every row samples with no drafts (a decode step): plain is 0..R-1.
        plain_ids = list(req_ids) if len(plain) == len(req_ids) else [req_ids[i] for i in plain.tolist()]
        if grammar is not None and plain_ids:
            row_of, bitmask = grammar
            pairs = [(j, row_of[r]) for j, r in enumerate(plain_ids) if r in row_of]
            if pairs:
                apply_grammar_bitmask(logits, bitmask[[b for _, b in pairs]], [j for j, _ in pairs])
        reqs = list(map(states.__getitem__, plain_ids))
        spec_out = None
        if spec:
            spec_ids = [inp.req_ids[i] for i in spec]
            spec_drafts = [drafts[r] for r in spec_ids]
            if tree is None:
                reqs.extend(draft_positions([states[r] for r in spec_ids], spec_drafts, self.device))
            else:  # tree rows sample as if their own path were accepted
                reqs.extend(tree.draft_positions([states[r] for r in spec_ids], spec_ids, spec_drafts, self.device,
                                                 logits.shape[-1]))
            # Seeded requests replay their RNG once the accepted count is known.
            saved = {r: states[r].generator.get_state() for r in spec_ids if states[r].generator is not None}
            spec_out = (spec_ids, spec_drafts, saved, logits.shape[-1])
        sampled, packed, md = self.sampler.launch(logits, reqs, not self.input_batch.sampling_extra_reqs)
        (packed,), event = copy_to_host([packed])
        self._last_sampled = sampled
        self._last_rows = dict(zip(plain_ids, range(len(plain_ids))))
        res = AsyncModelRunnerOutput(plain_ids, packed, md, spec_out, event, self, prompt_lps)
        res.tree = tree
        return res

    def _prompt_logprobs(self, inp: BatchInputs, hidden: torch.Tensor, row_start: np.ndarray) -> dict:
        """For requests with ``prompt_logprobs`` computing prompt positions this step: per
        request ``(start position, [{token_id: (logprob, rank)}, ...])`` for the prompt tokens
        after those positions (the prompt token first, then the top ``prompt_logprobs``).
        Reads back to the host (these steps do not overlap the next one)."""
        batch = self.input_batch
        if not batch.prompt_logprobs_reqs:
            return {}
        states = batch.states
        out = {}
        for i, rid in enumerate(inp.req_ids):
            if rid not in batch.prompt_logprobs_reqs:
                continue
            st = states[rid]
            k = st.sampling_params.prompt_logprobs
            start = int(inp.seq_lens[i] - inp.query_lens[i])
            m = min(int(inp.query_lens[i]), len(st.prompt_token_ids) - 1 - start)
            if m <= 0:
                continue
            rows = torch.arange(int(row_start[i]), int(row_start[i]) + m, device=hidden.device)
            lp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
            target = torch.tensor(st.prompt_token_ids[start + 1:start + 1 + m], device=lp.device)
            tlp = lp.gather(1, target[:, None])
            rank = (lp > tlp).sum(-1) + 1
            top_lp, top_id = lp.topk(k, dim=-1) if k else (lp[:, :0], target[:, None][:, :0])
            entries = []
            for t, v, r, tv, ti in zip(target.tolist(), tlp[:, 0].tolist(), rank.tolist(), top_lp.tolist(),
                                       top_id.tolist()):
                e = {a: (b, j + 1) for j, (a, b) in enumerate(zip(ti, tv))}
                e[t] = (v, r)
                entries.append(e)
            out[rid] = (start, entries)
        return out

    # ---- speculative decoding ------------------------------------------------------------
    def propose(self, req_ids: list[str]) -> dict[str, list[int]]:
        """Drafts for the next step from the proposer (every sampling setting can verify them)."""
        if self.proposer.idle:  # speculation off (dynamic): no call per step
            return {}
        states = self.input_batch.states
        eligible = [states[r] for r in req_ids if r in states]
        if not eligible:
            return {}
        drafts = self.proposer.propose(eligible, self.input_batch)
        return {st.req_id: d for st, d in zip(eligible, drafts) if d}
