"""Schemathesis fuzzing of a running ``kvserve serve`` from its own ``/openapi.json``: positive
(schema-valid) and negative (schema-breaking) bodies for the completion, chat, tokenize and
detokenize routes. Every answer must be < 500, and every 4xx an OpenAI error body whose
``code`` is the status.

    python benchmarks/load/fuzz.py --base-url http://127.0.0.1:8000 [--api-key KEY] [--examples 30]

``--examples`` per route (half positive, half negative). Generations are capped at 4 tokens.
Prints one ``RELIABILITY fuzz ...`` line; exit status 1 on a 5xx or a malformed error body.
"""

from __future__ import annotations

import argparse
import sys
import time

FUZZ_OPS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"),
            ("/detokenize", "POST")]
FUZZ_EXAMPLES = 30


def _cap_tokens(body, positive: bool):
    """Keep generations short: valid max_tokens values become 1..4 (invalid ones are kept).

    In positive mode, also drop the fields that are rejected for reasons unrelated to the
    shape of the request (a random model name, unsupported logit_bias / suffix / best_of), so
    that most cases get as far as the engine.
    """
    if not isinstance(body, dict):
        return body
    if positive:
        for key in ("model", "logit_bias", "suffix", "best_of", "top_logprobs"):
            body.pop(key, None)
        if not body.get("stream"):
            body.pop("stream_options", None)
        if isinstance(body.get("tokens"), list):
            body["tokens"] = [t % 49152 if isinstance(t, int) and not isinstance(t, bool) else t
                              for t in body["tokens"]]
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 4 < v <= 4096:
            body[key] = 4
    if "max_tokens" not in body or body.get("max_tokens") is None:
        body["max_tokens"] = 4
    if isinstance(body.get("min_tokens"), int) and 4 < body["min_tokens"] <= 4096:
        body["min_tokens"] = 4
    if isinstance(body.get("n"), int) and 4 < body["n"] <= 16:
        body["n"] = 4
    return body


def run(base_url: str, api_key: str | None = None, examples: int = FUZZ_EXAMPLES) -> dict[str, dict[int, int]]:
    """Fuzz every route of ``FUZZ_OPS`` with ``examples`` cases; {route: {status: count}}.
    AssertionError on a 5xx or on a 4xx without an OpenAI error body."""
    import httpx
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    raw = httpx.get(base_url + "/openapi.json", headers=auth, timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    stats: dict[str, dict[int, int]] = {}
    for path, method in FUZZ_OPS:
        op = schema[path][method]
        counts = stats.setdefault(path, {})
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=max(1, examples // 2), deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def one(case):
                case.body = _cap_tokens(case.body, mode == GenerationMode.POSITIVE)
                resp = case.call(base_url=base_url, headers=auth, timeout=60)
                counts[resp.status_code] = counts.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, (path, case.body, resp.status_code, resp.text[:500])
                if resp.status_code >= 400:
                    body = resp.json()
                    assert "error" in body and body["error"]["code"] == resp.status_code, body

            one()
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--examples", type=int, default=FUZZ_EXAMPLES, help="cases per route (half positive)")
    ns = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        stats = run(ns.base_url, ns.api_key, ns.examples)
    except AssertionError as e:
        print(f"RELIABILITY fuzz FAIL: {e}")
        return 1
    total = sum(sum(c.values()) for c in stats.values())
    print(f"RELIABILITY fuzz requests={total} statuses={stats} 5xx=0 ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
