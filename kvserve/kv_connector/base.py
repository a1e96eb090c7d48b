"""The KV connector seam: moving KV blocks between the device cache and somewhere else.

Names and split follow vLLM's ``KVConnectorBase_V1``: one connector class, built twice,
once per role.

* **Scheduler role** (in the engine-core process, pure Python, no tensors):
  ``get_num_new_matched_tokens`` says how many prompt tokens past the device prefix-cache
  hit the outside store holds; ``update_state_after_alloc`` learns which device blocks
  receive them; ``build_connector_meta`` turns the step's transfers into plain data that
  travels inside ``SchedulerOutput.kv_connector_metadata``; ``request_finished`` /
  ``request_preempted`` let the store keep or drop a request's blocks; between engines,
  ``on_kv_connector_output`` learns of the workers' finished transfers.
* **Worker role** (beside the model runner): ``bind_connector_metadata`` receives a step's
  data; ``start_load_kv`` starts the loads (and swap-outs) that must land before the
  forward; ``wait_for_layer_load`` blocks until one layer's blocks are in place;
  ``save_kv_layer`` / ``start_save_kv`` offer written blocks after the forward;
  ``wait_for_save`` blocks until earlier saves no longer read the device cache.

The tiers (``kvserve.kv_connector.offloading``) are connectors; prefill/decode
disaggregation later is another one.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorMetadata:
    """A step's transfers as plain data (subclasses add fields; must pickle)."""


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    """Base class of KV connectors.

    Every optional capability is declared here with its default (callers never probe for it);
    a connector overrides what it supports.

    Args:
        config: the resolved ``EngineConfig``.
        role: which half this instance plays.
        kv_cache_config: the device cache's groups and block counts.

    Attributes:
        load_failure_policy: what the scheduler does with a request whose remote KV pull
            failed: ``"recompute"`` its prompt locally, or ``"fail"`` it (finish_reason abort).
    """

    load_failure_policy: str = "recompute"

    @staticmethod
    def prepare_config(config) -> None:
        """Resolve start-up values in ``config`` (ports, ids) once, before the workers start,
        so that every process reads the same ones. Raises ValueError for a bad config."""

    def __init__(self, config, role: KVConnectorRole, kv_cache_config) -> None:
        self.config = config
        self.role = role
        self.kv_cache_config = kv_cache_config
        self._meta: Optional[KVConnectorMetadata] = None

    def transfer_info(self) -> Optional[dict[str, Any]]:
        """For KV transfer between engines: ``{"kv_role", "engine_id", "kv_connector",
        "kv_transport", "kv_layout"}`` (``GET /v1/kv_transfer``); None for other connectors."""
        return None

    # ---- scheduler role ----------------------------------------------------------------
    def bind_scheduler(self, requests: dict[str, "Request"], kv_cache_manager) -> None:
        """The scheduler's request map and KV cache manager (read when building metadata)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (the device hit, a block multiple) the store
        can load for ``request``, and whether they load asynchronously over several steps.
        Never counts the request's last token (its logits are needed)."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """Device blocks were allocated: ``block_ids`` are all of the request's blocks (group 0);
        the ``num_external_tokens`` after its device hit are to be loaded into them."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's transfers (called once per step, after scheduling); resets the step state."""

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """A request finished; returns ``(delay freeing its blocks, params for the client)``."""
        return False, None

    def release_held(self, request_id: str) -> None:
        """A finished request whose blocks ``request_finished`` kept (delay free) was aborted:
        end its transfer; the worker then reports it finished and the scheduler frees them."""

    def request_preempted(self, request: "Request", block_ids: list[int]) -> None:
        """A running request is about to lose its device blocks (swap preemption keeps them)."""

    def has_unsent_meta(self) -> bool:
        """Whether work waits for the next step's metadata that must not wait for a step (e.g.
        blocks to lend: a consumer may be connecting already); the engine loop must not idle."""
        return False

    def on_kv_connector_output(self, output) -> None:
        """The workers' finished transfers of a step (``kvserve.core.sched_output.KVConnectorOutput``),
        before the scheduler applies them."""

    def get_stats(self) -> dict[str, float]:
        """Cumulative counters for logs and metrics."""
        return {}

    # ---- worker role -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[int, Any]) -> None:
        """The device cache tensors, per layer index."""

    def bind_connector_metadata(self, meta: Optional[KVConnectorMetadata]) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start this step's loads; they land before the forward reads the blocks."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until ``layer_idx``'s loads of this step are in its cache."""

    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        """Offer a layer's freshly written KV (layer-wise connectors)."""

    def start_save_kv(self) -> None:
        """After the forward was launched: start this step's block saves."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until earlier saves no longer read the device cache."""

    def take_kv_connector_output(self, wait_s: float = 0.0):
        """Worker role: transfers between engines finished since the last call
        (``kvserve.core.sched_output.KVConnectorOutput``), or None; may wait up to ``wait_s``
        seconds for one while transfers are under way."""
        return None

    def shutdown(self) -> None:
        """Stop transfer threads."""
