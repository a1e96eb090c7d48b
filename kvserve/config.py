"""Engine configuration, one dataclass per component; each field is documented once, here.

``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig``,
``SpeculativeConfig``, ``KVTransferConfig``, ``AttentionConfig``, ``DeviceConfig`` and
``ObservabilityConfig`` make up ``EngineConfig``. The user-facing fields carry their help
text, choices and default in ``field(metadata=...)``; ``EngineArgs``
(``kvserve.engine.arg_utils``) takes its defaults and ``--help`` text from them, resolves the
"auto" values once (``EngineArgs.create_engine_config``) and the resolved ``EngineConfig``
is what every process receives (it pickles). Field names follow vLLM.

No I/O happens at import; nothing here imports torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "T": 1e12, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``"2GiB"``, ``"512MB"`` or ``1048576`` into bytes.

    Raises ValueError on anything else.
    """
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2) is None and not m.group(1):
        raise ValueError(f"cannot parse size {text!r}; use e.g. 2GiB, 512MiB, 1e9")
    unit = (m.group(2) or "").upper()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_json_arg(value: Any, name: str) -> Optional[dict]:
    """A JSON object given as a dict or a JSON string (CLI); None stays None. Raises ValueError."""
    if value is None or isinstance(value, dict):
        return value
    try:
        out = json.loads(value)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name} must be a JSON object, got {value!r}: {exc}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return out


def doc(default: Any, help: str, **kw: Any) -> Any:
    """A documented config field: ``help`` feeds ``--help``; ``choices`` are enforced by the CLI."""
    return field(default=default, metadata={"help": help, **kw})


def resolved(default: Any = None) -> Any:
    """A field decided at start-up (not a user flag)."""
    return field(default=default, metadata={"resolved": True})


# The KV cache dtypes the engine knows ("auto" = the model dtype); see kvserve.core.kv_cache_spec.
KV_CACHE_DTYPE_CHOICES = ["auto", "bfloat16", "float16", "float32"]


@dataclass
class ModelConfig:
    """What to run: weights, tokenizer, numeric type, context length."""

    model: Optional[str] = doc(None, "HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.",
                               positional=True)
    tokenizer: Optional[str] = doc(None, "Tokenizer directory (default: the model's own).")
    skip_tokenizer_init: bool = doc(False, "Load no tokenizer: prompts must be token ids and outputs carry no text.")
    dtype: str = doc("auto", "Model dtype (auto: float32 on the CPU, bfloat16 there with --quantization on CPUs "
                             "with native bf16; the checkpoint's 16-bit type on a GPU).",
                     choices=["auto", "bfloat16", "float16", "float32"])
    load_format: str = doc("auto", "Weight format; 'dummy' makes random weights from config.json.",
                           choices=["auto", "safetensors", "gguf", "dummy"])
    quantization: Optional[str] = doc(
        None, "Weight quantization applied at load: int4 (group-wise asymmetric, weight-only), int8 (per-channel, "
              "weight-only), fp8 (per-channel weights + per-token FP8 activations; CUDA >= sm89), gguf "
              "(keep a GGUF's Q4_0/Q4_1/Q8_0 weights quantized instead of dequantizing). With a quantization and "
              "--dtype auto the CPU runs bfloat16 where it has native bf16 (AVX512-BF16/AMX).",
        choices=["int4", "int8", "fp8", "gguf"])
    max_model_len: Optional[int] = doc(None, "Longest prompt + output in tokens (default: the model's context "
                                             "length, capped by the KV cache).")
    seed: int = doc(0, "Seed for weights of dummy models and for unseeded sampling.")
    enforce_eager: bool = doc(False, "Never use CUDA graphs (captured on CUDA otherwise: whole decode steps, and "
                                     "steps with prefill piecewise around attention).")
    hf_config: Any = resolved()  # transformers.PretrainedConfig
    max_model_len_explicit: bool = resolved(False)  # the user set max_model_len (never lowered then)


@dataclass
class CacheConfig:
    """The paged KV cache: block size, memory budget, format, prefix caching."""

    block_size: int = doc(16, "Tokens per KV cache block.")
    gpu_memory_utilization: float = doc(0.9, "Fraction of GPU memory for weights, activations and KV cache.")
    kv_cache_memory: Optional[int] = doc(None, "KV cache size in bytes (e.g. 2GiB); overrides "
                                               "--gpu-memory-utilization. Default on the CPU: 1GiB.")
    kv_cache_dtype: str = doc("auto", "KV cache storage dtype (auto = the model dtype).",
                              choices=KV_CACHE_DTYPE_CHOICES)
    enable_prefix_caching: bool = doc(True, "Reuse KV blocks of shared prompt prefixes (radix tree).")
    num_gpu_blocks_override: Optional[int] = doc(None, "Force the number of KV blocks per group (testing).")
    num_blocks: int = resolved(0)  # per KV cache group, decided at start-up from the memory budget


@dataclass
class SchedulerConfig:
    """Token budgets and policies of the phase-free scheduler."""

    max_num_seqs: int = doc(256, "Most requests in one step.")
    max_num_batched_tokens: Optional[int] = doc(None, "Token budget per step (default 8192 with chunked "
                                                      "prefill, else max_model_len).")
    enable_chunked_prefill: bool = doc(True, "Split long prefills across steps and mix them with decodes.")
    scheduling_policy: str = doc("fcfs", "Which waiting request goes first.", choices=["fcfs", "priority"])
    async_scheduling: Optional[bool] = doc(None, "Schedule step N+1 while the device runs step N (default: on "
                                                 "with CUDA, off on the CPU where nothing overlaps).")
    max_model_len: int = resolved(0)  # mirrors ModelConfig.max_model_len once resolved
    long_prefill_token_threshold: int = resolved(0)


@dataclass
class ParallelConfig:
    """How the model is spread over workers."""

    tensor_parallel_size: int = doc(1, "Tensor-parallel ranks (1 today; more arrive with tensor parallelism).")
    distributed_executor_backend: Optional[str] = doc(
        None, "Executor: uni (the worker runs in the engine-core process; default for one rank) or mp (worker "
              "processes fed each step as serialized data).", choices=["uni", "mp"])

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config`` JSON, vLLM's fields)."""

    method: str = "ngram"  # a registered proposer (kvserve.spec_decode.PROPOSERS)
    num_speculative_tokens: int = 1  # k: draft tokens verified per step (1 + k computed)
    model: Optional[str] = None  # draft model path (draft_model / eagle)
    prompt_lookup_min: Optional[int] = None  # n-gram sizes (ngram)
    prompt_lookup_max: Optional[int] = None
    extra: dict = field(default_factory=dict)  # proposer-specific keys

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """Build from vLLM's JSON keys; unknown keys go to ``extra``. Raises ValueError."""
        d = dict(d)
        if "method" not in d:
            raise ValueError("--speculative-config needs a 'method'")
        k = d.pop("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        known = {"method", "model", "prompt_lookup_min", "prompt_lookup_max"}
        return cls(num_speculative_tokens=k, extra={x: d.pop(x) for x in list(d) if x not in known}, **d)


@dataclass
class KVTransferConfig:
    """KV transfer between engines and tiers (``--kv-transfer-config`` JSON, vLLM's fields)."""

    kv_connector: Optional[str] = None
    kv_role: Optional[str] = None  # kv_producer | kv_consumer | kv_both
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferConfig":
        unknown = set(d) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
        if unknown:
            raise ValueError(f"unknown --kv-transfer-config keys: {sorted(unknown)}")
        if d.get("kv_role") not in (None, "kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {d.get('kv_role')!r}")
        return cls(**d)


@dataclass
class AttentionConfig:
    """Which attention implementation serves the model's layers."""

    attention_backend: Optional[str] = doc(None, "Attention backend: triton (default on CUDA), cpu (default "
                                                 "elsewhere: batched-matmul decode) or torch_ref (gather + SDPA; "
                                                 "the reference).")


@dataclass
class DeviceConfig:
    device: str = doc("auto", "auto | cpu | cuda.")


@dataclass
class ObservabilityConfig:
    disable_log_stats: bool = doc(False, "Turn off the periodic stats log line.")
    log_stats_interval: float = doc(5.0, "Seconds between stats log lines.")


@dataclass
class EngineConfig:
    """Everything an engine needs, resolved (no "auto" left). Picklable: sent to worker processes."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    speculative_config: Optional[SpeculativeConfig] = None
    kv_transfer_config: Optional[KVTransferConfig] = None

    # Shorthands for the resolved values read everywhere.
    @property
    def device(self) -> str:
        return self.device_config.device

    @property
    def attention_backend(self) -> str:
        return self.attention_config.attention_backend

    @property
    def enforce_eager(self) -> bool:
        return self.model_config.enforce_eager

    @property
    def async_scheduling(self) -> bool:
        return bool(self.scheduler_config.async_scheduling)

    @property
    def disable_log_stats(self) -> bool:
        return self.observability_config.disable_log_stats

    @property
    def log_stats_interval(self) -> float:
        return self.observability_config.log_stats_interval


#: The component configs whose documented fields become engine flags, in --help order.
COMPONENT_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, AttentionConfig,
                     DeviceConfig, ObservabilityConfig)
