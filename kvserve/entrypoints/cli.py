"""The ``kvserve`` command line.

Subcommands::

    kvserve generate [MODEL] --prompt TEXT [--prompt TEXT ...] [--chat] [sampling flags] [engine flags]
    kvserve chat [MODEL] [--system TEXT] [sampling flags] [engine flags]
    kvserve bench throughput [MODEL] [workload flags] [engine flags]
    kvserve serve [MODEL] [--host H] [--port P] [--api-key KEY] [engine flags]
    kvserve router --port P (--worker URL ... | --prefill URL ... --decode URL ...) [--policy ...]
    kvserve launch --prefill N --decode M [MODEL] [--port P] [engine flags]

Every subcommand that builds an engine gets every ``EngineArgs`` field as a flag, registered
by the engine layer (``EngineArgs.add_cli_args``): ``--kebab-case`` names, help text and
choices from the component configs' field docs, ``--flag/--no-flag`` for booleans, ``MODEL``
as an optional positional.

Adding a subcommand (e.g. ``serve``) is one function: write ``_register_serve(subparsers)``
that adds a parser and ``set_defaults(func=...)``, and append it to ``SUBCOMMANDS``. The
``func`` gets the parsed namespace and returns an exit status (int) or None (= 0).

Every parser is a ``KVServeArgumentParser``: no prefix matching of long flags (``--max-num-seq``
is an error, not ``--max-num-seqs``), and an unknown flag is reported by the subcommand it was
given to, with its usage and the closest flag names (``difflib``).

Errors the engine raises for bad input (``ValueError``, ``FileNotFoundError``) are printed
as one line ``error: ...`` on stderr and the process exits with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

from kvserve.bench import env as bench_env
from kvserve.engine.arg_utils import EngineArgs, add_engine_args

#: Exit status for usage errors and engine errors caused by the user's input.
EXIT_USAGE = 2


# --------------------------------------------------------------------------- parser

class KVServeArgumentParser(argparse.ArgumentParser):
    """``ArgumentParser`` with ``allow_abbrev=False`` (a flag is matched in full only, as a
    typo must not silently become another flag), whose ``parse_args`` reports unknown flags
    from the deepest subcommand given, with its usage and a close-match suggestion. Subparsers
    inherit the class (``add_subparsers`` uses ``type(self)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            target = self.selected_subparser(ns)
            target.error(unrecognized_message(target, extras))
        return ns

    def selected_subparser(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the deepest subcommand named in ``ns`` (``self`` without one)."""
        parser: argparse.ArgumentParser = self
        while True:
            act = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            name = getattr(ns, act.dest, None) if act is not None else None
            if name not in (act.choices if act is not None else {}):
                return parser
            parser = act.choices[name]


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``"unrecognized arguments: --max-num-seq 4 (did you mean --max-num-seqs?)"``: each unknown
    flag of ``extras`` gets its closest flags of ``parser`` (``difflib.get_close_matches``)."""
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for tok in extras:
        if not tok.startswith("--"):
            continue
        close = difflib.get_close_matches(tok.split("=", 1)[0], options, n=2, cutoff=0.6)
        if close:
            hints.append(f"{tok.split('=', 1)[0]}: did you mean {' or '.join(close)}?")
    msg = f"unrecognized arguments: {' '.join(extras)}"
    return msg + (f" ({'; '.join(hints)})" if hints else "")


# --------------------------------------------------------------------------- engine flags

def engine_args_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` fields present in a parsed namespace (``EngineArgs.from_cli_args``)."""
    return EngineArgs.from_cli_args(ns)


# --------------------------------------------------------------------------- sampling flags

def add_sampling_args(
    parser: argparse.ArgumentParser, *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0
) -> argparse.ArgumentParser:
    """Add the per-request sampling flags (``kvserve.SamplingParams`` fields) to ``parser``.

    ``max_tokens``, ``temperature`` and ``top_p`` are this subcommand's defaults.
    The sampling RNG follows the engine's ``--seed``.
    """
    g = parser.add_argument_group("sampling arguments", "Fields of kvserve.SamplingParams.")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="Most new tokens per completion (default: %(default)s).")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="EOS and stop tokens are suppressed before this many new tokens (default: %(default)s).")
    g.add_argument("--temperature", type=float, default=temperature,
                   help="Sampling temperature; 0 is greedy (default: %(default)s).")
    g.add_argument("--top-p", type=float, default=top_p,
                   help="Nucleus sampling: keep the smallest set of tokens with this total probability (default: %(default)s).")
    g.add_argument("--top-k", type=int, default=0,
                   help="Keep the k most likely tokens; 0 or -1 disables (default: %(default)s).")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="Drop tokens with probability below min_p * p_max (default: %(default)s).")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="Multiplicative penalty on prompt and output tokens, > 0 (default: %(default)s).")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="Additive penalty in [-2, 2] on tokens already in the output (default: %(default)s).")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="Additive penalty in [-2, 2] per occurrence in the output (default: %(default)s).")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="Stop string (repeatable); not included in the output.")
    g.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")
    g.add_argument("--n", type=int, default=1, help="Completions per prompt (default: %(default)s).")
    return parser


def sampling_params_from_namespace(ns: argparse.Namespace):
    """Build a ``kvserve.SamplingParams`` from the flags of ``add_sampling_args``.

    Raises ValueError (from SamplingParams) on out-of-range values.
    """
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
        repetition_penalty=ns.repetition_penalty, max_tokens=ns.max_tokens,
        min_tokens=ns.min_tokens, stop=ns.stop, ignore_eos=ns.ignore_eos,
    )


# --------------------------------------------------------------------------- generate

def _register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="Complete prompts and print the completions.",
        description="Complete one or more prompts in one batch and print the completions.",
    )
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="Prompt text (repeatable; all prompts run as one batch).")
    p.add_argument("--chat", action="store_true",
                   help="Treat each prompt as a user message and apply the model's chat template.")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="System message for --chat.")
    add_sampling_args(p, max_tokens=128)
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    """``kvserve generate``: run the prompts as one batch, print each prompt and completion."""
    sp = sampling_params_from_namespace(ns)
    llm = bench_env.make_llm(engine_args_from_namespace(ns))
    if ns.chat:
        convs = []
        for text in ns.prompt:
            conv = [{"role": "system", "content": ns.system}] if ns.system else []
            conv.append({"role": "user", "content": text})
            convs.append(conv)
        outs = llm.chat(convs, sampling_params=sp)
    else:
        if ns.system:
            raise ValueError("--system needs --chat")
        outs = llm.generate(ns.prompt, sampling_params=sp)
    for i, (text, out) in enumerate(zip(ns.prompt, outs)):
        print(f"=== prompt {i} ===")
        print(text)
        for comp in out.outputs:
            tag = f"completion {comp.index}" if len(out.outputs) > 1 else "completion"
            print(f"--- {tag} ({len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}) ---")
            print(comp.text)
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------- chat

def _register_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat", help="Interactive chat (reads stdin lines, streams replies).",
        description=(
            "Chat with the model. Each stdin line is a user message; the reply streams token by "
            "token and the conversation history is kept. '/exit' or EOF quits, '/reset' clears "
            "the history. Works with piped input: echo 'Hi' | kvserve chat"
        ),
    )
    p.add_argument("--system", default=None, metavar="TEXT", help="System message.")
    # Small instruct models ramble at temperature 1; SmolLM2's card suggests 0.2 / 0.9.
    add_sampling_args(p, max_tokens=512, temperature=0.2, top_p=0.9)
    add_engine_args(p)
    p.set_defaults(func=run_chat)


def chat_loop(llm, sampling_params, system: Optional[str], stdin=None, stdout=None) -> list[dict]:
    """Read user lines from ``stdin`` until EOF or ``/exit``; stream each reply to ``stdout``.

    Shows a ``>>>`` prompt only when ``stdin`` is a TTY, so piped input gives clean output.
    Ctrl-C during a reply stops that reply (the partial text is kept in the history);
    Ctrl-C at the prompt quits. Returns the final message history.
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    interactive = bool(getattr(stdin, "isatty", lambda: False)())
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    if interactive:
        print("kvserve chat: type a message; /reset clears the history, /exit or Ctrl-D quits.",
              file=sys.stderr)
    while True:
        if interactive:
            stdout.write(">>> ")
            stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            break
        if not line:  # EOF
            if interactive:
                stdout.write("\n")
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(base)
            continue
        history.append({"role": "user", "content": text})
        reply = []
        try:
            for delta in llm.stream_chat(history, sampling_params):
                reply.append(delta)
                stdout.write(delta)
                stdout.flush()
        except KeyboardInterrupt:
            pass
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
    return history


def run_chat(ns: argparse.Namespace) -> int:
    """``kvserve chat``: build the engine and run ``chat_loop`` on stdin/stdout."""
    sp = sampling_params_from_namespace(ns)
    llm = bench_env.make_llm(engine_args_from_namespace(ns))
    llm.check_chat_template()  # a base model fails here, before reading any input
    chat_loop(llm, sp, ns.system)
    return 0


# --------------------------------------------------------------------------- bench

def _register_bench(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.bench import BENCH_SUBCOMMANDS

    p = subparsers.add_parser(
        "bench", help="Benchmarks: offline throughput / latency / accuracy, and serve (an HTTP load "
                      "generator with vLLM's `bench serve` flags).",
        description="Benchmarks of the engine (throughput, latency, accuracy) and of a running server (serve).")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for register in BENCH_SUBCOMMANDS:
        register(sub)


# --------------------------------------------------------------------------- serve

def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.entrypoints.openai import register_serve_parser

    register_serve_parser(subparsers)


# --------------------------------------------------------------------------- router, launch

def _register_router(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.router.app import register_router_parser

    register_router_parser(subparsers)


def _register_launch(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.router.launch import register_launch_parser

    register_launch_parser(subparsers)


# --------------------------------------------------------------------------- plan-kv

def _register_plan_kv(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan-kv", help="KV cache capacity per --kv-cache-dtype for a model and a memory budget.",
        description="Bytes per token (2 * layers * kv_heads * head_dim * bytes + scales), tokens and maximum "
                    "concurrency at --max-model-len for each KV dtype, from the model's config (no weights load).",
    )
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory / GGUF file (default: the embedded SmolLM2-135M-Instruct).")
    p.add_argument("--max-model-len", type=int, required=True, help="Tokens per request (prompt + output).")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GiB",
                   help="Memory given to the KV cache, in GiB.")
    p.add_argument("--kv-cache-dtype", action="append", default=None, metavar="D",
                   help="Only these dtypes (repeatable; default: all).")
    p.add_argument("--block-size", type=int, default=16, help="Tokens per KV block.")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="Requests whose filling blocks int4/int2 keep exact (their bytes come off the budget).")
    p.add_argument("--reference", default="bfloat16", help="The dtype the ratios are relative to.")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="The model dtype, in which int4/int2 keep the filling blocks exact (auto: what `kvserve "
                        "serve --dtype auto` picks on this machine) (default: %(default)s).")
    p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    p.set_defaults(func=run_plan_kv)


def run_plan_kv(ns: argparse.Namespace) -> int:
    """``kvserve plan-kv``: the capacity table (ValueError for bad sizes or unknown dtypes)."""
    import json

    from kvserve.core.kv_capacity import format_plan, plan_kv, rows_as_dicts
    from kvserve.core.kv_cache_spec import get_kv_format
    from kvserve.model_loader import load_hf_config, resolve_model

    path, fmt = resolve_model(ns.model, "auto")
    cfg = load_hf_config(path, fmt)
    if getattr(cfg, "kv_lora_rank", None):  # multi-head latent attention: the latent rows
        return _plan_kv_mla(ns, path, cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtypes = [get_kv_format(d).name for d in ns.kv_cache_dtype] if ns.kv_cache_dtype else None
    model_dtype = getattr(ns, "dtype", "auto")
    if model_dtype == "auto":
        import torch

        from kvserve.engine.arg_utils import resolve_auto_dtype

        model_dtype = resolve_auto_dtype("cuda" if torch.cuda.is_available() else "cpu", cfg)
    rows = plan_kv(cfg.num_hidden_layers, kv_heads, head_dim, int(ns.gpu_memory * 2**30), ns.max_model_len,
                   ns.block_size, dtypes, get_kv_format(ns.reference).name, ns.max_num_seqs, model_dtype)
    if ns.json:
        print(json.dumps({"model": path, "num_layers": cfg.num_hidden_layers, "num_kv_heads": kv_heads,
                          "head_dim": head_dim, "model_dtype": model_dtype, "gpu_memory_gib": ns.gpu_memory, "max_model_len": ns.max_model_len,
                          "rows": rows_as_dicts(rows)}, indent=2))
    else:
        print(f"{os.path.basename(path)}: {cfg.num_hidden_layers} layers x {kv_heads} KV heads x {head_dim}, "
              f"{ns.gpu_memory:g} GiB of KV, max_model_len {ns.max_model_len}")
        print(format_plan(rows, get_kv_format(ns.reference).name))


def _plan_kv_mla(ns: argparse.Namespace, path: str, cfg) -> int:
    """``plan-kv`` for an MLA model (DeepSeek-V2/V3): latent rows vs the expanded multi-head cache."""
    import json

    from kvserve.core.kv_capacity import format_plan, plan_kv_mla, rows_as_dicts
    from kvserve.core.kv_cache_spec import get_kv_format

    dims = dict(kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                num_heads=cfg.num_attention_heads, qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim)
    dtypes = [get_kv_format(d).name for d in ns.kv_cache_dtype] if ns.kv_cache_dtype else None
    ref = get_kv_format(ns.reference).name
    rows = plan_kv_mla(cfg.num_hidden_layers, budget_bytes=int(ns.gpu_memory * 2**30), max_model_len=ns.max_model_len,
                       block_size=ns.block_size, dtypes=dtypes, reference=ref, **dims)
    if ns.json:
        print(json.dumps({"model": path, "num_layers": cfg.num_hidden_layers, "attention": "mla", **dims,
                          "gpu_memory_gib": ns.gpu_memory, "max_model_len": ns.max_model_len,
                          "rows": rows_as_dicts(rows)}, indent=2))
    else:
        print(f"{os.path.basename(path)}: {cfg.num_hidden_layers} layers, multi-head latent attention: "
              f"{cfg.kv_lora_rank} + {cfg.qk_rope_head_dim} values per token and layer (vs {cfg.num_attention_heads} "
              f"heads x ({cfg.qk_nope_head_dim} + {cfg.qk_rope_head_dim} + {cfg.v_head_dim}) expanded), "
              f"{ns.gpu_memory:g} GiB of KV, max_model_len {ns.max_model_len}")
        print(format_plan(rows, f"mha_expanded_{ref}"))
    return 0


# --------------------------------------------------------------------------- export

def _register_export(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export", help="Write a Hugging Face tokenizer + config directory for a model (e.g. a GGUF).",
        description="Write the model's tokenizer (tokenizer.json, tokenizer_config.json, chat template) and "
                    "config.json into DIR, so tools that load a Hugging Face tokenizer (AIPerf, lm-eval, "
                    "bench serve --tokenizer) work offline. Weights are not copied.",
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="A .gguf file or HF directory (default: the embedded SmolLM2-135M-Instruct).")
    p.add_argument("out_dir", metavar="DIR", help="Output directory (new or empty).")
    p.set_defaults(func=run_export)


def run_export(ns: argparse.Namespace) -> int:
    """``kvserve export [MODEL] DIR``."""
    from kvserve.model_loader import export_hf

    try:
        files = export_hf(ns.model, ns.out_dir)
    except FileExistsError as exc:
        raise ValueError(str(exc)) from None
    print(f"wrote {', '.join(files)} to {ns.out_dir}")
    return 0


# --------------------------------------------------------------------------- main

#: One registration function per subcommand; each adds its parser and sets ``func``.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_generate,
    _register_chat,
    _register_bench,
    _register_serve,
    _register_plan_kv,
    _register_export,
    _register_router,
    _register_launch,
]


def build_parser() -> argparse.ArgumentParser:
    """The full ``kvserve`` parser with every registered subcommand."""
    parser = KVServeArgumentParser(
        prog="kvserve", description="kvserve: a small LLM inference engine built around the KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point. Returns the exit status (0 ok, 2 usage/engine input error, 130 Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)  # argparse exits 2 itself on bad flags
    ns.argv = argv  # `kvserve launch` passes its engine flags on to its workers verbatim
    ns.command_line = shlex.join(["kvserve", *argv])
    try:
        rc = ns.func(ns)
    except (ValueError, FileNotFoundError) as exc:
        sys.stdout.flush()
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return 0 if rc is None else int(rc)


def entry() -> NoReturn:
    """The ``kvserve`` console script and ``python -m kvserve.entrypoints.cli``: ``main()``, then exit.

    When ``main`` returns, the atexit handlers run and stdout/stderr are flushed, then the
    process ends with ``os._exit(status)``, skipping the interpreter's tear-down (destroying
    the objects of ~2,700 modules: torch, transformers, sympy), which took 1.0-1.7 s of each
    ``kvserve generate`` on a 2-core machine. An exception out of ``main`` (``SystemExit``
    from argparse included), or a non-daemon thread still alive (a KV tier's file writer),
    exits the usual way. Tests call ``main`` instead.
    """
    import atexit
    import threading

    status = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(status)  # e.g. a KV tier's writer threads: the normal exit joins them, os._exit would not
    atexit._run_exitfuncs()  # logging.shutdown, multiprocessing children, weakref finalizers
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to write
            pass
    os._exit(status)


if __name__ == "__main__":
    entry()
