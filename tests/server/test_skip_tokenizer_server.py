"""``kvserve serve --skip-tokenizer-init`` (a tiny dummy Llama, no tokenizer): token-id prompts
in, ``token_ids`` out (the text is empty), and ``kvserve bench serve`` measures it; this is
the path of ``benchmarks/gpu_serve_sweep.sh`` on the GPU. The server is the session's shared
small server (``tiny_server``, tests/server/conftest.py)."""

from __future__ import annotations

import json

def test_token_ids_without_tokenizer(tiny_server):
    import httpx

    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body).json()
        ch = r["choices"][0]
        assert ch["text"] == "" and len(ch["token_ids"]) == 5 and ch["prompt_token_ids"] == [5, 6, 7, 8]
        assert all(0 <= t < 1000 for t in ch["token_ids"])
        assert r["usage"]["completion_tokens"] == 5
        with c.stream("POST", "/v1/completions",
                      json=dict(body, stream=True, stream_options={"include_usage": True})) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        ids = [t for k in chunks for x in k["choices"] for t in x["token_ids"]]
        assert ids == ch["token_ids"]  # greedy: the same ids, one chunk's worth at a time
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        # text prompts need a tokenizer
        assert c.post("/v1/completions", json=dict(body, prompt="hello")).status_code == 400


def test_bench_serve_against_it(tiny_server, tmp_path):
    from kvserve.entrypoints import cli

    out = tmp_path / "sweep.json"
    ns = cli.build_parser().parse_args([
        "bench", "serve", "--base-url", tiny_server.url, "--dataset", "random", "--vocab-size", "1000",
        "--input-len", "4:40", "--output-len", "4:12", "--sweep", "20,inf", "--sweep-duration", "0.2",
        "--sweep-min-prompts", "3", "--num-prompts", "4", "--disable-tqdm", "--save-result", str(out)])
    assert ns.func(ns) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["num_requests"], r["completed"], r["failed"]) for r in runs] == [(4, 4, 0), (4, 4, 0)]
    for r in runs:
        assert 4 * 4 <= r["total_output_tokens"] <= 4 * 12
        assert r["median_tpot_ms"] > 0 and r["median_ttft_ms"] > 0
