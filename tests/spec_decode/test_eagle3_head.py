"""The shipped EAGLE-3 head of the default model (trained by ``kvserve.spec_decode.train_eagle3``
on the GPU): on the benchmark's held-out chat questions (never trained on) its mean acceptance
length at k=4 stays above a floor below the measured value, and greedy output equals no
speculation. Skipped while no shipped head is an EAGLE-3 one (keyed on its config.json)."""

from __future__ import annotations

import json
import os

import pytest

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.chat_topics import HELD_OUT
from kvserve.spec_decode.eagle import DEFAULT_EAGLE_HEAD

DATA = os.path.dirname(DEFAULT_EAGLE_HEAD)
#: Mean acceptance length floor at k=4 on the held-out chat (CPU, float32, 64 tokens).
FLOOR = 2.2


def _eagle3_head() -> str | None:
    for d in (os.path.join(DATA, "eagle3-smollm2-135m"), DEFAULT_EAGLE_HEAD):
        try:
            with open(os.path.join(d, "config.json")) as f:
                if "LlamaForCausalLMEagle3" in json.load(f).get("architectures", []):
                    return d
        except FileNotFoundError:
            continue
    return None


HEAD = _eagle3_head()


@pytest.mark.skipif(HEAD is None, reason="the shipped head is not an EAGLE-3 one yet")
def test_shipped_eagle3_head_accepts_on_held_out_chat(llm):
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in HELD_OUT]
    sp = SamplingParams(temperature=0, max_tokens=64)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    spec = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024, disable_log_stats=True,
               speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": 4, "dynamic": False})
    outs = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    st = spec.llm_engine.stats
    spec.shutdown()
    assert outs == ref
    assert 1 + st.num_accepted_tokens / st.num_drafts >= FLOOR
