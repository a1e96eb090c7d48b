"""Prometheus metrics of the API server, with vLLM's names and a ``kvserve:`` prefix.

Every metric carries the label ``model_name``. Each ``PrometheusStatLogger`` owns its own
``CollectorRegistry`` (never the global one), so several servers can live in one process.
With data parallelism (``--data-parallel-size N``) the server builds it with ``engine=0`` and
each engine core reports through ``for_engine(i)``: every engine-side series then also carries
``engine="<i>"`` (vLLM's label; sum over it for the server's totals), while the API server's
own gauges below stay one series. With one engine there is no ``engine`` label (the series
are exactly those of earlier releases).

Exposed families (counters get the ``_total`` suffix in the text format):

* histograms (seconds): ``kvserve:time_to_first_token_seconds``,
  ``kvserve:inter_token_latency_seconds``, ``kvserve:time_per_output_token_seconds`` (vLLM's
  name for the same per-token intervals), ``kvserve:request_time_per_output_token_seconds``
  (per finished request: (e2e - TTFT) / (output tokens - 1), the TPOT of benchmarks),
  ``kvserve:e2e_request_latency_seconds``, ``kvserve:request_queue_time_seconds`` (arrival to
  first scheduling)
* gauges: ``kvserve:num_requests_running``, ``kvserve:num_requests_waiting`` (engine
  sequences, so a request with n=2 counts twice), ``kvserve:kv_cache_usage_perc``
  (fraction of KV blocks held by live requests, 0..1, as in vLLM)
* counters: ``kvserve:prefix_cache_queries`` / ``kvserve:prefix_cache_hits`` (tokens),
  ``kvserve:num_preemptions``, ``kvserve:prompt_tokens`` (every prompt token of each prefilled
  request, cached ones included, as vLLM), ``kvserve:prompt_tokens_by_source`` (label ``source``:
  ``local_compute`` | ``local_cache_hit``, vLLM's), ``kvserve:prompt_tokens_cached``,
  ``kvserve:prompt_tokens_computed`` (prompt tokens the steps computed, recompute after
  preemption included), ``kvserve:generation_tokens``, ``kvserve:request_success``
  (completions finished, label ``finished_reason``: stop | length | abort | error)
* API-server gauges (set by ``attach_frontend``): ``kvserve:num_requests_admitted``
  (engine sequences the server admitted and still serves), ``kvserve:frontend_unfinished_requests``
  (requests the engine client still tracks); counter ``kvserve:num_requests_rejected_total``
  (429s from the ``--max-waiting-requests`` bound)
* speculative decoding counters (vLLM's names): ``kvserve:spec_decode_num_drafts`` (request
  verification steps with drafts), ``kvserve:spec_decode_num_draft_tokens``,
  ``kvserve:spec_decode_num_accepted_tokens``, ``kvserve:spec_decode_num_accepted_tokens_per_pos``
  (label ``position``, 0-based draft position); mean acceptance length = 1 + accepted / drafts
* bounded KV (``--kv-eviction-policy streaming|h2o``): ``kvserve:kv_evicted_blocks`` and
  ``kvserve:kv_evicted_tokens`` (blocks / token slots freed by eviction, cumulative)
* KV transfer between engines (``P2PKVConnector``): ``kvserve:kv_transfer_bytes_total``,
  ``kvserve:kv_transfer_requests_total``, ``kvserve:kv_transfer_failures_total``,
  ``kvserve:kv_transfer_auth_failures_total`` (connections or pulls refused for a wrong or
  missing internal secret) and the ``kvserve:kv_transfer_seconds`` histogram (per transfer, seconds)
* mixture-of-experts models: counter ``kvserve:moe_expert_tokens_total`` (label ``expert``: tokens
  routed to each expert, summed over the MoE layers; a token counts once per selected expert
  per layer) and gauge ``kvserve:moe_expert_load_imbalance`` (max / mean of the per-expert tokens
  routed since the previous update: 1.0 is perfectly balanced)
* KV events (``--kv-events-config``): ``kvserve:kv_events_published`` and
  ``kvserve:kv_events_dropped`` (events handed to the ZMQ socket / dropped on a full queue)
* the API process's own ``process_*`` metrics (``process_resident_memory_bytes``, ...),
  when the ``registry`` is private (the default)
"""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from kvserve.engine.stat_logger import StatLogger

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0]
_ITL_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0]
# vLLM's buckets of time_per_output_token_seconds / request_time_per_output_token_seconds.
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
_E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0]
_XFER_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class PrometheusStatLogger(StatLogger):
    """Feeds the metrics from ``AsyncLLM``'s hooks. ``render()`` gives the exposition text.

    ``engine``: None (one engine core, no ``engine`` label) or 0 (data parallel: this object is
    engine core 0's logger; ``for_engine(i)`` gives core i's). ``attach_frontend`` applies to
    the object built by the caller, not to ``for_engine`` views.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None, *,
                 engine: Optional[int] = None, _families: Optional[dict] = None) -> None:
        view = _families is not None  # another engine's view of an existing logger's families
        own = registry is None
        self.registry = registry if registry is not None else CollectorRegistry()
        if own and not view:
            ProcessCollector(registry=self.registry)
        self.model_name, self.engine = model_name, engine
        # With data parallelism every engine-side series carries ``engine="<index>"`` (vLLM's label).
        lab = ["model_name"] + (["engine"] if engine is not None else [])
        self._lv = [model_name] + ([str(engine)] if engine is not None else [])
        self._families = fams = _families if view else {}
        r = self.registry

        def family(cls: Any, name: str, doc: str, extra: tuple = (), **kw: Any) -> Any:
            if name not in fams:
                fams[name] = cls(f"kvserve:{name}", doc, lab + list(extra), registry=r, **kw)
            return fams[name]

        def hist(name: str, doc: str, buckets: list[float]) -> Any:
            return family(Histogram, name, doc, buckets=buckets).labels(*self._lv)

        def gauge(name: str, doc: str) -> Any:
            return family(Gauge, name, doc).labels(*self._lv)

        def counter(name: str, doc: str) -> Any:
            return family(Counter, name, doc).labels(*self._lv)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, seconds.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between tokens of one completion, seconds.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish, seconds.", _E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduling, seconds.", _E2E_BUCKETS)
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.pc_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.pc_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.pc_recompute_hits = counter("prefix_cache_recompute_hits",
                                         "Tokens a preempted request found cached on its own recompute.")
        self.preemptions = counter("num_preemptions", "Preemptions of running sequences.")
        self.tpot = hist("time_per_output_token_seconds", "Time per output token (each interval between "
                         "tokens of one completion), seconds.", _TPOT_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds", "Per finished completion: (e2e - "
                                 "TTFT) / (output tokens - 1), seconds.", _TPOT_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of prefilled requests, cached ones included.")
        self.prompt_by_source = family(Counter, "prompt_tokens_by_source", "Prompt tokens by source: "
                                        "local_compute | local_cache_hit.", ("source",))
        self.prompt_cached = counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self.prompt_computed = counter("prompt_tokens_computed", "Prompt tokens computed by the steps "
                                                                 "(recompute after preemption included).")
        self.gen_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = family(Counter, "request_success", "Completions finished, by finish reason.",
                              ("finished_reason",))
        self.spec_drafts = counter("spec_decode_num_drafts", "Request steps that verified draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = family(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position (0-based).",
                                             ("position",))
        self._last = {"q": 0, "h": 0, "p": 0, "rh": 0, "sd": 0, "sdt": 0, "sa": 0, "rc": 0}
        self._last_per_pos: list[int] = []
        self.recomputed = counter("num_recomputed_tokens", "Tokens computed again for preempted requests.")
        self.evicted_blocks = counter("kv_evicted_blocks", "KV blocks freed by bounded-KV eviction "
                                                           "(--kv-eviction-policy streaming|h2o).")
        self.evicted_tokens = counter("kv_evicted_tokens", "Token slots freed by bounded-KV eviction.")
        self._last.update(eb=0, et=0)
        tl = ("tier",)
        self.tier_hits = family(Counter, "kv_tier_hit_tokens", "Prompt tokens loaded from a KV tier.", tl)
        self.tier_stored = family(Counter, "kv_tier_stored_blocks", "KV blocks written to a tier.", tl)
        self.tier_loaded = family(Counter, "kv_tier_loaded_blocks", "KV blocks loaded from a tier.", tl)
        self.tier_bytes_stored = counter("kv_tier_cpu_stored_bytes", "Bytes written to the CPU tier.")
        self.tier_bytes_loaded = counter("kv_tier_cpu_loaded_bytes", "Bytes loaded from the CPU tier.")
        self.tier_usage = gauge("kv_tier_cpu_usage_perc", "Fraction of CPU tier blocks holding KV (0..1).")
        self.tier_queries = counter("kv_tier_queries", "Requests that looked past the device prefix cache.")
        self._tier_last: dict[str, float] = {}
        # KV transfer between engines (P2PKVConnector): both roles count their side.
        self.xfer_bytes = counter("kv_transfer_bytes", "KV bytes moved between engines (sent or received).")
        self.xfer_requests = counter("kv_transfer_requests", "KV transfers between engines started (pulls "
                                                             "made or served).")
        self.xfer_failures = counter("kv_transfer_failures", "KV pulls that failed (recomputed or aborted).")
        self.xfer_auth_failures = counter("kv_transfer_auth_failures", "KV transfer connections or pulls refused "
                                          "for a wrong or missing internal secret.")
        self.xfer_seconds = hist("kv_transfer_seconds", "Duration of one KV transfer between engines, seconds "
                                 "(a step's transfers observed at their mean).", _XFER_BUCKETS)
        self._xfer_last = dict(b=0.0, r=0.0, f=0.0, a=0.0, n=0.0, s=0.0)
        self._frontend: Optional[tuple] = None
        self.kv_events_published = counter("kv_events_published", "KV cache events (BlockStored / BlockRemoved / "
                                                                   "AllBlocksCleared) published on the ZMQ socket.")
        self.kv_events_dropped = counter("kv_events_dropped", "KV cache events dropped (publisher queue full).")
        self._last.update(kep=0, ked=0)
        if not view:  # the API server's own series: one per server, no engine label
            fe = {"model_name": model_name}
            self.admitted = Gauge("kvserve:num_requests_admitted", "Engine sequences admitted by the API server, "
                                  "not finished yet.", list(fe), registry=r).labels(**fe)
            self.frontend_unfinished = Gauge("kvserve:frontend_unfinished_requests", "Requests the engine client "
                                             "still waits on.", list(fe), registry=r).labels(**fe)
            self.rejected = Counter("kvserve:num_requests_rejected", "Requests rejected with 429 (queue full).",
                                    list(fe), registry=r).labels(**fe)
        self._rejected_seen = 0
        self._views: dict[int, PrometheusStatLogger] = {} if engine is None else {engine: self}
        self.moe_expert_tokens = family(Counter, "moe_expert_tokens", "MoE: tokens routed to each expert, summed "
                                         "over the MoE layers.", ("expert",))
        self.moe_imbalance = gauge("moe_expert_load_imbalance", "MoE: max / mean tokens per expert since the "
                                                                "previous update (1.0: balanced).")
        self._moe_last: list[int] = []

    def set_engine_info(self, config: Any, num_blocks: int) -> None:
        """``kvserve:engine_config_info`` (value 1, as vLLM's ``cache_config_info``): the KV
        layout and the parallel layout as labels, from the resolved ``EngineConfig``."""
        pc, cc = config.parallel_config, config.cache_config
        labels = {"model_name": self.model_name, "block_size": str(cc.block_size),
                  "num_gpu_blocks": str(num_blocks), "kv_cache_dtype": str(cc.kv_cache_dtype),
                  "tensor_parallel_size": str(pc.tensor_parallel_size),
                  "distributed_executor_backend": str(pc.distributed_executor_backend or "uni")}
        if self.engine is not None:
            labels.update(engine=str(self.engine),
                          data_parallel_size=str(getattr(pc, "data_parallel_size", 1)))
        if "engine_config_info" not in self._families:
            self._families["engine_config_info"] = Gauge(
                "kvserve:engine_config_info", "Engine layout (labels); num_gpu_blocks is per rank.",
                list(labels), registry=self.registry)
        self._families["engine_config_info"].labels(**labels).set(1)

    def for_engine(self, index: int) -> "PrometheusStatLogger":
        """The logger of data-parallel engine core ``index``: the same registry and metric
        families, series labelled ``engine="<index>"``, its own counter baselines (each core
        reports its own cumulative stats). Needs a logger built with ``engine=0``.

        Raises:
            ValueError: this logger has no engine label (built with ``engine=None``).
        """
        if self.engine is None:
            raise ValueError("for_engine needs a logger built with engine=0 (data-parallel series)")
        if index not in self._views:
            self._views[index] = PrometheusStatLogger(self.model_name, self.registry, engine=index,
                                                      _families=self._families)
            self._views[index]._views = self._views
        return self._views[index]

    def attach_frontend(self, admitted, rejected, unfinished) -> None:
        """Callables read at every ``render()``: admitted sequences, rejections so far, and
        requests the engine client still tracks."""
        self._frontend = (admitted, rejected, unfinished)

    def _inc_cumulative(self, key: str, counter: Any, value: int) -> None:
        delta = value - self._last[key]
        if delta > 0:
            counter.inc(delta)
        self._last[key] = max(value, self._last[key])

    def on_step(self, stats: Any, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self._inc_cumulative("q", self.pc_queries, stats.prefix_cache_queries)
        self._inc_cumulative("h", self.pc_hits, stats.prefix_cache_hits)
        self._inc_cumulative("rh", self.pc_recompute_hits, getattr(stats, "prefix_cache_recompute_hits", 0))
        self._inc_cumulative("p", self.preemptions, stats.num_preemptions)
        self._inc_cumulative("sd", self.spec_drafts, getattr(stats, "num_drafts", 0))
        self._inc_cumulative("sdt", self.spec_draft_tokens, getattr(stats, "num_draft_tokens", 0))
        self._inc_cumulative("sa", self.spec_accepted, getattr(stats, "num_accepted_tokens", 0))
        per_pos = list(getattr(stats, "num_accepted_tokens_per_pos", None) or [])
        if len(self._last_per_pos) < len(per_pos):
            self._last_per_pos += [0] * (len(per_pos) - len(self._last_per_pos))
        for j, v in enumerate(per_pos):
            if v > self._last_per_pos[j]:
                self.spec_accepted_per_pos.labels(*self._lv, str(j)).inc(v - self._last_per_pos[j])
                self._last_per_pos[j] = v
        self._inc_cumulative("rc", self.recomputed, getattr(stats, "num_recomputed_tokens", 0))
        self._inc_cumulative("eb", self.evicted_blocks, getattr(stats, "num_evicted_blocks", 0))
        self._inc_cumulative("et", self.evicted_tokens, getattr(stats, "num_evicted_tokens", 0))
        kve = getattr(stats, "kv_events", None)
        if kve:
            self._inc_cumulative("kep", self.kv_events_published, kve.get("published", 0))
            self._inc_cumulative("ked", self.kv_events_dropped, kve.get("dropped", 0))
        tier = getattr(stats, "kv_tier", None)
        if tier and "kv_transfer_bytes" in tier:
            self._on_transfer_stats(tier)
        elif tier:
            lv = self._lv
            for key, c in (("hit_tokens", self.tier_hits.labels(*lv, "cpu")),
                           ("disk_hit_tokens", self.tier_hits.labels(*lv, "disk")),
                           ("blocks_stored", self.tier_stored.labels(*lv, "cpu")),
                           ("disk_blocks_stored", self.tier_stored.labels(*lv, "disk")),
                           ("blocks_loaded", self.tier_loaded.labels(*lv, "cpu")),
                           ("disk_blocks_loaded", self.tier_loaded.labels(*lv, "disk")),
                           ("bytes_stored", self.tier_bytes_stored), ("bytes_loaded", self.tier_bytes_loaded),
                           ("queries", self.tier_queries)):
                delta = tier.get(key, 0) - self._tier_last.get(key, 0)
                if delta > 0:
                    c.inc(delta)
                self._tier_last[key] = max(tier.get(key, 0), self._tier_last.get(key, 0))
            self.tier_usage.set(tier.get("blocks_used", 0) / max(tier.get("blocks_total", 1), 1))
        moe = getattr(stats, "moe_expert_tokens", None)
        if moe:
            self._on_expert_tokens(list(moe))
        if num_prompt_tokens > 0:
            self.prompt_computed.inc(num_prompt_tokens)
        if num_generation_tokens > 0:
            self.gen_tokens.inc(num_generation_tokens)

    def _on_expert_tokens(self, counts: list[int]) -> None:
        last = self._moe_last if len(self._moe_last) == len(counts) else [0] * len(counts)
        delta = [max(c - p, 0) for c, p in zip(counts, last)]
        for e, d in enumerate(delta):
            if d:
                self.moe_expert_tokens.labels(*self._lv, str(e)).inc(d)
        if sum(delta):
            self.moe_imbalance.set(max(delta) * len(delta) / sum(delta))
        self._moe_last = [max(c, p) for c, p in zip(counts, last)]

    def _on_transfer_stats(self, s: dict) -> None:
        last = self._xfer_last
        for key, name, c in (("b", "kv_transfer_bytes", self.xfer_bytes),
                             ("r", "kv_transfer_requests", self.xfer_requests),
                             ("f", "kv_transfer_failures", self.xfer_failures),
                             ("a", "kv_auth_failures", self.xfer_auth_failures)):
            v = float(s.get(name, 0))
            if v > last[key]:
                c.inc(v - last[key])
                last[key] = v
        n, sec = float(s.get("kv_transfers", 0)), float(s.get("kv_transfer_seconds", 0.0))
        if n > last["n"]:
            mean = max(sec - last["s"], 0.0) / (n - last["n"])
            for _ in range(int(n - last["n"])):
                self.xfer_seconds.observe(mean)
            last["n"], last["s"] = n, sec

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(max(ttft_s, 0.0))

    def on_inter_token(self, itl_s: float) -> None:
        self.itl.observe(max(itl_s, 0.0))
        self.tpot.observe(max(itl_s, 0.0))

    def on_prefill_done(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        cached = min(max(num_cached_tokens, 0), num_prompt_tokens)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_cached.inc(cached)
        self.prompt_by_source.labels(*self._lv, "local_cache_hit").inc(cached)
        self.prompt_by_source.labels(*self._lv, "local_compute").inc(num_prompt_tokens - cached)

    def on_finished(self, finish_reason: str, e2e_s: float, queue_s: Optional[float],
                    num_prompt_tokens: int, num_generation_tokens: int, ttft_s: Optional[float] = None) -> None:
        self.e2e.observe(max(e2e_s, 0.0))
        if ttft_s is not None and num_generation_tokens > 1:
            self.request_tpot.observe(max(e2e_s - ttft_s, 0.0) / (num_generation_tokens - 1))
        if queue_s is not None:
            self.queue.observe(max(queue_s, 0.0))
        self.success.labels(*self._lv, finish_reason).inc()

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        if self._frontend is not None:
            admitted, rejected, unfinished = self._frontend
            self.admitted.set(admitted())
            self.frontend_unfinished.set(unfinished())
            r = rejected()
            if r > self._rejected_seen:
                self.rejected.inc(r - self._rejected_seen)
                self._rejected_seen = r
        return generate_latest(self.registry)
