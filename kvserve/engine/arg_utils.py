"""``EngineArgs``: the flat set of engine flags, and their command-line registration.

Each field takes its default, help text and choices from the component config that owns it
(``kvserve.config``), so a flag is documented once. ``create_engine_config`` resolves the
"auto" values (device, dtype, context length, backend ...) and validates everything once;
the resulting ``EngineConfig`` is what the engine core and its workers receive.

The CLI (``kvserve generate|chat|serve|bench``) registers these flags through
``EngineArgs.add_cli_args`` and reads them back with ``EngineArgs.from_cli_args``: the
entrypoints import this module, never the other way round.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Optional

from kvserve.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    max_attention_distance,
    parse_json_arg,
    parse_size,
    resolve_bounded_kv,
    resolve_cpu_threads,
)
from kvserve.core.kv_cache_spec import get_kv_format


def _from(cfg_cls: type, name: str) -> Any:
    """A field with the default and metadata (help, choices) of ``cfg_cls.name``."""
    f = cfg_cls.__dataclass_fields__[name]
    return field(default=f.default, metadata=dict(f.metadata, owner=cfg_cls.__name__))


def _arg(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Every engine flag. Field names map to ``--kebab-case`` flags (vLLM's names)."""

    # ModelConfig
    model: Optional[str] = _from(ModelConfig, "model")
    tokenizer: Optional[str] = _from(ModelConfig, "tokenizer")
    skip_tokenizer_init: bool = _from(ModelConfig, "skip_tokenizer_init")
    dtype: str = _from(ModelConfig, "dtype")
    load_format: str = _from(ModelConfig, "load_format")
    quantization: Optional[str] = _from(ModelConfig, "quantization")
    max_model_len: Optional[int] = _from(ModelConfig, "max_model_len")
    rope_scaling: Optional[str] = _from(ModelConfig, "rope_scaling")  # JSON text or a dict
    rope_theta: Optional[float] = _from(ModelConfig, "rope_theta")
    seed: int = _from(ModelConfig, "seed")
    enforce_eager: bool = _from(ModelConfig, "enforce_eager")
    # DeviceConfig
    device: str = _from(DeviceConfig, "device")
    cpu_threads: int = _from(DeviceConfig, "cpu_threads")
    # CacheConfig (kv_cache_memory is a size string here: "2GiB")
    block_size: int = _from(CacheConfig, "block_size")
    gpu_memory_utilization: float = _from(CacheConfig, "gpu_memory_utilization")
    kv_cache_memory: Optional[str] = _from(CacheConfig, "kv_cache_memory")
    kv_cache_dtype: str = _from(CacheConfig, "kv_cache_dtype")
    num_gpu_blocks_override: Optional[int] = _from(CacheConfig, "num_gpu_blocks_override")
    enable_prefix_caching: bool = _from(CacheConfig, "enable_prefix_caching")
    disable_hybrid_kv_cache_manager: bool = _from(CacheConfig, "disable_hybrid_kv_cache_manager")
    kv_offloading_size: Optional[float] = _from(CacheConfig, "kv_offloading_size")
    kv_disk_path: Optional[str] = _from(CacheConfig, "kv_disk_path")
    kv_disk_size: Optional[float] = _from(CacheConfig, "kv_disk_size")
    kv_remote_url: Optional[str] = _from(CacheConfig, "kv_remote_url")
    kv_eviction_policy: str = _from(CacheConfig, "kv_eviction_policy")
    attention_sinks: Optional[int] = _from(CacheConfig, "attention_sinks")
    max_attention_window: Optional[int] = _from(CacheConfig, "max_attention_window")
    kv_budget_tokens: Optional[int] = _from(CacheConfig, "kv_budget_tokens")
    # SchedulerConfig
    max_num_seqs: int = _from(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: Optional[int] = _from(SchedulerConfig, "max_num_batched_tokens")
    enable_chunked_prefill: bool = _from(SchedulerConfig, "enable_chunked_prefill")
    scheduling_policy: str = _from(SchedulerConfig, "scheduling_policy")
    async_scheduling: Optional[bool] = _from(SchedulerConfig, "async_scheduling")
    preemption_mode: str = _from(SchedulerConfig, "preemption_mode")
    long_prefill_token_threshold: int = _from(SchedulerConfig, "long_prefill_token_threshold")
    # AttentionConfig
    attention_backend: Optional[str] = _from(AttentionConfig, "attention_backend")
    enable_cascade_attention: Optional[bool] = _from(AttentionConfig, "enable_cascade_attention")
    # ParallelConfig
    tensor_parallel_size: int = _from(ParallelConfig, "tensor_parallel_size")
    distributed_executor_backend: Optional[str] = _from(ParallelConfig, "distributed_executor_backend")
    enable_expert_parallel: bool = _from(ParallelConfig, "enable_expert_parallel")
    data_parallel_size: int = _from(ParallelConfig, "data_parallel_size")
    pipeline_parallel_size: int = _from(ParallelConfig, "pipeline_parallel_size")
    disable_custom_all_reduce: bool = _from(ParallelConfig, "disable_custom_all_reduce")
    # JSON-valued configs (vLLM's flags)
    speculative_config: Optional[str] = _arg(
        None, 'Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'.')
    kv_transfer_config: Optional[str] = _arg(
        None, 'KV transfer as JSON: {"kv_connector": ..., "kv_role": "kv_producer|kv_consumer|kv_both"}.')
    kv_events_config: Optional[str] = _arg(
        None, 'KV cache events for KV-aware routers as JSON (vLLM\'s fields), e.g. \'{"enable_kv_cache_events": '
              'true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'; '
              'see docs/kv-events.md.')
    # ObservabilityConfig
    disable_log_stats: bool = _from(ObservabilityConfig, "disable_log_stats")
    log_stats_interval: float = _from(ObservabilityConfig, "log_stats_interval")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    # ---- command line ------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per field to ``parser`` (in an "engine arguments" group).

        ``model`` becomes an optional positional ``MODEL``; ``foo_bar`` becomes ``--foo-bar``
        with the field's default; booleans get ``--flag/--no-flag``; ``choices`` are enforced.
        """
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine arguments", "Flags of kvserve.engine.arg_utils.EngineArgs.")
        for f in fields(cls):
            meta = f.metadata
            default = f.default if f.default is not MISSING else None
            help_text = meta.get("help", "").replace("%", "%%")
            tp = _unwrap_optional(hints[f.name])
            if meta.get("positional"):
                parser.add_argument(f.name, nargs="?", default=default, metavar=f.name.upper(), help=help_text,
                                    action=_SameValueAction)
                # vLLM takes the model both ways: `serve MODEL` and `serve --model MODEL`.
                group.add_argument("--" + f.name, dest=f.name, default=default, metavar=f.name.upper(),
                                   action=_SameValueAction,
                                   help=f"{help_text} Same as the positional {f.name.upper()} (vLLM's flag); "
                                        f"give one of the two.")
                continue
            kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
            flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
            if tp is bool:
                action = group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            else:
                if tp in (int, float, str):
                    kwargs["type"] = tp
                if "choices" in meta:
                    kwargs["choices"] = list(meta["choices"])
                action = group.add_argument(*flags, **kwargs)
            if default is not None and "default" not in (action.help or "").lower():
                action.help = (action.help or "") + " (default: %(default)s)"
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> dict[str, Any]:
        """The fields present in a parsed namespace, as ``{name: value}`` (for ``LLM(**d)``)."""
        return {name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)}

    # ---- resolution --------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Resolve defaults, load the HF config, and validate.

        Raises:
            ValueError: a bad value (the message names the flag); FileNotFoundError: no model.
        """
        import torch

        from kvserve.model_loader import load_hf_config, resolve_model

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        model_path, load_format = resolve_model(self.model, self.load_format)
        from kvserve.layers.quantization import check_quantization

        # Before the (slow) config load: the method, and the dtype when it is explicit.
        check_quantization(self.quantization, device, "bfloat16" if self.dtype == "auto" else self.dtype,
                           load_format, device_checks=False)
        hf_config = load_hf_config(model_path, load_format)
        from kvserve.model_loader.compressed_tensors_quant import resolve_checkpoint_quantization

        # A pre-quantized (compressed-tensors) checkpoint sets it; kernels: what check_quantization checks.
        quantization, kernels = resolve_checkpoint_quantization(self.quantization, hf_config, load_format,
                                                                model_path, device=device)
        dtype = resolve_auto_dtype(device, hf_config) if self.dtype == "auto" else self.dtype
        check_quantization(quantization, device, dtype, load_format)
        for kernel in kernels if quantization == "compressed-tensors" else ():
            try:
                check_quantization(kernel, device, dtype, "safetensors")
            except ValueError as e:
                raise ValueError(f"compressed-tensors checkpoint {model_path} ({kernel} weights): {e}") from None
        if quantization and quantization not in ("gptq", "awq") and self.tensor_parallel_size > 1:
            raise ValueError("--quantization is not supported with tensor_parallel_size > 1 yet")
        rope_scaling = parse_json_arg(self.rope_scaling, "--rope-scaling")
        bounded = resolve_bounded_kv(self.kv_eviction_policy, self.attention_sinks, self.max_attention_window,
                                     self.kv_budget_tokens, self.block_size)
        max_model_len = resolve_max_model_len(hf_config, self.max_model_len, rope_scaling, self.rope_theta,
                                              max_attention_distance(bounded, self.block_size))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        mnbt = self.max_num_batched_tokens
        if mnbt is None:
            mnbt = 8192 if self.enable_chunked_prefill else max_model_len
        if mnbt < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not self.enable_chunked_prefill and mnbt < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({mnbt}) < max_model_len ({max_model_len}) needs chunked prefill")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold caps prefill chunks: it needs chunked prefill")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        tp = self.tensor_parallel_size
        check_tensor_parallel(hf_config, tp, device, self.enable_expert_parallel)
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        pp = self.pipeline_parallel_size
        check_pipeline_parallel_args(self, hf_config, device, quantization)
        executor = self.distributed_executor_backend or ("uni" if tp * pp == 1 else "mp")
        if executor not in ("uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be uni, mp or ray, got {executor!r}")
        if executor == "uni" and tp > 1:
            raise ValueError("tensor_parallel_size > 1 needs one process per rank: use the mp or ray executor")
        if executor == "uni" and pp > 1:
            raise ValueError("pipeline_parallel_size > 1 needs one process per rank: use the mp or ray executor")
        if self.kv_offloading_size is not None and not float(self.kv_offloading_size) > 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not self.kv_offloading_size:
            raise ValueError("--preemption-mode swap needs a CPU tier: set --kv-offloading-size GiB")
        if self.kv_offloading_size and tp > 1:
            raise ValueError("--kv-offloading-size (KV tiers) is not supported with tensor_parallel_size > 1 yet")
        if self.kv_disk_path is not None and not self.kv_offloading_size:
            raise ValueError("--kv-disk-path needs the CPU tier above it: set --kv-offloading-size GiB")
        if self.kv_remote_url is not None and not self.kv_offloading_size:
            raise ValueError("--kv-remote-url needs the CPU tier above it: set --kv-offloading-size GiB")
        if self.kv_remote_url is not None and self.kv_disk_path is not None:
            raise ValueError("--kv-disk-path and --kv-remote-url: one tier under the CPU tier at a time (today)")
        if self.kv_disk_size is not None and not float(self.kv_disk_size) > 0:
            raise ValueError(f"kv_disk_size must be > 0 GiB, got {self.kv_disk_size}")
        spec = parse_json_arg(self.speculative_config, "--speculative-config")
        spec_config = SpeculativeConfig.from_dict(spec) if spec is not None else None
        if spec_config is not None:
            from kvserve.spec_decode import get_proposer_class

            get_proposer_class(spec_config.method)  # ValueError for an unknown method
            if spec_config.model is not None and spec_config.method in ("draft_model", "eagle", "eagle3"):
                spec_config = _resolve_draft(spec_config, hf_config)
        kvt = parse_json_arg(self.kv_transfer_config, "--kv-transfer-config")
        kve = parse_json_arg(self.kv_events_config, "--kv-events-config")
        kv_events = KVEventsConfig.from_dict(kve) if kve is not None else None
        if kv_events is not None and kv_events.enabled and not self.enable_prefix_caching:
            raise ValueError("--kv-events-config enable_kv_cache_events: KV events describe the prefix cache; "
                             "turn prefix caching on (drop --no-enable-prefix-caching)")
        check_bounded_kv_support(bounded["kv_eviction_policy"], hf_config, speculative=spec_config is not None)
        if bounded["kv_eviction_policy"] != "none" and (self.kv_offloading_size or kvt is not None):
            raise ValueError("--kv-eviction-policy: KV tiers / transfer (--kv-offloading-size, --kv-transfer-config) "
                             "are not supported with bounded KV")
        async_sched = (device == "cuda") if self.async_scheduling is None else self.async_scheduling
        if spec_config is not None and not spec_config.dynamic:
            async_sched = False  # drafts of step N are needed to schedule step N+1
        if pp > 1:
            async_sched = False  # earlier stages get step N's tokens with step N + 1 (TokenRelay)
        # Dynamic speculation keeps async scheduling: steps overlap while the policy has it off
        # (large batches), and run one at a time while it is on (EngineCore._needs_host_tokens).
        # Proposers with their own state (draft model, EAGLE, MTP) restart it after an off period.

        model_config = ModelConfig(
            model=model_path, tokenizer=self.tokenizer, skip_tokenizer_init=self.skip_tokenizer_init,
            dtype=dtype, load_format=load_format, quantization=quantization,
            max_model_len=max_model_len, seed=self.seed,
            rope_scaling=rope_scaling, rope_theta=self.rope_theta,
            enforce_eager=self.enforce_eager, hf_config=hf_config,
            max_model_len_explicit=self.max_model_len is not None,
        )
        cache_config = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None,
            kv_cache_dtype=dtype if self.kv_cache_dtype == "auto" else get_kv_format(self.kv_cache_dtype).name,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            kv_offloading_size=float(self.kv_offloading_size) if self.kv_offloading_size is not None else None,
            kv_disk_path=self.kv_disk_path, kv_remote_url=self.kv_remote_url,
            kv_disk_size=float(self.kv_disk_size) if self.kv_disk_size is not None else None,
            **bounded,
        )
        sched = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=mnbt, max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill, scheduling_policy=self.scheduling_policy,
            async_scheduling=async_sched, preemption_mode=self.preemption_mode,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
        return EngineConfig(
            model_config=model_config, cache_config=cache_config, scheduler_config=sched,
            parallel_config=ParallelConfig(self.tensor_parallel_size, executor, self.enable_expert_parallel,
                                           data_parallel_size=self.data_parallel_size, pipeline_parallel_size=pp,
                                           disable_custom_all_reduce=self.disable_custom_all_reduce),
            attention_config=AttentionConfig(self.attention_backend or ("triton" if device == "cuda" else "cpu"),
                                             self.enable_cascade_attention),
            device_config=DeviceConfig(device, resolve_cpu_threads(self.cpu_threads)),
            observability_config=ObservabilityConfig(self.disable_log_stats, self.log_stats_interval),
            speculative_config=spec_config,
            kv_transfer_config=KVTransferConfig.from_dict(kvt) if kvt is not None else None,
            kv_events_config=kv_events,
        )


def check_bounded_kv_support(policy: str, hf_config: Any, speculative: bool) -> None:
    """Raise ValueError when a bounded ``policy`` (``streaming`` / ``h2o``) meets speculative
    decoding, or a model whose layers already use sliding windows (Gemma 3, Mistral) or a
    partial rotary embedding. Any KV cache dtype works: stored keys are never rewritten
    (``kvserve.core.bounded_kv``)."""
    if policy == "none":
        return
    if speculative:
        raise ValueError("--kv-eviction-policy: speculative decoding is not supported with bounded KV "
                         "(draft rollback over evicted blocks)")
    mt = str(getattr(hf_config, "model_type", ""))
    lt = getattr(hf_config, "layer_types", None) or []
    uses_window = (getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True)
                   is not False and (not lt or "sliding_attention" in lt))
    if mt.startswith("gemma3") or uses_window:
        raise ValueError(f"--kv-eviction-policy {policy}: the model ({mt}) already uses sliding-window "
                         f"layers; bounded KV serves full-attention models only")
    prf = getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0
    if prf != 1.0:
        raise ValueError(f"--kv-eviction-policy {policy}: partial rotary embeddings (factor {prf}) are not "
                         f"supported")


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every engine flag to ``parser`` (``EngineArgs.add_cli_args``); returns the parser.
    Used by every subcommand that starts or configures an engine (``kvserve generate``,
    ``serve``, ``bench``, ``launch``)."""
    return EngineArgs.add_cli_args(parser)


def check_tensor_parallel(hf_config: Any, tp: int, device: str, enable_expert_parallel: bool = False) -> None:
    """Raise ValueError when ``tp`` ranks cannot split this model (heads, KV heads, MLP width;
    a model's own ``check_parallel``: MoE experts, split whole under ``enable_expert_parallel``)
    or exceed the visible GPUs."""
    from kvserve.distributed import kv_head_range
    from kvserve.models.registry import get_model_class

    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if enable_expert_parallel and not hasattr(get_model_class(hf_config), "check_parallel"):
        import logging

        logging.getLogger("kvserve").info("--enable-expert-parallel: %s has no experts; ignored",
                                          get_model_class(hf_config).__name__)
    if tp == 1:
        return
    cls = get_model_class(hf_config)
    if hasattr(cls, "check_parallel"):
        cls.check_parallel(hf_config, tp, enable_expert_parallel)
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"{cls.__name__} does not support tensor parallelism yet (tensor_parallel_size {tp})")
    heads = hf_config.num_attention_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {heads} attention heads")
    kv_head_range(getattr(hf_config, "num_key_value_heads", None) or heads, tp, 0)
    inter = getattr(hf_config, "intermediate_size", 0)
    if inter % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide intermediate_size {inter}")
    if device == "cuda":
        import torch

        if tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {tp} > {torch.cuda.device_count()} visible GPUs")


def check_pipeline_parallel_args(args: "EngineArgs", hf_config: Any, device: str,
                                 quantization: Optional[str] = None) -> None:
    """Raise ValueError when ``args.pipeline_parallel_size`` cannot run: below 1, a model
    without the layer-range hook, more stages than layers, too few GPUs, or a feature the
    stages do not implement yet (speculative decoding, quantization, KV tiers or transfer)."""
    pp = args.pipeline_parallel_size
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    if pp == 1:
        return
    from kvserve.models.pipeline import check_pipeline_parallel
    from kvserve.models.registry import get_model_class

    check_pipeline_parallel(get_model_class(hf_config), hf_config, pp)
    unsupported = [flag for flag, on in (("--speculative-config", args.speculative_config),
                                         ("--quantization", quantization or args.quantization),
                                         ("--kv-offloading-size", args.kv_offloading_size),
                                         ("--kv-transfer-config", args.kv_transfer_config)) if on]
    if unsupported:
        raise ValueError(f"pipeline_parallel_size {pp}: {', '.join(unsupported)} not supported with "
                         f"pipeline parallelism yet")
    if device == "cuda":
        import torch

        world = pp * args.tensor_parallel_size
        if world > torch.cuda.device_count():
            raise ValueError(f"pipeline_parallel_size {pp} x tensor_parallel_size {args.tensor_parallel_size} "
                             f"> {torch.cuda.device_count()} visible GPUs")


ALLOW_LONG_ENV = "KVSERVE_ALLOW_LONG_MAX_MODEL_LEN"


def resolve_max_model_len(hf_config: Any, max_model_len: Optional[int], rope_scaling: Optional[dict],
                          rope_theta: Optional[float], max_distance: Optional[int] = None) -> int:
    """Apply ``--rope-scaling`` / ``--rope-theta`` to ``hf_config`` and decide the context length.

    The default is the model's context (``max_position_embeddings``), or the scaled one when
    ``--rope-scaling`` stretches it (linear / dynamic / yarn: ``factor`` x the original).
    A ``--max-model-len`` beyond what the rope covers is refused unless the rope is scaled
    (or ``KVSERVE_ALLOW_LONG_MAX_MODEL_LEN=1``, then with a warning); beyond the scaled length
    it is allowed with a warning. With bounded KV (StreamingLLM) whose longest query-key
    distance ``max_distance`` the rope covers, any ``--max-model-len`` is allowed: positions
    grow, distances do not. The model is then built on the meta device so config errors
    (unsupported rope type, bad window) surface here.

    Raises ValueError naming the flag.
    """
    import logging
    import os

    from kvserve.layers.rope_scaling import apply_rope_overrides, layer_rope_dicts, scaled_context_length
    from kvserve.models.registry import validate_model_config

    logger = logging.getLogger("kvserve")
    if rope_theta is not None and not rope_theta > 0:
        raise ValueError(f"--rope-theta must be > 0, got {rope_theta}")
    try:
        apply_rope_overrides(hf_config, rope_scaling, rope_theta)
    except ValueError as exc:
        raise ValueError(f"--rope-scaling/--rope-theta: {exc}") from None
    max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
    dicts = layer_rope_dicts(hf_config)
    params = dicts.get("full_attention") or dicts["default"]
    scaled = params["rope_type"] != "default"
    covered = scaled_context_length(params, max_pos)
    if max_model_len is None:
        max_model_len = covered if rope_scaling is not None else max_pos
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if max_model_len > covered and max_distance is not None and max_distance <= covered:
        logger.info("bounded KV: max_model_len %d beyond the rope's %d tokens; attention distances stay <= %d",
                    max_model_len, covered, max_distance)
    elif max_model_len > covered:
        if not scaled and os.environ.get(ALLOW_LONG_ENV) != "1":
            raise ValueError(
                f"--max-model-len {max_model_len} is longer than the model's context ({max_pos} tokens) and its "
                f"rope is not scaled: pass --rope-scaling (e.g. '{{\"rope_type\": \"dynamic\", \"factor\": "
                f"{-(-max_model_len // max_pos)}.0}}') or set {ALLOW_LONG_ENV}=1 to run unscaled anyway")
        logger.warning("max_model_len %d is beyond the %d tokens the model's rope (%s) covers; quality may drop",
                       max_model_len, covered, params["rope_type"])
    validate_model_config(hf_config, max_model_len)
    return max_model_len


def _resolve_draft(spec_config: SpeculativeConfig, target_hf_config: Any) -> SpeculativeConfig:
    """``spec_config`` with the draft model / EAGLE head path resolved (``draft_model_path``,
    ``draft_load_format``, ``draft_hf_config``), after checking its vocabulary matches the
    target's. Raises ValueError / FileNotFoundError."""
    from kvserve.model_loader import load_hf_config, resolve_model

    if spec_config.method == "eagle" and spec_config.model == "default":  # the shipped head (default model)
        from kvserve.spec_decode.eagle import DEFAULT_EAGLE_HEAD

        spec_config = replace(spec_config, model=DEFAULT_EAGLE_HEAD)
    path, fmt = resolve_model(spec_config.model, spec_config.extra.get("load_format", "auto"))
    hf = load_hf_config(path, fmt)
    v_draft, v_target = getattr(hf, "vocab_size", None), getattr(target_hf_config, "vocab_size", None)
    if v_draft != v_target:
        raise ValueError(f"speculative model {spec_config.model!r} has vocab_size {v_draft}, the target has "
                         f"{v_target}: a draft must share the target's vocabulary")
    if spec_config.method in ("eagle", "eagle3"):
        h_head, h_target = getattr(hf, "hidden_size", None), getattr(target_hf_config, "hidden_size", None)
        if h_head != h_target:
            raise ValueError(f"EAGLE head {spec_config.model!r} has hidden_size {h_head}, the target has "
                             f"{h_target}: the head must be trained for this target")
    return replace(spec_config, draft_model_path=path, draft_load_format=fmt, draft_hf_config=hf)


def resolve_auto_dtype(device: str, hf_config: Any = None) -> str:
    """The model dtype ``--dtype auto`` means on ``device`` (the one place this rule lives).

    CPU: bfloat16 where the CPU has native bf16 (``cpu_has_native_bf16``: 3-5x float32's decode
    speed, docs/benchmarks/weight-quant.md), else float32 (bf16 is emulated there and
    slower), with or without ``--quantization``. GPU: the checkpoint's type when it is float16,
    else bfloat16.
    """
    if device == "cpu":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    cfg_dtype = ""
    if hf_config is not None:
        cfg_dtype = str(getattr(hf_config, "dtype", None) or hf_config.__dict__.get("torch_dtype") or "")
    return "float16" if "float16" in cfg_dtype and "b" not in cfg_dtype else "bfloat16"


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16; Linux /proc/cpuinfo).

    ``KVSERVE_CPU_NATIVE_BF16=1`` / ``=0`` overrides the detection: for tests (to run the bf16
    default on a CPU without it, or the float32 one on a CPU with it) and for CPUs or VMs whose
    flags lie (a flag the hypervisor shows but traps, or hides).
    """
    forced = os.environ.get("KVSERVE_CPU_NATIVE_BF16", "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"KVSERVE_CPU_NATIVE_BF16 must be 0 or 1, got {forced!r}")
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


class _SameValueAction(argparse.Action):
    """Stores like ``store``, for a value that two arguments may give (positional ``MODEL`` and
    ``--model``): an absent positional (``None``) keeps what the flag set, and two different
    values are a usage error naming both."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            return
        prev = getattr(namespace, self.dest, None)
        if prev is not None and prev != values:
            parser.error(f"the {self.dest} is given twice with different values: {prev!r} and {values!r} "
                         f"(positional {self.metavar} or --{self.dest}: give one)")
        setattr(namespace, self.dest, values)


def _unwrap_optional(tp: Any) -> Any:
    """``Optional[X]`` / ``X | None`` -> ``X``; anything else unchanged."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp
