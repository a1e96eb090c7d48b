"""Engine configuration: frozen-ish dataclasses whose field docs feed ``--help``.

Flag names follow vLLM (``--max-num-seqs``, ``--block-size``, ``--kv-cache-memory`` ...).
``EngineArgs`` is the flat user-facing set; ``EngineArgs.create_engine_config()`` splits
it into the per-component configs and validates it (ValueError on bad values).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
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


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    model: Optional[str]  # resolved path (HF dir or .gguf file)
    tokenizer: Optional[str]
    dtype: str  # resolved torch dtype name: float32 | float16 | bfloat16
    load_format: str  # auto | safetensors | gguf | dummy
    max_model_len: int
    seed: int
    hf_config: Any = None  # transformers.PretrainedConfig
    skip_tokenizer_init: bool = False


@dataclass
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory: Optional[int]  # bytes
    kv_cache_dtype: str
    enable_prefix_caching: bool
    num_gpu_blocks_override: Optional[int]
    num_blocks: int = 0  # decided at start-up from the memory budget


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    scheduling_policy: str  # fcfs | priority
    long_prefill_token_threshold: int = 0


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str
    attention_backend: str
    enforce_eager: bool
    disable_log_stats: bool
    log_stats_interval: float
    async_scheduling: bool = False


@dataclass
class EngineArgs:
    """Every engine flag. Field names map to ``--kebab-case`` flags (vLLM's names)."""

    model: Optional[str] = _f(None, "HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.", positional=True)
    tokenizer: Optional[str] = _f(None, "Tokenizer directory (default: the model's own).")
    skip_tokenizer_init: bool = _f(False, "Load no tokenizer: prompts must be token ids and outputs carry no text.")
    dtype: str = _f("auto", "Model dtype.", choices=["auto", "bfloat16", "float16", "float32"])
    load_format: str = _f("auto", "Weight format; 'dummy' makes random weights from config.json.", choices=["auto", "safetensors", "gguf", "dummy"])
    max_model_len: Optional[int] = _f(None, "Longest prompt + output in tokens (default: the model's context length, capped by the KV cache).")
    seed: int = _f(0, "Seed for weights of dummy models and for unseeded sampling.")
    device: str = _f("auto", "auto | cpu | cuda.")
    block_size: int = _f(16, "Tokens per KV cache block.")
    gpu_memory_utilization: float = _f(0.9, "Fraction of GPU memory for weights, activations and KV cache.")
    kv_cache_memory: Optional[str] = _f(None, "KV cache size in bytes (e.g. 2GiB); overrides --gpu-memory-utilization. Default on the CPU: 1GiB.")
    kv_cache_dtype: str = _f("auto", "KV cache dtype (auto = model dtype).", choices=["auto", "bfloat16", "float16", "float32"])
    num_gpu_blocks_override: Optional[int] = _f(None, "Force the number of KV blocks (testing).")
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of shared prompt prefixes.")
    max_num_seqs: int = _f(256, "Most requests in one step.")
    max_num_batched_tokens: Optional[int] = _f(None, "Token budget per step (default 8192 with chunked prefill, else max_model_len).")
    enable_chunked_prefill: bool = _f(True, "Split long prefills across steps and mix them with decodes.")
    scheduling_policy: str = _f("fcfs", "Which waiting request goes first.", choices=["fcfs", "priority"])
    attention_backend: Optional[str] = _f(None, "Attention backend: triton (default on CUDA), cpu (default elsewhere: batched-matmul decode) or torch_ref (gather + SDPA; the reference).")
    enforce_eager: bool = _f(False, "Never use CUDA graphs (captured on CUDA otherwise: whole decode steps, and steps with prefill piecewise around attention).")
    async_scheduling: Optional[bool] = _f(None, "Schedule step N+1 while the device runs step N (default: on with CUDA, off on the CPU where nothing overlaps).")
    disable_log_stats: bool = _f(False, "Turn off the periodic stats log line.")
    log_stats_interval: float = _f(5.0, "Seconds between stats log lines.")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def create_engine_config(self) -> EngineConfig:
        """Resolve defaults, load the HF config, and validate. Raises ValueError / FileNotFoundError."""
        import torch

        from kvserve.model_loader import load_hf_config, resolve_model

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        model_path, load_format = resolve_model(self.model, self.load_format)
        hf_config = load_hf_config(model_path, load_format)
        dtype = self.dtype
        if dtype == "auto":
            # CPU matmuls are fastest and exact in float32; on GPU use the checkpoint's 16-bit type.
            cfg_dtype = str(getattr(hf_config, "dtype", None) or hf_config.__dict__.get("torch_dtype") or "")
            if device == "cpu":
                dtype = "float32"
            else:
                dtype = "float16" if "float16" in cfg_dtype and "b" not in cfg_dtype else "bfloat16"
        max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = self.max_model_len or max_pos
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
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
                f"max_num_batched_tokens ({mnbt}) < max_model_len ({max_model_len}) needs chunked prefill"
            )
        model_config = ModelConfig(
            model=model_path, tokenizer=self.tokenizer, skip_tokenizer_init=self.skip_tokenizer_init, dtype=dtype, load_format=load_format,
            max_model_len=max_model_len, seed=self.seed, hf_config=hf_config,
        )
        kv_mem = parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None
        cache_config = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=kv_mem,
            kv_cache_dtype=dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        sched = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=mnbt, max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
        )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        return EngineConfig(
            model_config=model_config, cache_config=cache_config, scheduler_config=sched,
            device=device,
            attention_backend=self.attention_backend or ("triton" if device == "cuda" else "cpu"),
            enforce_eager=self.enforce_eager,
            async_scheduling=(device == "cuda") if self.async_scheduling is None else self.async_scheduling,
            disable_log_stats=self.disable_log_stats, log_stats_interval=self.log_stats_interval,
        )
