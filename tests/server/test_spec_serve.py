"""``kvserve serve --speculative-config`` (n-gram, a tiny dummy Llama, no tokenizer): the
completion equals the offline engine without speculation, and /metrics exposes the
spec_decode counters."""

from __future__ import annotations

import json
import re

import pytest

TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny-llama-spec")
    LlamaConfig(**TINY).save_pretrained(str(d))
    return str(d)


def test_serve_with_ngram_speculation(tiny_dir, tmp_path, remote_server):
    pytest.importorskip("fastapi")
    import httpx

    from kvserve import LLM, SamplingParams

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    ref = LLM(model=tiny_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              kv_cache_memory="32MiB", disable_log_stats=True).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    args = [tiny_dir, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "512",
            "--kv-cache-memory", "32MiB", "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC)]
    h = remote_server.serve(args, str(tmp_path / "server.log"), api_key=None)
    try:
        h.wait_ready()
        with httpx.Client(base_url=h.url, timeout=120) as c:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
            r = c.post("/v1/completions", json=body).json()
            assert r["choices"][0]["token_ids"] == ref.outputs[0].token_ids
            text = c.get("/metrics").text
        vals = {m: float(v) for m, v in re.findall(r'^kvserve:(spec_decode_\w+)_total\{model_name="tiny"\} (\S+)$',
                                                    text, re.M)}
        assert vals["spec_decode_num_draft_tokens"] > 0, text[-2000:]
        assert vals["spec_decode_num_drafts"] > 0
        assert 0 <= vals["spec_decode_num_accepted_tokens"] <= vals["spec_decode_num_draft_tokens"]
    finally:
        h.stop()
