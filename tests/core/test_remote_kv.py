"""The scheduler package on its own: ``RemoteKVTracker`` without a scheduler, admission's
check-then-commit allocation, and the package's imports (no module imports the scheduler back,
core imports nothing above it)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import kvserve
from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched_output import KVConnectorOutput
from kvserve.core.scheduler import Scheduler
from kvserve.core.scheduler.remote_kv import RemoteKVTracker
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams


class Connector:
    """The connector hooks the tracker drives, recorded."""

    def __init__(self, policy="recompute"):
        self.load_failure_policy = policy
        self.outputs = []
        self.released = []

    def on_kv_connector_output(self, out):
        self.outputs.append(out)

    def release_held(self, rid):
        self.released.append(rid)


def _req(rid, n=12):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=4), arrival_time=1.0)


def _parked(policy="recompute"):
    kv = KVCacheManager.for_blocks(16, 4)
    conn = Connector(policy)
    t = RemoteKVTracker(kv, conn)
    req = _req("a")
    req.delay_cache_blocks = True
    assert kv.allocate_slots(req, 8, kv.get_computed_blocks(req)[0]) is not None
    t.park(req, 0, 8)
    return kv, conn, t, req


def test_parked_request_resumes_with_the_remote_tokens():
    kv, conn, t, req = _parked()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 0
    assert t.waiting == {"a": (req, 8)} and t.num_waiting == 1 and t.has_transfers()
    out = KVConnectorOutput(finished_recving={"a"})
    resumed, failed = t.update(out)
    assert resumed == [req] and failed == []
    assert conn.outputs == [out]
    assert req.status == RequestStatus.WAITING and req.kv_ready and not req.delay_cache_blocks
    assert req.num_computed_tokens == 8 and req.num_cached_tokens == 8
    assert t.waiting == {} and not t.has_transfers()
    assert kv.get_block_ids("a") == ([1, 2],)  # its blocks stay: it runs next


def test_failed_pull_recomputes_or_fails_per_policy():
    _, _, t, req = _parked("recompute")
    resumed, failed = t.update(KVConnectorOutput(finished_recving={"a"}, failed_recving={"a"}))
    assert resumed == [req] and failed == []
    assert req.num_computed_tokens == 0 and req.num_cached_tokens == 0 and req.kv_ready

    _, _, t, req = _parked("fail")
    resumed, failed = t.update(KVConnectorOutput(finished_recving={"a"}, failed_recving={"a"}))
    assert resumed == [] and failed == [req]
    assert req.status == RequestStatus.WAITING and not req.kv_ready and not req.delay_cache_blocks
    assert t.waiting == {}


def test_held_blocks_are_freed_when_the_transfer_ends():
    kv = KVCacheManager.for_blocks(16, 4)
    conn = Connector()
    t = RemoteKVTracker(kv, conn)
    req = _req("p")
    assert kv.allocate_slots(req, 12, kv.get_computed_blocks(req)[0]) is not None
    free0 = kv.pool.get_num_free_blocks()
    t.hold(req)
    assert t.is_held("p") and t.has_transfers() and t.num_waiting == 0
    t.release("p")
    t.release("other")  # not held: nothing to end
    assert conn.released == ["p"]
    assert t.update(KVConnectorOutput(finished_sending={"p", "x"})) == ([], [])
    assert not t.is_held("p") and not t.has_transfers()
    assert kv.pool.get_num_free_blocks() == free0 + 3
    kv.check_invariants()


def test_admission_checks_before_it_allocates_and_retries_once_without_the_partial_block():
    """Blocks short for the partial hit's copy source: admitted without it (the one retry)."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    s = Scheduler(cfg, KVCacheManager.for_blocks(5, 4))  # 4 usable blocks
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1), arrival_time=1.0)
    s.add_request(a)
    s.update_from_output(s.schedule(), _sampled({"a": [7]}))  # a ends; its 3 full blocks stay cached
    assert a.is_finished
    b = Request("b", [0, 1, 2, 3, 4, 5] + list(range(50, 60)), SamplingParams(max_tokens=1), arrival_time=2.0)
    s.kv.begin_step()  # a's blocks were written by the step that registered them: copy sources now
    hits, n = s.kv.get_computed_blocks(b)
    assert n == 6 and len(hits[0]) == 1 and hits[0].partial.num_tokens == 2
    assert not s.kv.can_allocate(b, 16 - 6, hits)  # 3 new + 1 hit + 1 copy source > 4 free
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 12} and b.num_cached_tokens == 4
    assert out.block_ops == []  # no copy of the partial block
    assert s.kv.get_block_ids("b")[0][0] == 1  # the full hit is kept
    s.kv.check_invariants()


def _sampled(toks):
    from kvserve.core.sched_output import ModelRunnerOutput

    return ModelRunnerOutput(sampled_token_ids=toks)


# ---- imports ---------------------------------------------------------------------------------

CORE = pathlib.Path(kvserve.__file__).parent / "core"


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports, function-local and TYPE_CHECKING ones included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


@pytest.mark.parametrize("name", ["admission", "update", "remote_kv", "waiting_queue", "spec_policy"])
def test_scheduler_parts_do_not_import_the_scheduler(name):
    got = _imports(CORE / "scheduler" / f"{name}.py")
    assert not {"kvserve.core.scheduler", "kvserve.core.scheduler.scheduler"} & got


def test_remote_kv_imports_nothing_of_the_scheduler():
    assert not [m for m in _imports(CORE / "scheduler" / "remote_kv.py") if m.startswith("kvserve.core.scheduler")]


def test_core_imports_no_scheduler_back_torch_or_a_layer_above():
    allowed = ("kvserve.core", "kvserve.config", "kvserve.request", "kvserve.sampling_params")
    for path in CORE.rglob("*.py"):
        got = _imports(path)
        assert "torch" not in got, path
        above = [m for m in got if m.startswith("kvserve") and not m.startswith(allowed)]
        assert above == [], (path, above)
        if path.parent == CORE:  # outside the scheduler package: nothing imports it
            assert not [m for m in got if m.startswith("kvserve.core.scheduler")], path
