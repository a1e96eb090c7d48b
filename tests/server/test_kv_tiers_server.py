"""``kvserve serve`` with the CPU and disk tiers (a tiny dummy Llama, token-id prompts): a prompt
evicted from the device comes back from the CPU tier (``usage.prompt_tokens_details.cached_tokens``,
``/metrics``), and after a server restart from the disk tier."""

from __future__ import annotations

import random

TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def test_tiers_over_http_and_across_restart(tmp_path, metric_value, remote_server):
    import httpx
    from transformers import LlamaConfig

    model = tmp_path / "tiny"
    LlamaConfig(**TINY).save_pretrained(str(model))
    disk = tmp_path / "kv"
    disk.mkdir()
    # float32 as in tests/kv_connector (bf16 flips near-ties between a hit and a full prefill).
    args = [str(model), "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
            "--max-model-len", "176", "--num-gpu-blocks-override", "12", "--block-size", "16",
            "--kv-offloading-size", "0.01", "--kv-disk-path", str(disk), "--served-model-name", "tiny",
            "--disable-log-stats"]
    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(100)]  # 6 full blocks
    others = [[rng.randrange(3, 1000) for _ in range(150)] for _ in range(3)]

    def complete(c, p):
        body = {"model": "tiny", "prompt": p, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0]["token_ids"], j["usage"]["prompt_tokens_details"]["cached_tokens"]

    outs = []
    for run in range(2):
        h = remote_server.serve(args, str(tmp_path / f"server{run}.log"), api_key=None)
        try:
            h.wait_ready()
            with httpx.Client(base_url=h.url, timeout=120) as c:
                if run == 0:
                    toks, cached = complete(c, prompt)
                    assert cached == 0
                    for o in others:  # push the prompt's blocks out of the 11-block device pool
                        complete(c, o)
                    toks2, cached = complete(c, prompt)
                    assert toks2 == toks and cached == 96
                    metrics = c.get("/metrics").text
                    assert metric_value(metrics, "kvserve:kv_tier_hit_tokens_total", 'tier="cpu"') >= 96
                else:
                    toks, cached = complete(c, prompt)  # a new server: only the disk tier remains
                    assert cached == 96
                outs.append(toks)
        finally:
            h.stop()
    assert outs[0] == outs[1]
