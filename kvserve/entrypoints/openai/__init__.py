"""The OpenAI-compatible API server (``kvserve serve``).

Importing this package is cheap: fastapi, uvicorn, zmq and msgspec are imported only by
``api_server`` / ``serving`` when the server runs, so the offline engine works without them.
"""

from __future__ import annotations

import argparse


def register_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand: server flags plus every engine flag."""
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.entrypoints.openai.reasoning_parsers import reasoning_parser_names
    from kvserve.entrypoints.openai.tool_parsers import tool_parser_names

    p = subparsers.add_parser(
        "serve", help="Serve the model over an OpenAI-compatible HTTP API.",
        description="Start the OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics, /tokenize, /detokenize). Without MODEL it serves "
                    "the embedded SmolLM2-135M-Instruct.",
    )
    g = p.add_argument_group("server arguments")
    g.add_argument("--host", default="127.0.0.1", help="Address to bind (default: %(default)s).")
    g.add_argument("--port", type=int, default=8000, help="Port to bind (default: %(default)s).")
    g.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSERVE_API_KEY, else none). "
                        "Prefer the environment variable: a flag's value is visible to every user in `ps`.")
    g.add_argument("--internal-secret-file", default=None, metavar="PATH",
                   help="File holding the internal secret (default: $KVSERVE_INTERNAL_SECRET_FILE, else "
                        "$KVSERVE_INTERNAL_SECRET, else none). With one, every route but /health, /ping, /version "
                        "(and open /metrics) needs the router's signed x-kvserve-internal-auth header, and the P/D "
                        "KV transfer authenticates its peers. See docs/reliability.md.")
    g.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                   help="Comma-separated Host header names the server answers ('*': any; '*.example.com': "
                        "subdomains); others get 400 (DNS-rebinding defence; /health, /ping, /version and "
                        "open /metrics are exempt). Default: '*' with an API key, else localhost, 127.0.0.1, "
                        "::1 and the --host address.")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Model name(s) clients use; the first one is reported (default: the MODEL "
                        "argument, or SmolLM2-135M-Instruct).")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="Seconds in-flight requests get to finish after the first SIGTERM/SIGINT; then "
                        "they end with an error (stream: error event + [DONE]; else 503) and the server "
                        "exits within 2 s more, with status 3. A second signal skips the wait "
                        "(default: %(default)s).")
    g.add_argument("--engine-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="Declare the engine core hung after this many seconds without a step or heartbeat: "
                        "/health turns 503, in-flight requests fail, and the server exits with status 1 "
                        "(default: %(default)s; 0: off). Set it above your slowest step.")
    g.add_argument("--max-request-duration", type=float, default=None, metavar="SECONDS",
                   help="Abort a request this many seconds after its arrival (finish_reason 'abort', the "
                        "text so far kept) (default: off, as vLLM).")
    g.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="Cap on a chat completion's tokens when the client gives no max_tokens (default: "
                        "the rest of the context, as vLLM; /v1/completions defaults to 16 as OpenAI).")
    g.add_argument("--max-tokenize-concurrency", type=int, default=2, metavar="N",
                   help="Prompts tokenized at once, in threads off the event loop (default: %(default)s).")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: %(default)s).")
    g.add_argument("--disable-access-log", action="store_true", help="No per-request access log lines.")
    g.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="Engine sequences (n x prompts per request) admitted beyond --max-num-seqs; past "
                        "that, new requests get 429 with Retry-After at once (default: 4 x max-num-seqs; "
                        "-1: unbounded).")
    g.add_argument("--max-n", type=int, default=16,
                   help="Largest n (completions per prompt) a request may ask for; 400 past it "
                        "(default: %(default)s).")
    g.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024, metavar="BYTES",
                   help="Largest request body; 413 past it (default: %(default)s = 8 MiB; -1: unbounded).")
    g.add_argument("--protect-metrics", action="store_true",
                   help="/metrics needs the API key too (default: /metrics, /health, /ping and /version "
                        "are open; every other route needs it when --api-key is set).")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Allow tool_choice "auto" (the default when a request has tools): the model '
                        "writes freely and --tool-call-parser finds the calls (vLLM's flag). Without it, "
                        '"auto" is a 400; "required", "none" and named functions always work.')
    g.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="How tool calls are read from the text under tool_choice auto (vLLM's names): "
                        "hermes (Hermes, Qwen2.5, Qwen3), llama3_json, deepseek_v3, openai (gpt-oss harmony).")
    g.add_argument("--reasoning-parser", default=None, choices=reasoning_parser_names(),
                   help="Split the model's reasoning from its answer into message.reasoning_content (and "
                        "delta.reasoning_content when streaming), vLLM's names: qwen3, deepseek_r1, openai_gptoss.")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="Default sampling fields (temperature, top_p, top_k, min_p, repetition_penalty; "
                        "max_new_tokens as the max_tokens cap) from generation_config.json: 'auto' next to the "
                        "model, a FOLDER's, or 'vllm' for none. A request's own fields win (default: %(default)s).")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Accepted for vLLM command lines; no effect: kvserve implements each architecture "
                        "itself and never imports Python code from a checkpoint.")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="Accepted for vLLM command lines; no effect: kvserve never logs request contents "
                        "(per-request access lines: --disable-access-log).")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_serve)
    return p


def _run_serve(ns: argparse.Namespace) -> int:
    import logging
    import os
    import sys

    from kvserve.entrypoints.openai.api_server import run_server

    status = run_server(ns)
    # Skip the interpreter's finalization (seconds of module and tensor teardown): the
    # shutdown deadline must hold, and everything worth closing is closed by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
