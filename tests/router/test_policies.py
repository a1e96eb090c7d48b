"""Router policies, circuit breaker and worker registry on scripted states (no HTTP, fast)."""

from __future__ import annotations

import pytest

from kvserve.router.policies import ApproxRadixTree, CacheAware, Candidate, LeastLoaded, RoundRobin, make_policy
from kvserve.router.workers import CircuitBreaker, WorkerRegistry


def test_radix_tree_match_insert_split():
    t = ApproxRadixTree()
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    assert t.match("hello world!") == {"a": 11, "b": 6}
    assert t.match("help") == {"a": 3, "b": 3}
    assert t.match("xyz") == {}
    assert t.size == len("hello ") + len("world") + len("there")
    assert t.chars_of("a") == 11 and t.chars_of("b") == 11


def test_radix_tree_lru_eviction_bounded():
    t = ApproxRadixTree(max_chars=30)
    t.insert("a" * 10 + "old", "w1")
    t.insert("b" * 10 + "new", "w1")
    t.match("a")  # matching does not refresh (approximate)
    t.insert("c" * 10 + "newest", "w2")
    assert t.size <= 30
    assert "w1" not in t.match("aaaaaaaaaaold")  # the least recently inserted went first
    assert t.match("cccccccccc")["w2"] == 10


def test_radix_tree_remove_worker():
    t = ApproxRadixTree()
    t.insert("shared prefix A", "a")
    t.insert("shared prefix B", "b")
    t.remove_worker("a")
    assert t.match("shared prefix A") == {"b": 14}
    assert t.size == len("shared prefix ") + 1


def test_cache_aware_prefers_longest_match():
    p = CacheAware(cache_threshold=0.5)
    ws = [Candidate("a", 0), Candidate("b", 0)]
    first = p.choose("system prompt: you are helpful. user: hi", ws)
    other = "b" if first.url == "a" else "a"
    assert first.reason == "cache_miss"
    # A different prompt goes to the other (least-loaded tie broken by least recently picked) worker.
    assert p.choose("completely different text", ws).url == other
    # A prompt sharing the first's long prefix goes back to the first worker, even if it is busier.
    d = p.choose("system prompt: you are helpful. user: bye", [Candidate(first.url, 3), Candidate(other, 0)])
    assert d.url == first.url and d.reason == "cache_hit" and d.matched_chars >= 33


def test_cache_aware_keeps_cache_salts_apart():
    """A prefix sent under one cache_salt is no hit for another salt (or none), however the
    salts and texts line up; the same salt still hits."""
    p = CacheAware(cache_threshold=0.5)
    text = "system prompt: you are helpful. user: hi"
    p.choose(text, [Candidate("a", 0)], salt="t1")
    ws = [Candidate("a", 5), Candidate("b", 0)]
    for salt, t in (("t2", text), (None, text), ("t", "1" + text), ("t1x", text), ("", text)):
        d = p.choose(t, ws, salt=salt)
        assert d.reason == "cache_miss" and d.matched_chars == 0 and d.url == "b", (salt, t)
    d = p.choose(text + "!", [Candidate("a", 3), Candidate("b", 0)], salt="t1")
    assert d.url == "a" and d.reason == "cache_hit" and d.matched_chars == len(text)


def test_cache_aware_imbalance_goes_least_loaded():
    p = CacheAware(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)
    p.choose("long shared prefix xxxxxxxxxxxxxxxxxxxx", [Candidate("a", 0)])
    d = p.choose("long shared prefix xxxxxxxxxxxxxxxxxxxx 2", [Candidate("a", 20), Candidate("b", 1)])
    assert d.url == "b" and d.reason == "imbalanced"
    # Below the imbalance threshold the cache wins (a holds "... 3"'s longest prefix).
    p.choose("long shared prefix xxxxxxxxxxxxxxxxxxxx 3", [Candidate("a", 0)])
    d = p.choose("long shared prefix xxxxxxxxxxxxxxxxxxxx 3!", [Candidate("a", 3), Candidate("b", 1)])
    assert d.url == "a" and d.reason == "cache_hit"


def test_cache_aware_low_match_goes_least_loaded():
    p = CacheAware(cache_threshold=0.8)
    p.choose("abc" + "x" * 20, [Candidate("a", 0)])
    d = p.choose("abc" + "y" * 20, [Candidate("a", 2), Candidate("b", 0)])
    assert d.url == "b" and d.reason == "cache_miss"


def test_least_loaded_and_round_robin():
    ll = LeastLoaded()
    assert ll.choose("", [Candidate("a", 5), Candidate("b", 2), Candidate("c", 9)]).url == "b"
    # Ties: the one picked longest ago.
    picks = [ll.choose("", [Candidate("a", 0), Candidate("b", 0)]).url for _ in range(4)]
    assert picks in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    rr = RoundRobin()
    assert [rr.choose("", [Candidate("a"), Candidate("b"), Candidate("c")]).url for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_circuit_breaker_open_half_open_close():
    now = [0.0]
    cb = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=lambda: now[0])
    assert cb.state == "closed" and cb.acquire()
    cb.record_failure()
    assert cb.state == "closed"
    cb.record_success()
    cb.record_failure()
    cb.record_failure()  # two consecutive: open
    assert cb.state == "open" and not cb.allows() and not cb.acquire()
    now[0] = 5.0
    assert cb.state == "half_open" and cb.acquire()  # the probe
    assert not cb.acquire()  # only one probe
    cb.record_failure()  # the probe failed: open again
    assert cb.state == "open"
    now[0] = 10.5
    assert cb.acquire()
    cb.record_success()
    assert cb.state == "closed" and cb.failures == 0


def test_registry_add_remove_routable():
    reg = WorkerRegistry(failure_threshold=1, cooldown_s=60)
    a = reg.add("127.0.0.1:1/", "worker")
    assert a.url == "http://127.0.0.1:1"
    reg.add("http://127.0.0.1:2", "worker")
    with pytest.raises(ValueError, match="already registered"):
        reg.add("http://127.0.0.1:1", "worker")
    with pytest.raises(ValueError, match="unknown pool"):
        reg.add("http://127.0.0.1:3", "gpu")
    assert reg.mode() == "colocated"
    a.breaker.record_failure()
    assert [w.url for w in reg.routable("worker")] == ["http://127.0.0.1:2"]
    removed = []
    reg.on_remove.append(removed.append)
    reg.remove("http://127.0.0.1:2")
    assert removed == ["http://127.0.0.1:2"] and reg.routable("worker") == []
    with pytest.raises(ValueError, match="no worker"):
        reg.remove("http://127.0.0.1:2")
    reg.add("http://127.0.0.1:4", "decode")
    assert reg.mode() == "pd"


def test_layout_check_refuses_mismatch():
    from kvserve.router.app import check_layouts
    from kvserve.router.workers import Worker

    reg = WorkerRegistry()
    p = reg.add("http://p", "prefill")
    p.kv_info = {"kv_role": "kv_producer", "kv_layout": {"block_size": 16, "dtype": "float32"}}
    good = Worker("http://d1", "decode", CircuitBreaker(), kv_info={"kv_role": "kv_consumer",
                                                                   "kv_layout": {"block_size": 16, "dtype": "float32"}})
    check_layouts(reg, good)
    bad = Worker("http://d2", "decode", CircuitBreaker(), kv_info={"kv_role": "kv_consumer",
                                                                  "kv_layout": {"block_size": 32, "dtype": "float32"}})
    with pytest.raises(ValueError, match="KV layout mismatch"):
        check_layouts(reg, bad)
    wrong_role = Worker("http://d3", "decode", CircuitBreaker(), kv_info={"kv_role": "kv_producer", "kv_layout": {}})
    with pytest.raises(ValueError, match="kv_role"):
        check_layouts(reg, wrong_role)
    with pytest.raises(ValueError, match="no GET /v1/kv_transfer"):
        check_layouts(reg, Worker("http://d4", "decode", CircuitBreaker()))


def test_routing_text_and_traceparent():
    from kvserve.entrypoints.openai.tracing import new_traceparent, parse_traceparent
    from kvserve.router.proxy import routing_text

    assert routing_text("completions", {"prompt": "abc"}) == "abc"
    assert routing_text("chat", {"messages": [{"role": "user", "content": "hi"}]}) == "<user>hi"
    tp = new_traceparent()
    tid, parent, flags = parse_traceparent(tp)
    assert len(tid) == 32 and len(parent) == 16 and flags == "01"
    assert parse_traceparent("00-" + "0" * 32 + "-" + "1" * 16 + "-01") is None
    assert parse_traceparent("garbage") is None


def test_load_from_worker_metrics_text():
    from kvserve.router.app import _metric_sum

    text = ('# HELP kvserve:num_requests_running x\nkvserve:num_requests_running{model_name="m"} 3.0\n'
            'kvserve:num_requests_waiting{model_name="m"} 2.0\nkvserve:num_requests_waiting_other 9\n')
    assert _metric_sum(text, ("kvserve:num_requests_running{", "kvserve:num_requests_waiting{")) == 5
