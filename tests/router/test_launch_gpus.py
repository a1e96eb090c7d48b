"""``kvserve launch`` on a multi-GPU host: one GPU set per worker (``--worker-gpus``), the KV
transport of P/D workers (``--kv-transport``), and tokenizer-less workers (token-id prompts, as
benchmarks/pd_goodput.py serves) behind the router.

The assignment is pure logic, tested directly; the end-to-end test runs a tiny random model on
the CPU, where ``CUDA_VISIBLE_DEVICES`` changes nothing but is still set per worker (read back
from each worker's ``/proc/PID/environ``), with the NIXL transport between host memories.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.server.router_helpers import free_port, p2p_connector_known, sse_events
from tests.utils import RemoteServer

from kvserve.router.launch import (
    assign_gpus, kv_transfer_config, parse_worker_gpus, visible_gpus, worker_argv,
)

httpx = pytest.importorskip("httpx")


def test_assign_gpus_rotates_own_set_first_and_keeps_the_rest_visible():
    assert assign_gpus(2, ["0", "1"]) == ["0,1", "1,0"]
    assert assign_gpus(4, ["0", "1"]) == ["0,1", "1,0", "0,1", "1,0"]  # round robin past the GPU count
    assert assign_gpus(2, ["4", "6", "7"]) == ["4,6,7", "6,4,7"]  # physical ids kept
    assert assign_gpus(2, ["0", "1", "2", "3"], per_worker=2) == ["0,1,2,3", "2,3,0,1"]
    assert assign_gpus(3, ["0", "1", "2"], per_worker=2) == ["0,1,2"] * 3  # one whole set of 2


def test_assign_gpus_leaves_the_environment_alone_when_there_is_nothing_to_choose():
    assert assign_gpus(2, []) == [None, None]
    assert assign_gpus(1, ["0"]) == [None]
    assert assign_gpus(2, ["0"], per_worker=2) == [None, None]  # fewer GPUs than one worker needs
    with pytest.raises(ValueError, match="GPUs per worker"):
        assign_gpus(2, ["0", "1"], per_worker=0)


def test_worker_gpus_flag(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert parse_worker_gpus("auto") == visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parse_worker_gpus("auto") == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "")  # no nvidia-smi: no GPUs
    assert visible_gpus() == []
    assert parse_worker_gpus("none") == []
    assert parse_worker_gpus("1,0") == ["1", "0"]
    for bad in ("", "a,b", "0,0", "-1"):
        with pytest.raises(ValueError, match="--worker-gpus"):
            parse_worker_gpus(bad)


def test_kv_transport_reaches_the_connector_config_and_launch_flags_stay_with_the_launcher():
    cfg = json.loads(kv_transfer_config("kv_consumer", "nixl"))
    assert cfg["kv_role"] == "kv_consumer" and cfg["kv_connector_extra_config"] == {"kv_port": 0, "transport": "nixl"}
    assert json.loads(kv_transfer_config("kv_producer"))["kv_connector_extra_config"]["transport"] == "tcp"
    assert worker_argv(["--kv-transport", "nixl", "--worker-gpus=0,1", "--prefill", "1", "M", "--dtype",
                        "float32"]) == ["M", "--dtype", "float32"]


def _worker_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


def _stream_ids(url: str, body: dict) -> list[int]:
    ids = []
    with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for obj in sse_events(r):
            for ch in obj["choices"]:
                assert ch["text"] == ""
                ids += ch["token_ids"]
    return ids


@pytest.mark.skipif(not p2p_connector_known(), reason="needs the KV connector (P2PKVConnector)")
def test_launch_pd_nixl_tokenizerless_workers_one_gpu_each(tmp_path):
    pytest.importorskip("nixl_cu13", reason="the NIXL wheel (setup.sh --test installs it)")
    import transformers

    model = str(tmp_path / "tiny")
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
                             architectures=["LlamaForCausalLM"]).save_pretrained(model)
    engine = [model, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len",
              "256", "--kv-cache-memory", "16MiB"]
    port = free_port()
    launch = RemoteServer(["launch", "--prefill", "1", "--decode", "1", "--kv-transport", "nixl", "--worker-gpus", "0,1",
                   "--policy", "round_robin", "--health-check-interval", "0.5", *engine],
                  str(tmp_path / "launch.log"), port=port).start()
    plain = RemoteServer(["serve", *engine, "--disable-access-log"], str(tmp_path / "plain.log")).start()
    try:
        launch.wait_ready(180)
        plain.wait_ready(180)
        log = launch.read_log()
        started = dict(re.findall(r"started (\w+) \(pid (\d+)\)", log))
        assert {k: _worker_env(int(v)).get("CUDA_VISIBLE_DEVICES") for k, v in started.items()} == \
            {"prefill0": "0,1", "decode0": "1,0"}, log
        for w in httpx.get(launch.url + "/workers", timeout=10).json()["workers"]:
            assert httpx.get(w["url"] + "/v1/kv_transfer", timeout=10).json()["kv_transport"] == "nixl"
        model_id = httpx.get(plain.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for prompt in ([5, 17, 300, 42, 7, 7, 900, 12] * 5, [1, 2, 3]):
            body = {"model": model_id, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            want = _stream_ids(plain.url, body)
            assert len(want) == 12
            # through the router, P/D: the decode worker's ids, not dropped by the router
            assert _stream_ids(launch.url, body) == want
            r = httpx.post(launch.url + "/v1/completions", json=body, timeout=60).json()
            assert r["choices"][0]["token_ids"] == want
        metrics = httpx.get(launch.url + "/metrics", timeout=10).text
        assert 'kvserve_router:phase_latency_seconds_count{phase="transfer_wait"} 2.0' in metrics, metrics
    finally:
        launch.stop()
        plain.stop()
    assert os.path.exists(tmp_path / "launch.log")
