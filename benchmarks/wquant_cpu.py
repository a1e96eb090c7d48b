"""CPU: the default model (SmolLM2-135M Q4_1 GGUF) per weight format — batch-1 TPOT / TTFT, batch-N
decode throughput, weight bytes, and greedy agreement with the dequantized float32 run.

Formats: float32 and bfloat16 dequantized (today's paths), ``--quantization gguf`` (Q4_1 kept, int4 kernel),
``int8`` and ``int4`` (requantized at load from the dequantized weights). One engine per format, loaded
once. Random-token prompts, ``ignore_eos``, greedy.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/wquant_cpu.py --out benchmarks/results/wquant_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

FORMATS = {
    "f32-dequant": dict(dtype="float32"),
    "bf16-dequant": dict(dtype="bfloat16"),
    "gguf-q4_1-kept": dict(dtype="bfloat16", quantization="gguf"),
    "int8": dict(dtype="bfloat16", quantization="int8"),
    "int4": dict(dtype="bfloat16", quantization="int4"),
}
AGREE_PROMPTS = ["The capital of France is", "List three colors:", "def add(a, b):\n    return",
                 "Once upon a time, in a small village,", "Water boils at", "The best way to learn Python is"]


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, length).tolist() for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--b1-input", type=int, default=256)
    ap.add_argument("--b1-output", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bn-input", type=int, default=32)
    ap.add_argument("--bn-output", type=int, default=32)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    from kvserve import LLM, SamplingParams
    from kvserve.bench.latency import run_batch
    from kvserve.layers.quantization import weight_bytes

    records, ref_tokens = [], None
    for name in ns.formats.split(","):
        t0 = time.perf_counter()
        llm = LLM(kv_cache_memory="512MiB", max_model_len=1024, max_num_seqs=max(64, ns.batch),
                  disable_log_stats=True, **FORMATS[name])
        load_s = time.perf_counter() - t0
        runner = llm.llm_engine.engine_core.model_runner
        model = runner.model if runner is not None else None
        vocab = 49152
        sp1 = SamplingParams(max_tokens=ns.b1_output, ignore_eos=True, temperature=0.0)
        run_batch(llm, _prompts(1, 16, vocab, 9), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        el, steps = run_batch(llm, _prompts(1, ns.b1_input, vocab, 1), sp1)
        tpot_ms = statistics.mean(steps[1:]) * 1e3
        spn = SamplingParams(max_tokens=ns.bn_output, ignore_eos=True, temperature=0.0)
        eln, _ = run_batch(llm, _prompts(ns.batch, ns.bn_input, vocab, 2), spn)
        greedy = SamplingParams(max_tokens=ns.agree_tokens, temperature=0.0)
        toks = [o.outputs[0].token_ids for o in llm.generate(AGREE_PROMPTS, greedy, use_tqdm=False)]
        if ref_tokens is None:
            ref_tokens = toks
        agree = []
        for a, b in zip(ref_tokens, toks):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            agree.append(n)
        rec = dict(format=name, engine_args=FORMATS[name], load_s=round(load_s, 1),
                   b1_ttft_ms=round(steps[0] * 1e3, 1), b1_tpot_ms=round(tpot_ms, 2),
                   bn_batch=ns.batch, bn_output_tok_s=round(ns.batch * ns.bn_output / eln, 1),
                   weight_mib=round(weight_bytes(model) / 2**20, 1) if model is not None else None,
                   greedy_agree_tokens_vs_first=round(sum(agree) / len(agree), 1))
        print(json.dumps(rec), flush=True)
        records.append(rec)
        del llm
    print(f"\n{'format':<16}{'TTFT ms':>9}{'TPOT ms':>9}{'tok/s@' + str(ns.batch):>11}{'weights MiB':>13}{'agree':>7}")
    for r in records:
        print(f"{r['format']:<16}{r['b1_ttft_ms']:>9}{r['b1_tpot_ms']:>9}{r['bn_output_tok_s']:>11}"
              f"{str(r['weight_mib']):>13}{r['greedy_agree_tokens_vs_first']:>7}")
    if ns.out:
        from kvserve.bench import env

        with open(ns.out, "w") as f:
            json.dump(dict(records=records, args=vars(ns), env=env.environment() if hasattr(env, "environment")
                           else None), f, indent=1)


if __name__ == "__main__":
    main()
