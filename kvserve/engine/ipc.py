"""Messages between the API server (frontend) and the engine-core process, and zmq helpers.

Two one-way ZMQ PUSH/PULL channels over ``ipc://`` sockets that the frontend binds:

* input  (frontend PUSH -> core PULL): ``AddRequest`` | ``AbortRequests`` | ``Shutdown`` | ``ResetPrefixCache`` | ``Profile``
* output (core PUSH -> frontend PULL): ``Ready`` | ``StartupFailed`` | ``StepOutputs`` | ``Heartbeat``

Every reader of the output socket must accept ``Heartbeat`` (it carries no outputs: it only
proves that the core's loop still turns; the frontend's stall watchdog times the gaps).

Every message is a msgspec ``Struct`` encoded with msgpack as a tagged union, so one decoder
per direction reads any of them. Times are seconds since the epoch (``time.time()``).
Requires ``msgspec`` and ``pyzmq`` (server-only dependencies; imported by the server only).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional, Union

import msgspec

from kvserve.engine.core_types import EngineCoreOutput
from kvserve.engine.ipc_paths import cleanup_ipc_paths
from kvserve.engine.ipc_paths import make_ipc_paths as _make_paths
from kvserve.sampling_params import SamplingParams

# ----------------------------------------------------------------------------- frontend -> core


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue one (child) request in the engine core.

    ``sampling_params`` holds ``SamplingParams`` fields by name (see ``params_to_dict``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    arrival_time: float
    priority: int = 0
    eos_token_id: Optional[int] = None
    cache_salt: Optional[str] = None  # prefix-cache isolation between tenants


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Finish these child requests (aborted or stopped by a stop string) and free their blocks."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Ask the engine core to exit its loop."""


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    """Forget the prefix cache's blocks no request holds (``EngineCore.reset_prefix_cache``)."""


class Profile(msgspec.Struct, tag=True, array_like=True):
    """Start (``is_start``) or stop ``torch.profiler`` on the workers (``EngineCore.profile``)."""

    is_start: bool


InputMessage = Union[AddRequest, AbortRequests, Shutdown, ResetPrefixCache, Profile]

# ----------------------------------------------------------------------------- core -> frontend


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Sent once the engine core has loaded the model and sized the KV cache.

    ``max_model_len`` may be lower than asked (capped to the KV capacity).
    """

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    pid: int
    # With a KV transfer connector: {"kv_role", "engine_id", "kv_connector", "kv_layout"}.
    kv_transfer: Optional[dict[str, Any]] = None


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine core could not start (bad flag, missing model, too little KV memory)."""

    error_type: str
    message: str


class SchedulerStatsMsg(msgspec.Struct, array_like=True):
    """Scheduler gauges (now) and cumulative counters (since start)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by live requests, 0..1
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # tokens, cumulative
    prefix_cache_hits: int = 0  # tokens, cumulative
    prefix_cache_recompute_hits: int = 0  # tokens, cumulative; a preempted request's own recompute
    num_drafts: int = 0  # speculative decoding, cumulative: steps that verified drafts
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    num_accepted_tokens_per_pos: list[int] = []  # accepted drafts at each draft position
    num_recomputed_tokens: int = 0  # cumulative: tokens computed again for preempted requests
    kv_tier: Optional[dict[str, float]] = None  # the KV connector's counters (tiers), cumulative
    num_evicted_blocks: int = 0  # cumulative: blocks freed by bounded-KV eviction (streaming / h2o)
    num_evicted_tokens: int = 0  # cumulative: their token slots
    moe_expert_tokens: Optional[list[int]] = None  # MoE: tokens routed per expert, summed over layers, cumulative
    kv_events: Optional[dict[str, int]] = None  # KV events published / dropped, cumulative (--kv-events-config)


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One engine step's (or one batch of aborts') result.

    ``outputs``: the step's ``EngineCoreOutput`` records, as the engine core made them.
    ``num_prompt_tokens`` / ``num_generation_tokens`` are the tokens computed in this step.
    ``plain_req_ids`` / ``plain_token_ids``: the step's plain decode rows, one new token each
    and nothing else new (``EngineCoreOutputs``).
    """

    outputs: list[EngineCoreOutput]
    stats: SchedulerStatsMsg
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    timestamp: float = 0.0
    plain_req_ids: list[str] = []
    plain_token_ids: list[int] = []


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """Sent by an idle engine core every ``core_proc.HEARTBEAT_INTERVAL_S`` seconds.

    A busy core sends a ``StepOutputs`` after every step instead, so a gap longer than the
    stall timeout means the loop is stuck (hung step, stopped process) either way.
    ``timestamp``: the core's ``time.time()``; ``num_steps``: steps run since start.
    """

    timestamp: float = 0.0
    num_steps: int = 0


OutputMessage = Union[Ready, StartupFailed, StepOutputs, Heartbeat]

# ----------------------------------------------------------------------------- helpers

_PARAM_FIELDS = [f.name for f in fields(SamplingParams)]


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """``SamplingParams`` -> plain dict for ``AddRequest.sampling_params`` (sets become lists)."""
    out = {}
    for name in _PARAM_FIELDS:
        v = getattr(params, name)
        if isinstance(v, set):
            v = sorted(v)
        elif name == "structured_outputs" and v is not None:
            v = v.to_dict()
        out[name] = v
    return out


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    """Inverse of ``params_to_dict``. Raises ValueError on invalid values."""
    d = dict(d)
    stop_ids = set(d.pop("all_stop_token_ids", None) or ())
    params = SamplingParams(**{k: v for k, v in d.items() if k in _PARAM_FIELDS})
    params.all_stop_token_ids = stop_ids
    return params


def make_ipc_paths() -> tuple[str, str]:
    """Two fresh ``ipc://`` addresses (input, output) in the temp directory."""
    a, b = _make_paths(2)
    return a, b


def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(InputMessage)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(OutputMessage)


__all__ = [
    "AddRequest", "AbortRequests", "Shutdown", "ResetPrefixCache", "Profile", "Ready", "StartupFailed", "EngineCoreOutput",
    "SchedulerStatsMsg", "StepOutputs", "Heartbeat", "InputMessage", "OutputMessage", "params_to_dict",
    "params_from_dict", "make_ipc_paths", "cleanup_ipc_paths", "input_encoder", "input_decoder",
    "output_decoder",
]
