"""The ray executor on a real two-node Ray cluster on this machine (``ray start --head`` and a
second ``ray start`` joining it, one CPU each): TP=2 over gloo across the two nodes gives the
mp executor's tokens; a killed actor fails fast; a cluster too small is a start-up error."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from kvserve import LLM, SamplingParams

ray = pytest.importorskip("ray")
if shutil.which("ray") is None:
    pytest.skip("the ray CLI is not on PATH", allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[1, 2, 3], [7] * 20, list(range(100, 140))]


def _ray(*args: str, env: dict) -> None:
    subprocess.run(["ray", *args], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=120)


@pytest.fixture(scope="module")
def cluster():
    """``RAY_ADDRESS`` of a head node plus one more node, one CPU each; stopped afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    _ray("start", "--head", "--port", str(port), "--include-dashboard=false", *common, env=env)
    try:
        _ray("start", "--address", f"127.0.0.1:{port}", *common, env=env)
        deadline = time.monotonic() + 60
        while True:  # the second node registers asynchronously
            out = subprocess.run(["ray", "status", "--address", f"127.0.0.1:{port}"], env=env, text=True,
                                 capture_output=True).stdout
            if out.count("node_") >= 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert out.count("node_") >= 2, out
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("ray_tiny")
    model.save_pretrained(path)
    return str(path)


def _tiny(path, **kw):
    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
               disable_log_stats=True, **kw)


def test_tp2_across_two_ray_nodes_equals_mp(cluster, tiny, monkeypatch):
    mp = _tiny(tiny, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        want = [o.outputs[0].token_ids for o in mp.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        mp.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    llm = _tiny(tiny, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        ex = llm.llm_engine.engine_core.executor
        placed = ray.util.placement_group_table(ex._pg)["bundles_to_node_id"]
        assert len(set(placed.values())) == 2  # one rank on each node
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        ray.kill(ex.actors[1])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="Ray worker"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        llm.shutdown()


def test_too_small_a_cluster_is_a_start_up_error(cluster, tiny, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr("kvserve.executor.ray_executor.PLACEMENT_TIMEOUT_S", 3.0)
    with pytest.raises(ValueError, match="cannot place 4 ranks"):
        _tiny(tiny, tensor_parallel_size=4, distributed_executor_backend="ray")
