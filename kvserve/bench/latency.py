"""``kvserve bench latency``: offline latency of one fixed batch through the ``LLM`` engine.

Each iteration queues ``--batch-size`` random-token prompts of ``--input-len`` tokens,
each generating exactly ``--output-len`` tokens (``ignore_eos``), and runs the engine
step by step until all finish. Figures (ms):

* ``latency``: wall time of one iteration (mean / p50 / p90 / p99 over ``--num-iters``).
* ``ms_per_output_token``: mean iteration latency / ``--output-len`` (every sequence of the
  batch advances one token per decode step).
* ``step``: per engine step, split into the first step of an iteration (prefill) and the
  others (mostly decode).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvserve.bench import report
from kvserve.bench.datasets import sample_random_requests


def run_batch(llm: Any, prompts: list[list[int]], sp: Any) -> tuple[float, list[float]]:
    """Queue the batch on ``llm.llm_engine`` and step it to completion.
    Returns (elapsed seconds, seconds of each step)."""
    eng = llm.llm_engine
    t0 = time.perf_counter()
    ids = {eng.add_request(None, p, sp) for p in prompts}
    steps = []
    try:
        while ids:
            s0 = time.perf_counter()
            outs = eng.step()
            steps.append(time.perf_counter() - s0)
            for o in outs:
                if getattr(o, "finished", True):
                    ids.discard(o.request_id)
    except BaseException:
        for rid in ids:
            eng.abort_request(rid)
        raise
    return time.perf_counter() - t0, steps


def _device(engine_args: dict) -> str:
    import torch

    from kvserve.bench.env import device_description

    device = engine_args.get("device") or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device_description(device)


def run_latency(ns: argparse.Namespace) -> int:
    """``kvserve bench latency``: print latency figures and optionally write JSON."""
    from kvserve.bench import env
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.sampling_params import SamplingParams

    if ns.batch_size < 1 or ns.input_len < 1 or ns.output_len < 1 or ns.num_iters < 1 or ns.num_iters_warmup < 0:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1 "
                         "(--num-iters-warmup >= 0)")
    engine_args = EngineArgs.from_cli_args(ns)
    llm = env.make_llm(engine_args)
    vocab = len(llm.get_tokenizer())
    reqs = sample_random_requests(ns.batch_size, (ns.input_len, ns.input_len), (ns.output_len, ns.output_len),
                                  vocab, ns.seed or 0)
    sp = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0.0)
    for i in range(ns.num_iters_warmup):
        # a different first token per warm-up, so the timed prompts get no prefix-cache hits from it
        run_batch(llm, [[(r.prompt_token_ids[0] + 1 + i) % vocab] + r.prompt_token_ids[1:] for r in reqs], sp)
    lat, first_steps, other_steps = [], [], []
    for i in range(ns.num_iters):
        prompts = [[(r.prompt_token_ids[0] + 101 + i) % vocab] + r.prompt_token_ids[1:] for r in reqs]
        elapsed, steps = run_batch(llm, prompts, sp)
        lat.append(elapsed)
        first_steps.extend(steps[:1])
        other_steps.extend(steps[1:])
    lat_ms = report.summarize_ms(lat)
    result = {
        "batch_size": ns.batch_size, "input_len": ns.input_len, "output_len": ns.output_len,
        "num_iters": ns.num_iters, "latency_ms": lat_ms,
        "ms_per_output_token": lat_ms["mean"] / ns.output_len,
        "prefill_step_ms": report.summarize_ms(first_steps),
        "decode_step_ms": report.summarize_ms(other_steps),
        "latencies_s": lat,
        "engine_args": engine_args,
        "env": report.env_info({"device": _device(engine_args)}),
        "command": getattr(ns, "command_line", None) or " ".join(sys.argv),
    }
    print(f"batch {ns.batch_size} x ({ns.input_len} in, {ns.output_len} out), {ns.num_iters} iterations:")
    print(f"  latency ms: mean {lat_ms['mean']:.2f}  p50 {lat_ms['median']:.2f}  p90 {lat_ms['p90']:.2f}"
          f"  p99 {lat_ms['p99']:.2f}")
    print(f"  {result['ms_per_output_token']:.2f} ms per output token")
    for name in ("prefill_step_ms", "decode_step_ms"):
        s = result[name]
        print(f"  {name[:-3].replace('_', ' ')} ms: mean {s['mean']:.2f}  p50 {s['median']:.2f}"
              f"  p90 {s['p90']:.2f}  p99 {s['p99']:.2f}")
    if ns.output_json:
        report.write_json(ns.output_json, result)
        print(f"wrote {ns.output_json}")
    ns.result = result
    return 0


def register_latency(subparsers: argparse._SubParsersAction) -> None:
    """Add ``latency`` to the ``kvserve bench`` subparsers."""
    from kvserve.engine.arg_utils import EngineArgs

    p = subparsers.add_parser("latency", help="Offline latency of one fixed batch (ms per token, step percentiles).",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("workload arguments")
    g.add_argument("--batch-size", type=int, default=8, help="Prompts per batch (default: %(default)s).")
    g.add_argument("--input-len", type=int, default=128, help="Prompt tokens (default: %(default)s).")
    g.add_argument("--output-len", type=int, default=64, help="Output tokens (default: %(default)s).")
    g.add_argument("--num-iters", type=int, default=5, help="Timed iterations (default: %(default)s).")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="Untimed iterations first (default: %(default)s).")
    g.add_argument("--output-json", default=None, metavar="PATH", help="Write the results as JSON here.")
    EngineArgs.add_cli_args(p)  # brings --seed
    p.set_defaults(func=run_latency)
