"""``kvserve bench serve`` / ``latency`` against a fake streaming OpenAI server (no model).

The fake server (Starlette + uvicorn in a thread on 127.0.0.1) streams ``max_tokens``
chunks: the first after ``first_delay`` s, then one every ``gap`` s, then a usage chunk and
``[DONE]``. Prompts containing ``FAIL`` get HTTP 500. With ``"token_only": true`` in the body
it streams what a server without a tokenizer does: empty text plus ``token_ids`` (and one
chunk with neither first). It records every request body and the peak number of requests
in flight. Timing asserts use wide ranges (loaded 2-core box).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import threading
import time
from types import SimpleNamespace

import pytest

from kvserve.bench import report, serve, serve_client
from kvserve.bench.serve_client import RequestResult, arrival_gaps
from kvserve.entrypoints import cli

FIRST_DELAY = 0.05
GAP = 0.01


class FakeState:
    def __init__(self):
        self.reset()

    def reset(self, first_delay=FIRST_DELAY, gap=GAP):
        self.first_delay, self.gap = first_delay, gap
        self.active = self.peak = 0
        self.bodies: list[dict] = []
        self.lock = threading.Lock()


def _make_app(state: FakeState):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(request):
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        state.bodies.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if isinstance(prompt, str) and "FAIL" in prompt:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        n = int(body["max_tokens"])
        token_only = bool(body.get("token_only"))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())

        async def gen():
            with state.lock:
                state.active += 1
                state.peak = max(state.peak, state.active)
            try:
                if chat:  # a role-only chunk first: it must not count as the first token
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
                if token_only:  # no text, no ids: not output either
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": []}]}) + "\n\n"
                for i in range(n):
                    await asyncio.sleep(state.first_delay if i == 0 else state.gap)
                    piece = f"w{i} "
                    if token_only:
                        ch = {"index": 0, "text": "", "token_ids": [100 + i]}
                    else:
                        ch = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                    yield "data: " + json.dumps({"choices": [ch]}) + "\n\n"
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                with state.lock:
                    state.active -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", complete, methods=["POST"]),
                             Route("/v1/chat/completions", complete, methods=["POST"])])


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    state = FakeState()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(_make_app(state), host="127.0.0.1", port=port, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", state=state)
    server.should_exit = True
    th.join(timeout=5)


@pytest.fixture
def srv(fake_server):
    fake_server.state.reset()
    return fake_server


def _argv(srv, *extra):
    return ["bench", "serve", "--base-url", srv.url, "--disable-tqdm", "--num-warmups", "0", *extra]


def _single(srv, endpoint, prompt, max_tokens, messages=None, extra_body=None) -> RequestResult:
    import httpx

    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            payload = serve_client.build_payload(endpoint, "fake-model", prompt, messages, max_tokens, extra_body)
            return await serve_client.send_request(c, srv.url + endpoint, endpoint, payload, 0)

    return asyncio.run(go())


# ----------------------------------------------------------------------------- one request

@pytest.mark.parametrize("endpoint", serve_client.ENDPOINTS)
def test_single_request_timings(srv, endpoint):
    n = 8
    r = _single(srv, endpoint, "hello there", n)
    assert r.success, r.error
    assert r.output_tokens == n and r.prompt_tokens == 2  # from the server's usage
    assert r.text == "".join(f"w{i} " for i in range(n))
    # Sleeps give lower bounds only; the upper bounds just catch a wrong unit (a loaded box
    # stretches every wall time). TTFT measured at the end would leave no decode time.
    assert FIRST_DELAY * 0.9 <= r.ttft < 5
    assert r.e2el - r.ttft >= (n - 1) * GAP * 0.9
    assert len(r.itl) == n - 1
    assert GAP * 0.8 <= statistics.median(r.itl) < 5
    assert r.e2el >= (FIRST_DELAY + (n - 1) * GAP) * 0.9
    assert r.tpot == pytest.approx((r.e2el - r.ttft) / (n - 1))
    assert sum(r.itl) <= r.e2el - r.ttft + 1e-6  # e2el also waits for the usage chunk
    body = srv.state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == n


def test_token_id_only_stream_counts_as_output(srv):
    # A server without a tokenizer (kvserve serve --skip-tokenizer-init) streams empty text
    # with token_ids: those chunks are the output; a chunk with neither is not.
    r = _single(srv, serve_client.COMPLETIONS, [1, 2, 3], 5, extra_body={"token_only": True})
    assert r.success, r.error
    assert r.output_tokens == 5 and r.text == "" and len(r.itl) == 4
    # from the first id-carrying chunk, not the empty one sent at once
    assert FIRST_DELAY * 0.9 <= r.ttft and r.e2el - r.ttft >= 4 * GAP * 0.9
    assert r.tpot is not None


def test_server_error_and_connection_error_are_failures(srv):
    r = _single(srv, serve_client.COMPLETIONS, "please FAIL", 4)
    assert not r.success and "500" in r.error
    r2 = _single(SimpleNamespace(url="http://127.0.0.1:9"), serve_client.COMPLETIONS, "x", 4)
    assert not r2.success and r2.error


def test_parse_rates():
    assert serve.parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "1,0", "-1", "fast"):
        with pytest.raises(ValueError):
            serve.parse_rates(bad)


def test_chat_needs_text_prompt():
    with pytest.raises(ValueError, match="completions"):
        serve_client.build_payload(serve_client.CHAT_COMPLETIONS, "m", [1, 2, 3], None, 4)


# ----------------------------------------------------------------------------- arrivals

def test_poisson_arrivals_seeded_and_mean_rate():
    a = arrival_gaps(4000, 10.0, seed=3)
    assert a == arrival_gaps(4000, 10.0, seed=3)
    assert a != arrival_gaps(4000, 10.0, seed=4)
    assert 1 / statistics.mean(a) == pytest.approx(10.0, rel=0.06)
    assert statistics.stdev(a) / statistics.mean(a) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = arrival_gaps(4000, 10.0, burstiness=0.25, seed=3)
    assert 1 / statistics.mean(bursty) == pytest.approx(10.0, rel=0.15)
    assert statistics.stdev(bursty) / statistics.mean(bursty) == pytest.approx(2.0, rel=0.15)  # CV 1/sqrt(k)
    assert arrival_gaps(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0)


def test_run_sessions_follows_the_schedule():
    sent = []

    async def send(i):
        sent.append(time.perf_counter())
        return RequestResult(success=True)

    def sess(i):
        async def run(s):
            return [await s(i)]
        return run

    gaps = arrival_gaps(20, 40.0, seed=1)
    t0 = time.perf_counter()
    _, dur = asyncio.run(serve_client.run_sessions([sess(i) for i in range(20)], send, request_rate=40.0, seed=1))
    offsets = [t - t0 for t in sent]
    assert offsets == sorted(offsets)
    assert dur >= sum(gaps) * 0.95
    assert dur <= sum(gaps) + 0.5


# ----------------------------------------------------------------------------- metrics

def _res(ttft, e2el, n_out, ok=True):
    return RequestResult(success=ok, error="" if ok else "x", prompt_tokens=10, output_tokens=n_out,
                         ttft=ttft, e2el=e2el, itl=[(e2el - ttft) / max(1, n_out - 1)] * (n_out - 1))


def test_metrics_and_goodput():
    rs = [_res(0.1, 1.1, 11), _res(0.3, 1.3, 11), _res(0.1, 3.1, 11), _res(0, 0, 0, ok=False)]
    m = report.compute_metrics(rs, 2.0, {"ttft": 200, "tpot": 150})
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(33 / 2)
    assert m["total_token_throughput"] == pytest.approx(63 / 2)
    # request 0: ttft 100, tpot 100 -> ok; 1: ttft 300 -> no; 2: tpot 300 -> no; failed -> no
    assert m["goodput"] == pytest.approx(0.5)
    assert m["mean_ttft_ms"] == pytest.approx(500 / 3)
    assert m["median_tpot_ms"] == pytest.approx(100)
    assert m["p99_e2el_ms"] == pytest.approx(report.percentile([1100, 1300, 3100], 99))
    assert report.compute_metrics(rs, 2.0)["goodput"] is None
    assert report.parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["foo:1"], ["ttft"], ["ttft:-1"], ["tpot:abc"]):
        with pytest.raises(ValueError):
            report.parse_goodput(bad)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.5, 2.25]
    for q in (0, 50, 90, 99, 100):
        assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_markdown_table_fields():
    m = report.compute_metrics([_res(0.1, 1.1, 11)], 1.0, {"ttft": 500})
    m["request_rate"] = math.inf
    t = report.markdown_table([dict(m, request_rate=2.0), m]).splitlines()
    assert len(t) == 4 and t[1].startswith("|---:")
    for col in ("rate (req/s)", "TTFT p50", "TPOT p99", "ITL p50", "E2EL p99", "goodput (req/s)", "out tok/s", "failed"):
        assert col in t[0]
    assert t[2].startswith("| 2.00 |") and t[3].startswith("| inf |")


# ----------------------------------------------------------------------------- CLI end to end

def test_cli_sweep_json_markdown_plots(srv, tmp_path, capsys):
    out = tmp_path / "res" / "serve.json"
    plots = tmp_path / "plots"
    argv = _argv(srv, "--dataset", "random", "--num-prompts", "6", "--input-len", "4:8", "--output-len", "5",
                 "--sweep", "inf,30", "--goodput", "ttft:20000", "tpot:10000", "--save-result", str(out),
                 "--plot", str(plots), "--save-detailed", "--seed", "1")
    try:
        import matplotlib  # noqa: F401
        has_mpl = True
    except ImportError:
        has_mpl = False
        argv = argv[:argv.index("--plot")] + argv[argv.index("--plot") + 2:]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "| rate (req/s) |" in text and "model=fake-model" in text
    res = json.loads(out.read_text())
    assert set(res) >= {"env", "command", "config", "runs"}
    assert res["env"]["git_commit"] is None or len(res["env"]["git_commit"]) == 40
    assert "python" in res["env"]["versions"] and "httpx" in res["env"]["versions"]
    assert res["command"].startswith("kvserve bench serve")
    assert res["config"]["model"] == "fake-model" and res["config"]["request_rates"] == ["inf", 30.0]
    assert [r["request_rate"] for r in res["runs"]] == ["inf", 30.0]
    for run in res["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == 30
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # loose SLOs: all meet them
        for k in ("mean", "median", "p90", "p99"):
            for name in ("ttft", "tpot", "itl", "e2el"):
                assert isinstance(run[f"{k}_{name}_ms"], float)
        assert len(run["per_request"]) == 6
        # lower bounds from the server's sleeps; TTFT ends before the 4 decode gaps
        assert FIRST_DELAY * 900 <= run["median_ttft_ms"] < 5000
        assert run["median_e2el_ms"] - run["median_ttft_ms"] >= 4 * GAP * 900
    # random prompts go as token-id lists of the asked lengths
    prompts = [b["prompt"] for b in srv.state.bodies]
    assert all(isinstance(p, list) and 4 <= len(p) <= 8 for p in prompts)
    assert sorted(prompts[:6]) == sorted(prompts[6:])  # the same workload at every rate
    md = out.with_suffix(".md").read_text()
    assert md.count("\n| ") == 3  # header + 2 rows (one per rate)
    if has_mpl:
        names = sorted(p.name for p in plots.iterdir())
        assert names == ["throughput_vs_qps.png", "tpot_vs_qps.png", "ttft_vs_qps.png"]
        assert all((plots / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    from kvserve.bench.plots import plot_sweep

    m = report.compute_metrics([_res(0.1, 1.1, 11)], 1.0)
    paths = plot_sweep([dict(m, request_rate=1.0), dict(m, request_rate=math.inf, request_throughput=3.0)],
                       str(tmp_path))
    assert len(paths) == 3 and all(open(p, "rb").read(4) == b"\x89PNG" for p in paths)


def test_max_concurrency_respected(srv):
    srv.state.reset(first_delay=0.03, gap=0.005)
    ns = cli.build_parser().parse_args(_argv(srv, "--model", "fake-model", "--num-prompts", "10",
                                             "--input-len", "3", "--output-len", "4", "--max-concurrency", "3"))
    assert ns.func(ns) == 0
    assert srv.state.peak == 3  # 10 requests at once, never more than 3 in flight
    srv.state.reset(first_delay=0.03, gap=0.005)
    ns = cli.build_parser().parse_args(_argv(srv, "--model", "fake-model", "--num-prompts", "10",
                                             "--input-len", "3", "--output-len", "4"))
    assert ns.func(ns) == 0
    assert srv.state.peak > 3


def test_warmup_requests_untimed(srv):
    argv = [a for a in _argv(srv, "--model", "fake-model", "--num-prompts", "2", "--input-len", "3",
                              "--output-len", "2", "--sweep", "inf,inf") if a not in ("--num-warmups", "0")]
    ns = cli.build_parser().parse_args(argv)
    assert ns.num_warmups == 1 and ns.func(ns) == 0
    prompts = [b["prompt"] for b in srv.state.bodies]
    assert len(prompts) == 5  # once, before the first rate only
    # random (token-id) workload: token-id warm-ups (a tokenizer-less server takes them), the
    # workload's prompts reversed; 4 output tokens
    assert prompts[0] == prompts[1][::-1] or prompts[0] == prompts[2][::-1]
    assert srv.state.bodies[0]["max_tokens"] == 4
    assert [r["num_requests"] for r in ns.result["runs"]] == [2, 2]
    # text workloads: text warm-ups
    srv.state.reset()
    argv = [a for a in _argv(srv, "--model", "fake-model", "--dataset", "shared-prefix", "--num-prompts", "2",
                              "--num-prefixes", "1", "--questions-per-prefix", "2", "--prefix-len", "3",
                              "--input-len", "3", "--output-len", "2") if a not in ("--num-warmups", "0")]
    ns = cli.build_parser().parse_args(argv)
    assert ns.func(ns) == 0
    assert srv.state.bodies[0]["prompt"].startswith("Warm-up") and len(srv.state.bodies) == 3


def test_prompts_for_rate():
    assert serve.prompts_for_rate(1.0, 30, 32, 500) == 32  # the floor
    assert serve.prompts_for_rate(2.0, 30, 32, 500) == 60
    assert serve.prompts_for_rate(64.0, 30, 32, 500) == 1920
    assert serve.prompts_for_rate(0.5, 5, 1, None) == 2  # round(2.5) -> 2
    assert serve.prompts_for_rate(math.inf, 30, 32, 500) == 500
    assert serve.prompts_for_rate(math.inf, 30, 32, None) is None  # the dataset's default


def test_cli_sweep_duration_scales_prompts(srv, tmp_path, capsys):
    srv.state.reset(first_delay=0.005, gap=0.002)
    out = tmp_path / "sweep.json"
    argv = _argv(srv, "--model", "fake-model", "--input-len", "4:8", "--output-len", "3", "--sweep", "40,10,inf",
                 "--sweep-duration", "0.25", "--sweep-min-prompts", "4", "--num-prompts", "3", "--seed", "7",
                 "--save-result", str(out))
    assert cli.main(argv) == 0
    assert "40: 10, 10: 4, inf: 3 requests" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [r["num_requests"] for r in res["runs"]] == [10, 4, 3]  # round(40 x 0.25), the floor 4, --num-prompts
    assert [r["completed"] for r in res["runs"]] == [10, 4, 3]
    assert [r["workload_seed"] for r in res["runs"]] == [7, 8, 9]
    assert res["config"]["sweep_duration_s"] == 0.25 and res["config"]["sweep_min_prompts"] == 4
    bodies = [b["prompt"] for b in srv.state.bodies]
    assert len(bodies) == 17
    # a fresh workload per rate: no prompt of one rate is sent again at another
    assert len({tuple(p) for p in bodies}) == 17
    # the same flags give the same workloads
    first = bodies[:10]
    srv.state.reset(first_delay=0.005, gap=0.002)
    assert cli.main(argv) == 0
    assert sorted(b["prompt"] for b in srv.state.bodies[:10]) == sorted(first)
    # bad values
    assert cli.main(argv + ["--sweep-duration", "0"]) == 2
    assert cli.main(argv + ["--sweep-min-prompts", "0"]) == 2


def test_interrupted_sweep_keeps_finished_rates(srv, tmp_path, monkeypatch):
    out = tmp_path / "sweep.json"
    real = serve.benchmark
    calls = []

    async def flaky(workload, **kw):
        calls.append(kw["request_rate"])
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. timeout -s INT at the deadline
        return await real(workload, **kw)

    monkeypatch.setattr(serve, "benchmark", flaky)
    argv = _argv(srv, "--model", "fake-model", "--input-len", "3", "--output-len", "2", "--num-prompts", "3",
                 "--sweep", "inf,50,20", "--save-result", str(out))
    assert cli.main(argv) == 130
    res = json.loads(out.read_text())
    assert [r["request_rate"] for r in res["runs"]] == ["inf"] and res["runs"][0]["completed"] == 3
    md = out.with_suffix(".md").read_text()
    assert md.count("\n| ") == 2  # header + the finished rate
    # and the saved JSON re-plots
    pytest.importorskip("matplotlib")
    from kvserve.bench import plots

    assert plots.main([str(out), str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "throughput_vs_qps.png", "tpot_vs_qps.png", "ttft_vs_qps.png"]
    assert plots.main([str(tmp_path / "missing.json"), str(tmp_path / "p2")]) == 2


def test_git_commit_falls_back_to_env(monkeypatch):
    from kvserve.bench import env as bench_env

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench_env.subprocess, "run", no_git)
    monkeypatch.setenv("KVSERVE_COMMIT", "abc123")
    assert bench_env.git_commit() == "abc123"
    monkeypatch.delenv("KVSERVE_COMMIT")
    assert bench_env.git_commit() is None
    env = report.env_info()
    assert "triton" in env["versions"] or pytest.importorskip("triton") is None


def test_failures_counted(srv, tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "good one", "output_len": 3}, {"prompt": "this will FAIL"},
             {"prompt": [5, 6, 7], "output_len": 2}, {"prompt": "FAIL again", "output_len": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ns = cli.build_parser().parse_args(_argv(srv, "--model", "fake-model", "--dataset", "jsonl",
                                             "--dataset-path", str(path), "--output-len", "4"))
    assert ns.func(ns) == 0
    run = ns.result["runs"][0]
    assert run["completed"] == 2 and run["failed"] == 2 and run["total_output_tokens"] == 5
    assert any("500" in e for e in run["errors"])
    assert sorted(len(b["prompt"]) if isinstance(b["prompt"], list) else 0 for b in srv.state.bodies)[-1] == 3
    # all failing: non-zero exit status
    path.write_text(json.dumps({"prompt": "FAIL"}) + "\n")
    assert cli.main(_argv(srv, "--model", "m", "--dataset", "jsonl", "--dataset-path", str(path))) == 1


def test_multi_turn_chat_history(srv):
    srv.state.reset(first_delay=0.005, gap=0.002)
    ns = cli.build_parser().parse_args(_argv(srv, "--model", "fake-model", "--endpoint", "/v1/chat/completions",
                                             "--dataset", "multi-turn", "--num-prompts", "3", "--num-turns", "3",
                                             "--input-len", "3:5", "--output-len", "2", "--prefix-len", "0",
                                             "--request-rate", "50"))
    assert ns.func(ns) == 0
    assert ns.result["runs"][0]["completed"] == 9
    bodies = srv.state.bodies
    assert len(bodies) == 9
    by_first = {}
    for b in bodies:
        by_first.setdefault(b["messages"][0]["content"], []).append(b["messages"])
    assert len(by_first) == 3
    for convs in by_first.values():
        convs.sort(key=len)
        assert [len(c) for c in convs] == [1, 3, 5]
        for prev, nxt in zip(convs, convs[1:]):
            assert nxt[:len(prev)] == prev  # each turn's history is the next turn's prefix
            assert nxt[len(prev)] == {"role": "assistant", "content": "w0 w1 "}  # the reply text


def test_multi_turn_completions_and_shared_prefix(srv):
    srv.state.reset(first_delay=0.005, gap=0.002)
    ns = cli.build_parser().parse_args(_argv(srv, "--model", "fake-model", "--dataset", "multi-turn",
                                             "--num-prompts", "2", "--num-turns", "2", "--output-len", "2",
                                             "--input-len", "3", "--prefix-len", "4"))
    assert ns.func(ns) == 0
    texts = sorted((b["prompt"] for b in srv.state.bodies), key=len)
    assert all(t.startswith("System: Conversation") and t.endswith("\nAssistant:") for t in texts)
    assert "Assistant: w0 w1 \nUser:" in texts[-1]

    srv.state.reset(first_delay=0.005, gap=0.002)
    ns = cli.build_parser().parse_args(_argv(srv, "--model", "fake-model", "--endpoint", "/v1/chat/completions",
                                             "--dataset", "shared-prefix", "--num-prefixes", "2",
                                             "--questions-per-prefix", "3", "--prefix-len", "10",
                                             "--output-len", "2", "--input-len", "3:6"))
    assert ns.func(ns) == 0
    assert ns.result["runs"][0]["completed"] == 6
    systems = [b["messages"][0]["content"] for b in srv.state.bodies]
    assert len(set(systems)) == 2 and all(systems.count(s) == 3 for s in set(systems))


def test_cli_usage_errors(srv, capsys):
    assert cli.main(_argv(srv, "--model", "m", "--dataset-name", "random", "--random-range-ratio", "1.5")) == 2
    assert cli.main(_argv(srv, "--model", "m", "--dataset-name", "sharegpt")) == 2  # needs --dataset-path
    assert cli.main(_argv(srv, "--model", "m", "--goodput", "ttfx:3")) == 2
    assert cli.main(_argv(srv, "--model", "m", "--sweep", "1,0")) == 2
    assert cli.main(_argv(srv, "--model", "m", "--dataset", "jsonl")) == 2
    assert cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--disable-tqdm"]) == 2  # no /v1/models
    assert "error:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bench latency

class _FakeEngine:
    def __init__(self):
        self.pending, self.added, self.n = {}, [], 0

    def add_request(self, rid, prompt, sp, priority=0):
        self.n += 1
        self.pending[str(self.n)] = sp.max_tokens
        self.added.append(list(prompt))
        return str(self.n)

    def step(self):
        time.sleep(0.001)
        outs = []
        for rid in list(self.pending):
            self.pending[rid] -= 1
            if self.pending[rid] == 0:
                del self.pending[rid]
                outs.append(SimpleNamespace(request_id=rid, finished=True))
        return outs

    def abort_request(self, rid):
        self.pending.pop(rid, None)


def test_bench_latency_fake_llm(monkeypatch, tmp_path, capsys):
    llm = SimpleNamespace(llm_engine=_FakeEngine(), get_tokenizer=lambda: list(range(500)))
    from kvserve.bench import env as bench_env

    monkeypatch.setattr(bench_env, "make_llm", lambda engine_args: llm)
    out = tmp_path / "lat.json"
    assert cli.main(["bench", "latency", "--batch-size", "3", "--input-len", "5", "--output-len", "4",
                     "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["batch_size"] == 3 and len(res["latencies_s"]) == 2
    assert res["ms_per_output_token"] == pytest.approx(res["latency_ms"]["mean"] / 4)
    assert res["decode_step_ms"]["median"] > 0 and "git_commit" in res["env"]
    eng = llm.llm_engine
    assert len(eng.added) == 9 and all(len(p) == 5 for p in eng.added)
    assert len({tuple(p) for p in eng.added}) == 9  # no prefix reuse across iterations
    assert "ms per output token" in capsys.readouterr().out


def test_vllm_command_line(srv, tmp_path, monkeypatch):
    """A vLLM user's command line runs unchanged: --backend/--host/--port, random on the chat
    endpoint, vLLM's --save-result switch with --result-dir (and its default file name)."""
    port = srv.url.rsplit(":", 1)[1]
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--host", "127.0.0.1", "--port", port, "--model", "fake-model", "--dataset-name", "random",
            "--random-input-len", "8", "--random-output-len", "4", "--random-range-ratio", "0.5",
            "--num-prompts", "5", "--request-rate", "inf", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(tmp_path / "res"),
            "--disable-tqdm", "--seed", "1"]
    srv.state.reset()
    assert cli.main(argv) == 0
    (path,) = (tmp_path / "res").glob("openai-chat-infqps-fake-model-*.json")
    res = json.loads(path.read_text())
    assert res["completed"] == 5 and "p99_ttft_ms" in res and "p50_e2el_ms" in res
    bodies = [b for b in srv.state.bodies if b["max_tokens"] != 4 or "messages" in b]
    assert all(isinstance(b["messages"][0]["content"], str) for b in srv.state.bodies)
    assert all(2 <= b["max_tokens"] <= 6 and b["ignore_eos"] for b in srv.state.bodies[1:])
    assert bodies
    # --result-filename; without --ignore-eos vLLM's default lets outputs stop at EOS.
    srv.state.reset()
    argv2 = [a for a in argv if a != "--ignore-eos"] + ["--result-filename", "r.json", "--backend", "vllm"]
    argv2[argv2.index("--endpoint") + 1] = "/v1/completions"
    assert cli.main(argv2) == 0
    assert (tmp_path / "res" / "r.json").is_file()
    assert all(b.get("ignore_eos") is False for b in srv.state.bodies)


def test_sharegpt_dataset(tmp_path):
    from kvserve.bench.datasets import load_sharegpt_requests

    data = [{"conversations": [{"from": "human", "value": "one two three four five"},
                               {"from": "gpt", "value": "a b c d e f"}]},
            {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a b c d"}]},
            {"conversations": [{"from": "human", "value": "only one turn here ok"}]},
            {"conversations": [{"from": "human", "value": "w x y z q"}, {"from": "gpt", "value": "1 2 3 4"}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = load_sharegpt_requests(str(p), 10, 0)
    assert sorted((r.prompt_text, r.output_len) for r in reqs) == [("one two three four five", 6), ("w x y z q", 4)]
    assert [r.output_len for r in load_sharegpt_requests(str(p), 1, 0, fixed_output_len=9)] == [9]
    p.write_text("{}")
    with pytest.raises(ValueError, match="ShareGPT"):
        load_sharegpt_requests(str(p), 1, 0)
