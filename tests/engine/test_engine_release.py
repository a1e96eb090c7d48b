"""Engines give their memory back: after ``shutdown()`` every tensor of the engine (KV cache,
model parameters) is gone even while the caller still holds the ``LLM``; an engine dropped
without ``shutdown()`` (``del`` + garbage collection) stops its threads and releases them
too; building and shutting down engines in a loop does not grow the process (RSS). A KV
cache too small for one request names its group's real kind."""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref

import pytest
import torch

from kvserve import LLM, SamplingParams

KV_MIB = 32  # large enough that one leaked cache shows in RSS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("release")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    return str(d)


def _llm(path, **kw) -> LLM:
    args = dict(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=8,
                kv_cache_memory=f"{KV_MIB}MiB", disable_log_stats=True, async_scheduling=True)
    args.update(kw)
    return LLM(**args)


def _tensor_refs(llm) -> list[weakref.ref]:
    mr = llm.llm_engine.engine_core.model_runner
    refs = [weakref.ref(t) for t in mr.kv_caches.values()] + [weakref.ref(p) for p in mr.model.parameters()]
    tier = getattr(mr.kv_connector, "worker", None)
    if getattr(tier, "pool", None) is not None:  # the CPU tier's host pool (pinned on CUDA)
        refs.append(weakref.ref(tier.pool))
    assert len(refs) > 4
    return refs


def _serve_some(llm) -> None:
    prompts = [[1] + [(5 * i + j) % 250 + 3 for j in range(20 + 7 * i)] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=12, ignore_eos=True, seed=1),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


def _rss_mib() -> float:
    """Resident MiB after glibc returned its free heap to the system (freed 16 MiB tensors
    otherwise stay in malloc's heap and look like a leak)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pytest.skip("needs glibc (malloc_trim)")
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_shutdown_releases_every_tensor_in_a_loop(tiny):
    rss = []
    for i in range(3):
        llm = _llm(tiny, kv_offloading_size=0.01)  # the CPU tier too
        _serve_some(llm)
        refs = _tensor_refs(llm)
        assert isinstance(refs[-1](), torch.Tensor) and refs[-1]().dim() > 5  # the tier's pool
        llm.shutdown()
        # Released by shutdown itself, without a garbage collection, while the caller still
        # holds ``llm`` (a notebook's Out[] does).
        assert [r for r in refs if r() is not None] == []
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)
        llm.shutdown()  # idempotent
        del llm
        rss.append(_rss_mib())
    # A leaked engine would keep its KV cache (KV_MIB, zero-filled: resident) per round.
    assert rss[2] - rss[0] < KV_MIB / 2, rss


def test_dropped_engine_stops_threads_and_releases(tiny):
    """Without shutdown(): the P/D connector's listening thread held the worker (and its KV
    cache) alive; the engine's finalizer now stops it when the engine is collected."""
    ktc = {"kv_connector": "P2PKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kv_port": 0}}
    llm = _llm(tiny, kv_transfer_config=json.dumps(ktc))
    _serve_some(llm)
    refs = _tensor_refs(llm)
    core = weakref.ref(llm.llm_engine.engine_core)
    assert any(t.name == "kvserve-p2p-accept" for t in threading.enumerate())
    del llm
    gc.collect()
    assert core() is None
    assert [r for r in refs if r() is not None] == []
    for t in threading.enumerate():
        if t.name == "kvserve-p2p-accept":
            t.join(5)
            assert not t.is_alive()


def test_kv_group_error_names_its_kind(tiny):
    with pytest.raises(ValueError, match=r"group 0 \(2 layers full_attention\) has 1 blocks") as e:
        _llm(tiny, kv_cache_memory=None, num_gpu_blocks_override=1)
    assert "sliding" not in str(e.value)
