"""PrometheusStatLogger without a server: names, per-instance registries, counter deltas."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from kvserve.engine.ipc import SchedulerStatsMsg  # noqa: E402
from kvserve.metrics.prometheus import PrometheusStatLogger  # noqa: E402


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_two_loggers_do_not_clash_and_families_exist():
    a, b = PrometheusStatLogger("m1"), PrometheusStatLogger("m2")
    text = a.render().decode()
    for fam in ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds"]:
        assert f"# TYPE kvserve:{fam} histogram" in text
    for fam in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]:
        assert f"# TYPE kvserve:{fam} gauge" in text
    for fam in ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                "generation_tokens", "request_success"]:
        assert f"# TYPE kvserve:{fam}_total counter" in text or f"# TYPE kvserve:{fam} counter" in text
    assert 'model_name="m2"' in b.render().decode()


def test_values_from_hooks():
    m = PrometheusStatLogger("m")
    m.on_step(SchedulerStatsMsg(3, 2, 0.25, 1, 100, 40), 50, 3)
    m.on_step(SchedulerStatsMsg(1, 0, 0.1, 1, 160, 70), 0, 1)  # cumulative counters -> deltas
    m.on_first_token(0.2)
    m.on_inter_token(0.05)
    m.on_finished("stop", 1.5, 0.01, 10, 5)
    m.on_finished("length", 2.0, None, 10, 5)
    t = m.render().decode()
    assert _value(t, "kvserve:num_requests_running") == 1
    assert _value(t, "kvserve:num_requests_waiting") == 0
    assert _value(t, "kvserve:kv_cache_usage_perc") == 0.1
    assert _value(t, "kvserve:prefix_cache_queries_total") == 160
    assert _value(t, "kvserve:prefix_cache_hits_total") == 70
    assert _value(t, "kvserve:num_preemptions_total") == 1
    assert _value(t, "kvserve:prompt_tokens_computed_total") == 50  # step counts: tokens computed
    assert _value(t, "kvserve:generation_tokens_total") == 4
    assert _value(t, "kvserve:time_to_first_token_seconds_count") == 1
    assert _value(t, "kvserve:e2e_request_latency_seconds_sum") == 3.5
    assert _value(t, "kvserve:request_queue_time_seconds_count") == 1
    assert 'kvserve:request_success_total{finished_reason="stop",model_name="m"} 1.0' in t


def test_bounded_kv_eviction_counters():
    """Bounded KV: cumulative evicted blocks / tokens from the stats message become counter deltas."""
    m = PrometheusStatLogger("m")
    m.on_step(SchedulerStatsMsg(num_evicted_blocks=3, num_evicted_tokens=48), 0, 1)
    m.on_step(SchedulerStatsMsg(num_evicted_blocks=5, num_evicted_tokens=80), 0, 1)
    text = m.render().decode()
    assert _value(text, "kvserve:kv_evicted_blocks_total") == 5
    assert _value(text, "kvserve:kv_evicted_tokens_total") == 80


def test_prompt_tokens_count_cached_ones_and_tpot():
    """vLLM's meanings: prompt_tokens_total counts every prompt token of a prefilled request (cached
    ones included), split by source; TPOT per interval and per request."""
    m = PrometheusStatLogger("m")
    m.on_prefill_done(100, 60)
    m.on_prefill_done(10, 0)
    m.on_step(SchedulerStatsMsg(), 50, 2)  # tokens the steps computed
    m.on_inter_token(0.02)
    m.on_finished("stop", 1.2, 0.0, 100, 11, ttft_s=0.2)  # (1.2 - 0.2) / 10 = 0.1 s per token
    t = m.render().decode()
    assert _value(t, "kvserve:prompt_tokens_total") == 110
    assert _value(t, "kvserve:prompt_tokens_cached_total") == 60
    assert 'kvserve:prompt_tokens_by_source_total{model_name="m",source="local_cache_hit"} 60.0' in t
    assert 'kvserve:prompt_tokens_by_source_total{model_name="m",source="local_compute"} 50.0' in t
    assert _value(t, "kvserve:prompt_tokens_computed_total") == 50
    assert "# TYPE kvserve:time_per_output_token_seconds histogram" in t
    assert _value(t, "kvserve:time_per_output_token_seconds_sum") == 0.02
    assert abs(_value(t, "kvserve:request_time_per_output_token_seconds_sum") - 0.1) < 1e-9
    assert 'kvserve:request_time_per_output_token_seconds_bucket{le="0.1",model_name="m"} 1.0' in t


def test_per_engine_series_for_data_parallel():
    """engine=0 + for_engine(i): one registry, every engine-side series per core, own baselines."""
    from types import SimpleNamespace

    m = PrometheusStatLogger("m", engine=0)
    e1 = m.for_engine(1)
    assert m.for_engine(0) is m and m.for_engine(1) is e1 and e1.registry is m.registry
    m.on_step(SchedulerStatsMsg(3, 2, 0.25, 1, 100, 40), 50, 3)
    e1.on_step(SchedulerStatsMsg(1, 0, 0.5, 0, 30, 10), 20, 1)  # its own cumulative baseline
    m.on_finished("stop", 1.0, None, 10, 5)
    e1.on_finished("stop", 1.0, None, 10, 5)
    e1.on_finished("length", 1.0, None, 10, 5)
    m.attach_frontend(lambda: 4, lambda: 0, lambda: 2)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, distributed_executor_backend=None,
                                                          data_parallel_size=2),
                          cache_config=SimpleNamespace(block_size=16, kv_cache_dtype="bfloat16"))
    m.set_engine_info(cfg, 100)
    e1.set_engine_info(cfg, 100)
    t = m.render().decode()
    assert 'kvserve:num_requests_running{engine="0",model_name="m"} 3.0' in t
    assert 'kvserve:num_requests_running{engine="1",model_name="m"} 1.0' in t
    assert 'kvserve:prefix_cache_queries_total{engine="0",model_name="m"} 100.0' in t
    assert 'kvserve:prefix_cache_queries_total{engine="1",model_name="m"} 30.0' in t
    assert 'kvserve:request_success_total{engine="1",finished_reason="length",model_name="m"} 1.0' in t
    assert 'kvserve:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' in t
    assert 'kvserve:num_requests_admitted{model_name="m"} 4.0' in t  # the server's own: no engine label
    assert t.count("kvserve:engine_config_info{") == 2 and 'data_parallel_size="2",' in t
