"""Bounded KV on the real default model (SmolLM2-135M-Instruct), small scale: perplexity of
~1k tokens of the shipped corpus' prose with a 128-token window is much worse without attention
sinks than with StreamingLLM's 4 sinks (arXiv:2309.17453, its Figure 3 effect). One engine
serves both (per-request ``attention_sinks`` below the engine's)."""

from __future__ import annotations

import math

import pytest

from kvserve import LLM, SamplingParams
from kvserve.bench.accuracy import load_corpus


@pytest.fixture(scope="module")
def streaming_llm(smollm2_path):
    llm = LLM(model=smollm2_path, dtype="float32", block_size=16, max_num_batched_tokens=256, max_num_seqs=2,
              max_model_len=1100, kv_cache_memory="64MiB", disable_log_stats=True, enable_prefix_caching=False,
              kv_eviction_policy="streaming", attention_sinks=4, max_attention_window=128)
    yield llm
    llm.shutdown()


def test_sinks_beat_window_only(streaming_llm):
    llm = streaming_llm
    text = "\n\n".join(d["text"] for d in load_corpus() if d["kind"] != "code")
    ids = llm.get_tokenizer()(text)["input_ids"][:1024]

    def ppl(**kw):
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, **kw),
                           use_tqdm=False)[0]
        nll = [-e[t][0] for e, t in zip(out.prompt_logprobs[1:], ids[1:])]
        return math.exp(sum(nll) / len(nll))

    window_only, streaming = ppl(attention_sinks=0), ppl()
    assert window_only > 1.5 * streaming, (window_only, streaming)
    stats = llm.llm_engine.engine_core.scheduler.get_stats()
    # Each request evicts up to its last chunk's start (768): blocks 1 .. (768 - 127) // 16 - 1.
    assert stats.num_evicted_blocks >= 2 * ((768 - 127) // 16 - 1)
