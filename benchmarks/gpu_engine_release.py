"""Engines built and shut down in one process give their GPU memory back.

    python benchmarks/gpu_engine_release.py --out DIR [--rounds 3] [--requests 256]

Each round builds ``LLM`` on the Qwen3-0.6B shape (dummy bf16 weights, ``--gpu-memory-
utilization 0.9``, CUDA graphs on), runs a W1-like load (``--requests`` prompts of 100-1024
random tokens, 100-512 output tokens, temperature 0.6, ``ignore_eos``), then ``shutdown()``,
``del``, ``gc.collect()`` and ``torch.cuda.empty_cache()``, and records the device's free
memory (``torch.cuda.mem_get_info``) and the time of the load. Pass: after every round the
free memory is back within ``--bound-gib`` of what it was before the first engine, and every
round starts (no "0 blocks" error). Writes ``engine_release.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/kvserve_engine_release")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-out", type=int, default=512)
    p.add_argument("--bound-gib", type=float, default=1.0)
    ns = p.parse_args(argv)
    import torch

    from kvserve import LLM, SamplingParams
    from workloads import write_config

    os.makedirs(ns.out, exist_ok=True)
    model = write_config("w1", False, tempfile.mkdtemp())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(ns.requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, ns.max_out), seed=i)
              for i in range(ns.requests)]
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    rounds = []
    for i in range(ns.rounds):
        r = dict(round=i)
        try:
            llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                      max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
            r["free_after_start_gib"] = torch.cuda.mem_get_info()[0] / 2**30
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            r["load_s"] = time.perf_counter() - t
            r["output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
            llm.shutdown()
            r["free_after_shutdown_gib"] = torch.cuda.mem_get_info()[0] / 2**30
            del llm, outs
        except Exception as exc:  # noqa: BLE001 - a round that cannot start is the failure measured
            r["error"] = f"{type(exc).__name__}: {exc}"[:500]
        gc.collect()
        torch.cuda.empty_cache()
        r["free_after_del_gib"] = torch.cuda.mem_get_info()[0] / 2**30
        rounds.append(r)
        print(json.dumps(r), flush=True)
    ok = all("error" not in r and free0 / 2**30 - r["free_after_del_gib"] <= ns.bound_gib for r in rounds)
    res = dict(device=torch.cuda.get_device_name(0), total_gib=total / 2**30, free_before_gib=free0 / 2**30,
               rounds=rounds, bound_gib=ns.bound_gib, passed=ok, command=" ".join(sys.argv))
    with open(os.path.join(ns.out, "engine_release.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("| round | free after start | after shutdown | after del (GiB) | load s |\n|--|--|--|--|--|")
    for r in rounds:
        print(f"| {r['round']} | {r.get('free_after_start_gib', 0):.1f} | {r.get('free_after_shutdown_gib', 0):.1f} "
              f"| {r['free_after_del_gib']:.1f} | {r.get('load_s', r.get('error'))} |")
    print(f"| before | {free0 / 2**30:.1f} GiB free of {total / 2**30:.1f} | | {'PASS' if ok else 'FAIL'} | |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
