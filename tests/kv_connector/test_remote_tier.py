"""Remote tier (``--kv-remote-url``) against a real ``redis-server`` started on a free loopback port."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

import pytest

from kvserve import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [random.Random(4).randrange(3, 256) for _ in range(200)]  # 12 full blocks of 16


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (`./setup.sh --test` installs it with apt-get)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def _llm(path, url, **kw):
    args = dict(model=path, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=24, max_model_len=320,
                dtype="float32",  # the same numerics on a GPU as on the CPU (bf16 there flips near-ties)
                max_num_seqs=16, disable_log_stats=True, kv_offloading_size=0.01, kv_remote_url=url)
    args.update(kw)
    return LLM(**args)


def _run(llm):
    out = llm.generate([PROMPT], SP, use_tqdm=False)[0]
    llm.shutdown()
    return list(out.outputs[0].token_ids), out.num_cached_tokens, llm.llm_engine.engine_core.kv_connector


def test_second_engine_hits_the_server(tiny_llama_dir, redis_url):
    ref = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, dtype="float32", block_size=16,
              num_gpu_blocks_override=24, max_model_len=320, max_num_seqs=16, disable_log_stats=True,
              enable_prefix_caching=False)
    ref_toks = list(ref.generate([PROMPT], SP, use_tqdm=False)[0].outputs[0].token_ids)
    toks, cached, conn = _run(_llm(tiny_llama_dir, redis_url))
    assert toks == ref_toks and cached == 0 and conn.get_stats()["disk_blocks_stored"] == 12
    toks, cached, conn = _run(_llm(tiny_llama_dir, redis_url))  # another engine: only the server is shared
    assert toks == ref_toks and cached == 192 and conn.get_stats()["disk_hit_tokens"] == 192
    # A corrupted value is rejected, deleted and recomputed.
    key = conn._keys(_req(PROMPT), 12)[5]
    store = conn.disk
    data = bytearray(store.client.get(store.raw_key(key)))
    data[-1] ^= 0xFF
    store.client.set(store.raw_key(key), bytes(data))
    toks, cached, conn = _run(_llm(tiny_llama_dir, redis_url))
    assert toks == ref_toks and cached == 5 * 16 and conn.get_stats()["disk_blocks_rejected"] == 1


def _req(tokens):
    from kvserve.request import Request

    return Request("probe", tokens, SamplingParams())


def test_unreachable_server_is_a_startup_error(tiny_llama_dir):
    pytest.importorskip("redis")  # the client library (absent on the GPU machine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(ValueError, match="cannot reach"):
        _llm(tiny_llama_dir, f"redis://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="redis://"):
        _llm(tiny_llama_dir, "http://127.0.0.1:1")
