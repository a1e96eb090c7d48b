"""The OpenAI-compatible API server (``kvserve serve``).

Importing this package is cheap: fastapi, uvicorn, zmq and msgspec are imported only by
``api_server`` / ``serving`` when the server runs, so the offline engine works without them.
"""

from __future__ import annotations

import argparse


def register_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand: server flags plus every engine flag."""
    from kvserve.engine.arg_utils import EngineArgs

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
                   help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSERVE_API_KEY, else none).")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Model name(s) clients use; the first one is reported (default: the MODEL "
                        "argument, or SmolLM2-135M-Instruct).")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="Seconds in-flight requests get to finish after SIGTERM (default: %(default)s).")
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
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="How tool calls are read from the text under tool_choice auto (vLLM's names).")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_serve)
    return p


def _run_serve(ns: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.api_server import run_server

    return run_server(ns)
