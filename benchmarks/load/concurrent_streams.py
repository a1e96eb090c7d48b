"""N concurrent streamed completions against a running ``kvserve serve`` (openai client):
every stream ends with ``finish_reason == "length"`` and ``usage.completion_tokens`` equal to
``--max-tokens``.

    python benchmarks/load/concurrent_streams.py --base-url http://127.0.0.1:8000 [--api-key KEY] [--streams 100]

Prints the wall time; exit status 1 if a stream ends otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

MODEL = "SmolLM2-135M-Instruct"


def run(base_url: str, api_key: str | None = None, streams: int = 100, max_tokens: int = 8,
        model: str = MODEL) -> list[tuple[str, str, object]]:
    """``streams`` concurrent greedy streams of ``max_tokens`` tokens: [(text, finish_reason, usage)]."""
    import openai

    async def go():
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "EMPTY", max_retries=0,
                                    timeout=600)

        async def one(i: int):
            stream = await client.completions.create(model=model, prompt=f"Item {i}: the", max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage
            return text, finish, usage

        try:
            return await asyncio.gather(*(one(i) for i in range(streams)))
        finally:
            await client.close()

    return asyncio.run(go())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=8)
    ns = p.parse_args(argv)
    t0 = time.monotonic()
    results = run(ns.base_url, ns.api_key, ns.streams, ns.max_tokens, ns.model)
    bad = [r for r in results if r[1] != "length" or r[2] is None or r[2].completion_tokens != ns.max_tokens]
    print(f"{ns.streams} concurrent streams of {ns.max_tokens} tokens: {time.monotonic() - t0:.1f} s, "
          f"{len(bad)} ended otherwise")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
