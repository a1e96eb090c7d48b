"""Optional capabilities are declared on the ABCs with their defaults (connectors, proposers,
executors, engines), implementations override them, and no caller probes for them."""

from __future__ import annotations

import pathlib
import re

import kvserve
from kvserve.core.sched_output import KVConnectorOutput
from kvserve.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole


class _Connector(KVConnectorBase_V1):
    """Only the abstract methods: everything else is the ABC's default."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self):
        pass

    def wait_for_save(self):
        pass


def test_connector_defaults():
    assert KVConnectorBase_V1.load_failure_policy == "recompute"
    assert KVConnectorBase_V1.prepare_config(object()) is None
    c = _Connector(None, KVConnectorRole.SCHEDULER, None)
    assert c.load_failure_policy == "recompute"
    assert c.transfer_info() is None
    assert c.has_unsent_meta() is False
    assert c.bind_scheduler({}, None) is None
    assert c.on_kv_connector_output(KVConnectorOutput()) is None
    assert c.request_finished(None, []) == (False, None)
    assert c.release_held("r") is None and c.request_preempted(None, []) is None
    assert c.get_stats() == {}
    assert c.take_kv_connector_output() is None


def test_connectors_override_what_they_support():
    from kvserve.kv_connector.offloading import OffloadingConnector
    from kvserve.kv_connector.p2p.connector import P2PKVConnector

    base = KVConnectorBase_V1
    for name in ("prepare_config", "transfer_info", "has_unsent_meta", "on_kv_connector_output", "bind_scheduler"):
        assert getattr(P2PKVConnector, name) is not getattr(base, name), name
    assert OffloadingConnector.bind_scheduler is not base.bind_scheduler
    assert OffloadingConnector.transfer_info is base.transfer_info  # no transfer between engines


def test_proposer_defaults_and_eagle_overrides():
    from kvserve.spec_decode.eagle import EagleProposer
    from kvserve.spec_decode.ngram import NgramProposer
    from kvserve.spec_decode.proposer import Proposer

    assert Proposer.uses_hidden_states is False
    assert Proposer.needs_eager_target.fget(None) is False
    assert Proposer.bind_target(None, object()) is None
    assert Proposer.record_hidden_states(None, [], [], [], None, []) is None
    assert NgramProposer.uses_hidden_states is False and NgramProposer.bind_target is Proposer.bind_target
    assert EagleProposer.uses_hidden_states is True
    for name in ("needs_eager_target", "bind_target", "record_hidden_states"):
        assert getattr(EagleProposer, name) is not getattr(Proposer, name), name


def test_executor_and_engine_capabilities():
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.async_client import AsyncLLM
    from kvserve.engine.engine_core import EngineCore
    from kvserve.executor.abstract import Executor
    from kvserve.executor.uniproc import UniProcExecutor

    assert Executor.model_runner.fget(None) is None
    assert UniProcExecutor.model_runner is not Executor.model_runner
    for name in ("has_kv_transfers", "has_urgent_kv_work", "kv_transfer_info", "model_runner"):
        assert hasattr(EngineCore, name), name
    assert AsyncLLM(EngineArgs()).kv_transfer_info is None  # before start (and without a connector)


PROBED = ("has_urgent_kv_work", "has_kv_transfers", "transfer_info", "kv_transfer_info", "has_unsent_meta",
          "bind_target", "needs_eager_target", "uses_hidden_states", "load_failure_policy", "prepare_config",
          "model_runner", "kv_transfer_params")


def test_no_capability_is_probed():
    root = pathlib.Path(kvserve.__file__).parent
    probe = re.compile(r"\b(?:hasattr|getattr)\([^,()]+,\s*[\"'](%s)[\"']" % "|".join(PROBED))
    found = [(str(p.relative_to(root)), m) for p in sorted(root.rglob("*.py")) for m in probe.findall(p.read_text())]
    assert found == []
