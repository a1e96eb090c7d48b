"""Engine configuration, one dataclass per component; each field is documented once, here.

``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig``,
``SpeculativeConfig``, ``KVTransferConfig``, ``AttentionConfig``, ``DeviceConfig`` and
``ObservabilityConfig`` make up ``EngineConfig``. The user-facing fields carry their help
text, choices and default in ``field(metadata=...)``; ``EngineArgs``
(``kvserve.engine.arg_utils``) takes its defaults and ``--help`` text from them, resolves the
"auto" values once (``EngineArgs.create_engine_config``, with the resolvers at the end of
this module: bounded KV, CPU threads) and the resolved ``EngineConfig`` is what every process
receives (it pickles; the transformers config travels as its values, ``HFConfigView``). Field names follow vLLM. The parallel, speculative, KV-transfer,
attention, device and observability configs are frozen; the model, cache and scheduler
configs also carry the values the engine core plans at start-up from the KV memory
(``num_blocks``, a lowered ``max_model_len``).

No I/O happens at import; nothing here imports torch.
"""

from __future__ import annotations

import json
import re
import os
from dataclasses import dataclass, field, replace
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
KV_CACHE_DTYPE_CHOICES = ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
                          "int2"]


@dataclass
class ModelConfig:
    """What to run: weights, tokenizer, numeric type, context length."""

    model: Optional[str] = doc(None, "HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.",
                               positional=True)
    tokenizer: Optional[str] = doc(None, "Tokenizer directory (default: the model's own).")
    skip_tokenizer_init: bool = doc(False, "Load no tokenizer: prompts must be token ids and outputs carry no text.")
    dtype: str = doc("auto", "Model dtype. auto: bfloat16 on a CPU with native bf16 (AVX512-BF16 or AMX), float32 "
                             "on other CPUs, the checkpoint's 16-bit type on a GPU.",
                     choices=["auto", "bfloat16", "float16", "float32"])
    load_format: str = doc("auto", "Weight format; 'dummy' makes random weights from config.json.",
                           choices=["auto", "safetensors", "gguf", "dummy"])
    quantization: Optional[str] = doc(
        None, "Weight quantization applied at load: int4 (group-wise asymmetric, weight-only), int8 (per-channel, "
              "weight-only), fp8 (per-channel weights + per-token FP8 activations; CUDA >= sm89), gguf "
              "(keep a GGUF's Q4_0/Q4_1/Q8_0 weights quantized instead of dequantizing; opt-in: measured faster at "
              "batch 1 on the CPU, slower for serving many streams and at prefill), compressed-tensors "
              "(a pre-quantized llm-compressor/vLLM checkpoint: INT4 group-wise, INT8 or FP8 per-channel weights "
              "loaded as stored; set automatically when config.json says so), gptq / awq (pre-quantized GPTQ / "
              "AutoAWQ checkpoints, 4-bit, GPTQ also 8-bit; set automatically from config.json; gptq_marlin / "
              "awq_marlin are accepted as the same). --dtype auto picks the same "
              "dtype with or without a quantization (the CPU int kernels are fast with bf16 activations only).",
        choices=["int4", "int8", "fp8", "gguf", "compressed-tensors", "gptq", "awq", "gptq_marlin", "awq_marlin"])
    max_model_len: Optional[int] = doc(None, "Longest prompt + output in tokens (default: the model's context "
                                             "length, capped by the KV cache).")
    rope_scaling: Optional[dict] = doc(
        None, 'RoPE scaling as JSON, replacing the config\'s: {"rope_type": "linear|dynamic|yarn|longrope|llama3", '
              '"factor": 4.0, ...} (the type\'s HF keys). Needed for --max-model-len beyond the native context; '
              'on Gemma 3 it scales the global layers.')
    rope_theta: Optional[float] = doc(None, "RoPE base frequency, replacing the config's (Gemma 3: global layers).")
    seed: int = doc(0, "Seed for weights of dummy models and for unseeded sampling.")
    enforce_eager: bool = doc(False, "Never use CUDA graphs (captured on CUDA otherwise: whole decode steps, and "
                                     "steps with prefill piecewise around attention).")
    hf_config: Any = resolved()  # transformers.PretrainedConfig
    max_model_len_explicit: bool = resolved(False)  # the user set max_model_len (never lowered then)

    def __getstate__(self) -> dict:
        # Spawned processes get the HF config's values, not its class (kvserve.utils.hf_config_view).
        from kvserve.utils.hf_config_view import HFConfigView

        return {**self.__dict__, "hf_config": HFConfigView.of(self.hf_config)}


#: ``--kv-eviction-policy`` values (``kvserve.core.bounded_kv`` implements them; docs/bounded-kv.md).
BOUNDED_KV_POLICIES = ("none", "streaming", "h2o")
#: ``--attention-sinks`` when a bounded policy is on and the flag is not given.
DEFAULT_ATTENTION_SINKS = 4


@dataclass
class CacheConfig:
    """The paged KV cache: block size, memory budget, format, prefix caching."""

    block_size: int = doc(16, "Tokens per KV cache block.")
    gpu_memory_utilization: float = doc(0.9, "Fraction of GPU memory for weights, activations and KV cache.")
    kv_cache_memory: Optional[int] = doc(None, "KV cache size in bytes (e.g. 2GiB); overrides "
                                               "--gpu-memory-utilization. Default on the CPU: 1GiB.")
    kv_cache_dtype: str = doc("auto", "KV cache storage dtype (auto = the model dtype). fp8 (= fp8_e4m3), "
                                      "fp8_e5m2 and int8 store a per-token-per-head scale; int4/int2 a per-token-"
                                      "per-head scale and minimum of Hadamard-rotated K/V rows "
                                      "(docs/kv-cache-dtypes.md: which to pick).",
                              choices=KV_CACHE_DTYPE_CHOICES)
    enable_prefix_caching: bool = doc(True, "Reuse KV blocks of shared prompt prefixes (radix tree).")
    num_gpu_blocks_override: Optional[int] = doc(None, "Force the number of KV blocks per group (testing).")
    disable_hybrid_kv_cache_manager: bool = doc(
        False, "Keep every layer's whole KV history, sliding-window layers included (they then mask by "
               "position); by default window layers form their own KV cache groups whose blocks outside "
               "the window are freed.")
    kv_offloading_size: Optional[float] = doc(None, "CPU tier: GiB of host memory holding KV blocks under the "
                                                    "device prefix cache (write-through, LRU; see "
                                                    "docs/kv-tiers.md). Off by default.")
    kv_disk_path: Optional[str] = doc(None, "Disk tier under the CPU tier: an existing directory of KV block files "
                                            "(checksummed, atomic writes; shared by engines and kept across "
                                            "restarts). Needs --kv-offloading-size.")
    kv_remote_url: Optional[str] = doc(None, "Remote tier under the CPU tier: redis://HOST:PORT of a Redis/Valkey "
                                             "server shared by engines (instead of --kv-disk-path). Needs "
                                             "--kv-offloading-size.")
    kv_disk_size: Optional[float] = doc(None, "Disk tier budget in GiB for the files this engine writes (oldest "
                                              "deleted first); default: no limit.")
    kv_eviction_policy: str = doc(
        "none", "Bounded KV per request (docs/bounded-kv.md): none keeps every token; streaming "
                "(StreamingLLM, arXiv:2309.17453) keeps --attention-sinks first tokens and the last "
                "--max-attention-window tokens; h2o (arXiv:2306.14048) keeps sinks, the recent window and "
                "the blocks with the most accumulated attention within --kv-budget-tokens. Setting "
                "--max-attention-window alone selects streaming.",
        choices=list(BOUNDED_KV_POLICIES))
    attention_sinks: Optional[int] = doc(None, "Bounded KV: the first tokens every query keeps attending to "
                                               "(attention sinks; default 4). Kept as ceil(N / block_size) blocks.")
    max_attention_window: Optional[int] = doc(
        None, "Bounded KV: the recent tokens each query attends to (streaming: required unless "
              "--kv-budget-tokens is set; h2o: the recent window that is never evicted, default half the budget).")
    kv_budget_tokens: Optional[int] = doc(None, "Bounded KV: most tokens one request keeps (h2o: required; "
                                                "streaming: default sinks + window, must be >= that).")
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
    preemption_mode: str = doc("recompute", "What a preempted request loses: recompute (its blocks are freed "
                                            "and recomputed on resume) or swap (its KV goes to the CPU tier and "
                                            "comes back; needs --kv-offloading-size).",
                               choices=["recompute", "swap"])
    max_model_len: int = resolved(0)  # mirrors ModelConfig.max_model_len once resolved
    long_prefill_token_threshold: int = doc(
        0, "Chunked prefill: the largest prefill chunk while other requests are running or waiting; a lone "
           "request (nothing else running or waiting) prefills up to max_num_batched_tokens per step. 0: no cap. "
           "E.g. --max-num-batched-tokens 32768 --long-prefill-token-threshold 8192: long prompts alone in 32K "
           "chunks, beside other requests in 8K ones.")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over workers."""

    tensor_parallel_size: int = doc(1, "Tensor-parallel ranks: attention heads, MLP and vocabulary split over "
                                       "this many workers (one GPU each; gloo processes on the CPU).",
                                    aliases=["-tp"])
    distributed_executor_backend: Optional[str] = doc(
        None, "Executor: uni (the worker runs in the engine-core process; default for one rank), mp (one worker "
              "process per rank on this machine, fed each step as serialized data; default for several ranks) "
              "or ray (one Ray actor per rank, on the nodes of a Ray cluster: RAY_ADDRESS or a local one).",
        choices=["uni", "mp", "ray"])
    enable_expert_parallel: bool = doc(
        False, "Mixture-of-experts models: split the experts whole over the tensor-parallel ranks (each rank "
               "holds experts / tensor_parallel_size of them) instead of splitting every expert's intermediate "
               "dimension; attention stays tensor parallel. Ignored (logged) for a dense model.")
    data_parallel_size: int = doc(
        1, "Data-parallel engine cores behind one API server (kvserve serve): each a full copy of the model "
           "with its own KV cache and scheduler, on its own tensor_parallel_size GPUs; requests are placed by "
           "the router's cache-aware policy. For replicas on several machines use kvserve launch --replicas.",
        aliases=["-dp"])
    pipeline_parallel_size: int = doc(
        1, "Pipeline-parallel stages: the decoder layers split into this many consecutive ranges, one stage "
           "each (the first holds the embedding, the last the final norm, LM head and sampling); hidden "
           "states pass stage to stage. world size = pipeline x tensor parallel, ranks ordered tensor-"
           "parallel first.", aliases=["-pp"])
    disable_custom_all_reduce: bool = doc(
        False, "Use NCCL for every tensor-parallel all-reduce instead of the custom peer-to-peer all-reduce "
               "(one-shot / two-shot over NVLink, fused with the residual add and RMSNorm) that small and "
               "medium messages take on CUDA when the GPUs can access each other.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


#: Largest ``num_speculative_tokens`` accepted (each step computes ``1 + k`` tokens per request).
MAX_SPECULATIVE_TOKENS = 16
#: Methods built in (``kvserve.spec_decode`` registers them); others: registered names or "module:Class".
SPEC_METHODS_WITH_MODEL = ("draft_model", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config`` JSON, vLLM's fields).

    Keys: ``method`` (ngram | suffix | draft_model | eagle | eagle3 | a registered proposer),
    ``num_speculative_tokens`` (k, 1..16), ``model`` (draft model / EAGLE head path; needed by
    draft_model and eagle*), ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram sizes;
    defaults 2 and 5), ``dynamic`` (adapt k to batch size and acceptance; default true),
    ``dynamic_max_batch`` (batch size from which speculation turns off; default 32),
    ``dynamic_min_acceptance`` (acceptance rate below which k shrinks; default 0.3),
    ``dynamic_max_batched_tokens`` (verified tokens per step, batch x (1 + k), from which a
    step is compute-bound: k is chosen by expected tokens per unit cost; default 256),
    ``dynamic_draft_cost`` (one draft step's cost relative to a decode step; default 0);
    other keys go to ``extra`` (e.g. the suffix method's ``suffix_decoding_*``, read by its proposer).
    Tree drafts (eagle / eagle3; SGLang's names, EAGLE-2, arXiv:2406.16858): ``speculative_eagle_topk``
    (children expanded per node and depth; default 1: chains) and ``speculative_num_draft_tokens``
    (tree nodes verified per step, the root included, 2..64; default ``topk * k + 1``, capped at 64).
    """

    method: str = "ngram"  # a registered proposer (kvserve.spec_decode.PROPOSERS)
    num_speculative_tokens: int = 1  # k: draft tokens verified per step (1 + k computed)
    model: Optional[str] = None  # draft model path (draft_model / eagle)
    prompt_lookup_min: Optional[int] = None  # n-gram sizes (ngram)
    prompt_lookup_max: Optional[int] = None
    dynamic: bool = True  # adapt k (and on/off) to the batch size and the measured acceptance
    dynamic_max_batch: int = 32  # running requests from which speculation turns off (hysteresis below)
    dynamic_min_acceptance: float = 0.3  # acceptance rate under which k shrinks
    dynamic_max_batched_tokens: int = 256  # batch x (1 + k) from which a step is compute-bound
    dynamic_draft_cost: float = 0.0  # one draft step's cost / a decode step's (the goodput's k choice)
    extra: dict = field(default_factory=dict)  # proposer-specific keys
    speculative_eagle_topk: int = 1  # tree drafts: children per expanded node (1: chains)
    speculative_num_draft_tokens: Optional[int] = None  # tree drafts: nodes verified per step, root included
    draft_model_path: Optional[str] = resolved()  # ``model`` resolved to a file / directory
    draft_load_format: Optional[str] = resolved()
    draft_hf_config: Any = resolved()

    def __getstate__(self) -> dict:
        from kvserve.utils.hf_config_view import HFConfigView  # see ModelConfig.__getstate__

        return {**self.__dict__, "draft_hf_config": HFConfigView.of(self.draft_hf_config)}

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """Build from vLLM's JSON keys; unknown keys go to ``extra``. Raises ValueError."""
        d = dict(d)
        if "method" not in d:
            raise ValueError("--speculative-config needs a 'method'")
        if not isinstance(d["method"], str):
            raise ValueError(f"speculative method must be a string, got {d['method']!r}")
        k = d.pop("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {k!r}")
        known = {"method", "model", "prompt_lookup_min", "prompt_lookup_max", "dynamic", "dynamic_max_batch",
                 "dynamic_min_acceptance", "dynamic_max_batched_tokens", "dynamic_draft_cost",
                 "speculative_eagle_topk", "speculative_num_draft_tokens"}
        cfg = cls(num_speculative_tokens=k, extra={x: d.pop(x) for x in list(d) if x not in known}, **d)
        if cfg.method in SPEC_METHODS_WITH_MODEL and not cfg.model:
            raise ValueError(f"speculative method {cfg.method!r} needs 'model' (a path)")
        if cfg.method == "ngram":
            lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if lo is None and hi is None:
                lo, hi = 2, 5
            elif lo is None:
                lo = min(2, hi)
            elif hi is None:
                hi = max(5, lo)
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
            cfg = replace(cfg, prompt_lookup_min=lo, prompt_lookup_max=hi)
        if not isinstance(cfg.dynamic, bool):
            raise ValueError(f"dynamic must be true or false, got {cfg.dynamic!r}")
        if not isinstance(cfg.dynamic_max_batch, int) or cfg.dynamic_max_batch < 1:
            raise ValueError(f"dynamic_max_batch must be an integer >= 1, got {cfg.dynamic_max_batch!r}")
        if not isinstance(cfg.dynamic_min_acceptance, (int, float)) or not 0 <= cfg.dynamic_min_acceptance < 1:
            raise ValueError(f"dynamic_min_acceptance must be in [0, 1), got {cfg.dynamic_min_acceptance!r}")
        t = cfg.dynamic_max_batched_tokens
        if not isinstance(t, int) or isinstance(t, bool) or t < 2:
            raise ValueError(f"dynamic_max_batched_tokens must be an integer >= 2, got {t!r}")
        c = cfg.dynamic_draft_cost
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0 <= c <= 10:
            raise ValueError(f"dynamic_draft_cost must be a number in [0, 10], got {c!r}")
        topk, n = cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= 16:
            raise ValueError(f"speculative_eagle_topk must be an integer in [1, 16], got {topk!r}")
        if topk > 1:
            if topk * k > 64:
                raise ValueError(f"speculative_eagle_topk * num_speculative_tokens must be <= 64 (the head's "
                                 f"tree mask), got {topk} * {k}")
            if n is None:
                n = min(topk * k + 1, 64)
            if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= 64:
                raise ValueError(f"speculative_num_draft_tokens must be an integer in [2, 64], got {n!r}")
            cfg = replace(cfg, speculative_num_draft_tokens=n)
        elif n is not None and n != k + 1:
            raise ValueError(f"speculative_num_draft_tokens ({n}) with speculative_eagle_topk 1 (a chain) must be "
                             f"num_speculative_tokens + 1 ({k + 1})")
        return cfg

    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens a request verifies per step at most: the tree's nodes but the root with
        tree drafts, else ``num_speculative_tokens``."""
        if self.speculative_eagle_topk > 1:
            return self.speculative_num_draft_tokens - 1
        return self.num_speculative_tokens


@dataclass(frozen=True)
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


#: ``--kv-events-config`` publishers (vLLM's names).
KV_EVENTS_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events for KV-aware routers (``--kv-events-config`` JSON, vLLM's ``KVEventsConfig`` fields).

    With ``enable_kv_cache_events`` and the ``zmq`` publisher, the engine core publishes, once per
    step, the blocks its prefix cache stored and evicted (``kvserve.core.kv_events``) on a ZMQ PUB
    socket; ``replay_endpoint`` (a ROUTER socket) resends the last ``buffer_steps`` batches to a
    consumer that asks from a sequence number (docs/kv-events.md).
    """

    enable_kv_cache_events: bool = False  # publish block stored / removed / all-cleared events
    publisher: Optional[str] = None  # "null" | "zmq"; unset: "zmq" if enabled, else "null"
    endpoint: str = "tcp://*:5557"  # PUB address: binds with "*" / "::" / ipc:// / inproc://, else connects
    replay_endpoint: Optional[str] = None  # ROUTER address (bound) answering replay requests
    buffer_steps: int = 10_000  # batches (steps) kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark of the PUB socket (messages)
    max_queue_size: int = 100_000  # batches queued for the publisher thread; past it batches are dropped
    topic: str = ""  # first frame of every message; subscribers filter on it

    @property
    def enabled(self) -> bool:
        """Whether events are collected and published (enabled and the ``zmq`` publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_dict(cls, d: dict) -> "KVEventsConfig":
        """Build from vLLM's JSON keys. Raises ValueError naming the field and what it accepts."""
        known = [f for f in cls.__dataclass_fields__]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown --kv-events-config keys: {unknown}; known: {', '.join(known)}")
        en = d.get("enable_kv_cache_events", False)
        if not isinstance(en, bool):
            raise ValueError(f"--kv-events-config enable_kv_cache_events must be true or false, got {en!r}")
        pub = d.get("publisher")
        if pub is None:
            pub = "zmq" if en else "null"
        if pub not in KV_EVENTS_PUBLISHERS:
            raise ValueError(f"--kv-events-config publisher must be one of {', '.join(KV_EVENTS_PUBLISHERS)}, "
                             f"got {pub!r}")
        for name in ("endpoint", "replay_endpoint"):
            v = d.get(name, cls.__dataclass_fields__[name].default)
            if v is None and name == "replay_endpoint":
                continue
            if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config {name} must be a ZMQ address tcp://HOST:PORT, ipc://PATH or "
                                 f"inproc://NAME (e.g. tcp://*:5557), got {v!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = d.get(name, cls.__dataclass_fields__[name].default)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--kv-events-config {name} must be an integer >= 1, got {v!r}")
        if not isinstance(d.get("topic", ""), str):
            raise ValueError(f"--kv-events-config topic must be a string, got {d.get('topic')!r}")
        cfg = cls(**dict(d, publisher=pub))
        if cfg.enabled and cfg.replay_endpoint == cfg.endpoint:
            raise ValueError(f"--kv-events-config replay_endpoint must differ from endpoint ({cfg.endpoint})")
        return cfg


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention implementation serves the model's layers."""

    attention_backend: Optional[str] = doc(None, "Attention backend: triton (default on CUDA), cpu (default "
                                                 "elsewhere: batched-matmul decode) or torch_ref (gather + SDPA; "
                                                 "the reference).")
    enable_cascade_attention: Optional[bool] = doc(
        None, "Cascade attention (triton backend): decode requests that share prefix blocks read them once per "
              "step for the whole group (Hydragen, arXiv:2402.05099). Default: on with CUDA, off on the CPU "
              "(the Triton interpreter).")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = doc("auto", "auto | cpu | cuda.")
    cpu_threads: int = doc(0, "Threads for torch's CPU ops in the process that runs the model (0: "
                              "$OMP_NUM_THREADS if set, else every core this process may use). Under "
                              "contention from other processes, fewer threads than cores is faster; "
                              "idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE unless set).")


@dataclass(frozen=True)
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
    kv_events_config: Optional[KVEventsConfig] = None

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


# ---- flag resolution (EngineArgs.create_engine_config calls these, once) -------------------

def resolve_bounded_kv(policy: Optional[str], sinks: Optional[int], window: Optional[int], budget: Optional[int],
                       block_size: int) -> dict:
    """The bounded-KV flags resolved into ``CacheConfig`` fields (docs/bounded-kv.md).

    Returns ``{kv_eviction_policy, attention_sinks, max_attention_window, kv_budget_tokens}``
    (all ints, or ``policy="none"`` with None values): ``--max-attention-window`` alone means
    ``streaming``; sinks default to ``DEFAULT_ATTENTION_SINKS``; a streaming window defaults to
    the budget less the sinks and its budget to sinks + window; an h2o window to half the budget.

    Raises ValueError naming the flag: an unknown policy; sinks < 0, window < 1, budget < 1;
    sinks + window > budget; an h2o budget whose ``block_size``-token blocks cannot hold the
    sink and window blocks. Whether the model and the other features allow bounded KV is
    checked by ``EngineArgs.create_engine_config``.
    """
    policy = policy or "none"
    if policy not in BOUNDED_KV_POLICIES:
        raise ValueError(f"--kv-eviction-policy must be one of {list(BOUNDED_KV_POLICIES)}, got {policy!r}")
    if policy == "none":
        if window is not None:
            policy = "streaming"  # TensorRT-LLM: a max attention window alone means a bounded window
        elif sinks is not None or budget is not None:
            raise ValueError("--attention-sinks / --kv-budget-tokens need --kv-eviction-policy streaming|h2o "
                             "(or --max-attention-window)")
        else:
            return {"kv_eviction_policy": "none", "attention_sinks": None, "max_attention_window": None,
                    "kv_budget_tokens": None}
    sinks = DEFAULT_ATTENTION_SINKS if sinks is None else int(sinks)
    if sinks < 0:
        raise ValueError(f"--attention-sinks must be >= 0, got {sinks}")
    if budget is not None and int(budget) < 1:
        raise ValueError(f"--kv-budget-tokens must be >= 1, got {budget}")
    if window is not None and int(window) < 1:
        raise ValueError(f"--max-attention-window must be >= 1, got {window}")
    bs = block_size
    if policy == "streaming":
        if window is None:
            if budget is None:
                raise ValueError("--kv-eviction-policy streaming needs --max-attention-window (or --kv-budget-tokens)")
            window = int(budget) - sinks
            if window < 1:
                raise ValueError(f"--kv-budget-tokens {budget} leaves no window after {sinks} attention sinks")
        window = int(window)
        budget = sinks + window if budget is None else int(budget)
        if sinks + window > budget:
            raise ValueError(f"--attention-sinks {sinks} + --max-attention-window {window} > --kv-budget-tokens "
                             f"{budget}")
    else:
        if budget is None:
            raise ValueError("--kv-eviction-policy h2o needs --kv-budget-tokens")
        budget = int(budget)
        window = budget // 2 if window is None else int(window)
        if sinks + window > budget:
            raise ValueError(f"--attention-sinks {sinks} + --max-attention-window {window} > --kv-budget-tokens "
                             f"{budget}")
        protected = -(-sinks // bs) + -(-window // bs) + 1
        if budget // bs < protected:
            raise ValueError(f"--kv-budget-tokens {budget} holds {budget // bs} blocks of {bs}, fewer than the "
                             f"{protected} blocks the sinks and the recent window span; raise the budget")
    return {"kv_eviction_policy": policy, "attention_sinks": sinks, "max_attention_window": window,
            "kv_budget_tokens": budget}


def max_attention_distance(bounded: dict, block_size: int) -> Optional[int]:
    """The longest query-key distance (tokens) a resolved ``streaming`` config (``bounded``, from
    ``resolve_bounded_kv``) lets attention see: ``ceil(N / bs) * bs + W + bs`` (sinks are at
    in-cache distance); None for ``none`` and ``h2o`` (h2o keeps original positions: distances
    grow with the request)."""
    if bounded.get("kv_eviction_policy") != "streaming":
        return None
    sb = -(-bounded["attention_sinks"] // block_size)
    return sb * block_size + bounded["max_attention_window"] + block_size


def resolve_cpu_threads(requested: int) -> int:
    """``--cpu-threads``: ``requested`` if > 0, else ``OMP_NUM_THREADS`` if set, else the cores
    this process may run on (``sched_getaffinity``). Raises ValueError if < 0."""
    if requested < 0:
        raise ValueError(f"cpu_threads must be >= 0 (0: auto), got {requested}")
    if requested:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
