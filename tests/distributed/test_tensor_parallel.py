"""Tensor parallelism on the CPU (gloo, one process per rank through the mp executor): the
real default model at TP=3 and a 1-KV-head random Llama at TP=2 give the TP=1 tokens."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.distributed import kv_head_range

pytest.importorskip("zmq")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_kv_head_range_splits_or_replicates():
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="must divide"):
        kv_head_range(6, 4, 0)
    with pytest.raises(ValueError, match="multiple"):
        kv_head_range(4, 6, 0)


def test_bad_tensor_parallel_size_is_a_clear_error():
    with pytest.raises(ValueError, match="attention heads"):
        LLM(tensor_parallel_size=2, disable_log_stats=True)  # SmolLM2 has 9 heads
    with pytest.raises(ValueError, match="mp or ray"):
        LLM(tensor_parallel_size=3, distributed_executor_backend="uni", disable_log_stats=True)


def test_tp3_real_model_equals_tp1(llm):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def add(a, b):\n    return",
                                        "Water boils at", "Once upon a time,")]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    tp = LLM(tensor_parallel_size=3, dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
             disable_log_stats=True)
    try:
        assert type(tp.llm_engine.engine_core.executor).__name__ == "MultiprocExecutor"
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        tp.shutdown()
    assert got == want


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """A random 2-layer Llama with 4 heads and a single KV head (replicated at TP=2),
    an untied LM head and a vocabulary that does not divide by 3."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("kv1")
    model.save_pretrained(path)
    return str(path)


def _tiny(path, **kw):
    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
               disable_log_stats=True, **kw)


def test_tp2_with_a_replicated_kv_head_equals_tp1_and_a_dead_rank_fails_fast(one_kv_head):
    prompts = [[1, 2, 3], [7] * 20, list(range(100, 140))]
    want = [o.outputs[0].token_ids for o in _tiny(one_kv_head).generate(prompts, GREEDY, use_tqdm=False)]
    tp = _tiny(one_kv_head, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want
        os.kill(tp.llm_engine.engine_core.executor.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            tp.generate(prompts, GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        tp.shutdown()


def test_tp2_gemma3_with_sliding_windows_equals_transformers(tmp_path):
    """A tiny Gemma 3 (window 8, block size 4: the hybrid manager frees window blocks) at TP=2."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           max_position_embeddings=256, architectures=["Gemma3ForCausalLM"],
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    prompts = [list(range(1, 13)), [5] * 20, list(range(40, 71))]
    want = []
    for p in prompts:
        x = torch.tensor([p])
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        want.append(y[0, len(p):].tolist())
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tp = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=4,
             kv_cache_memory="8MiB", disable_log_stats=True, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, sp, use_tqdm=False)]
    finally:
        tp.shutdown()
    assert got == want
