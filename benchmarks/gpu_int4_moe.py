"""GPU: GPTQ / AWQ INT4 MoE experts (``layers.moe.group_quant_experts``) against bf16 experts, one H200.

Parts (``--parts``, comma separated):

- ``kernel``: one Qwen3-30B-A3B MoE layer (H 2048, 128 experts, top-8, I 768) with random GPTQ 4-bit symmetric
  group-128 experts, ``fused_experts_w4a16`` beside the bf16 ``triton_moe.fused_experts_triton`` at T = 1, 16,
  64, 256 tokens. Timed as ``gpu_moe.py`` times the fused MoE (CUDA graphs of 8 calls cycling over 4 copies of
  the layer's weights and 8 routings, so L2 holds none of the experts between calls; median of replays).
  Bytes: distinct experts hit x (packed 4-bit weights + fp16 scales) for INT4, x 3 H I x 2 for bf16; GB/s of
  those bytes, their floor over the copy bandwidth measured here, and the speed-up of INT4 over bf16.
- ``models``: the Qwen3-30B-A3B shape (``gpu_moe.QWEN3_30B_A3B``, dummy weights) with bf16 experts
  (``--quantization`` unset) and with dummy GPTQ experts and projections (``--quantization gptq``: 4-bit
  symmetric group 128, quantized at load), each in its own process: batch-1 decode ms/token
  (``workloads._step_times``, median of steps 8..72) and batch-64 output tok/s (64 prompts of ISL 128 /
  OSL 64, random ids, ignore_eos; ``max_num_seqs`` 64). The two processes share the time left before
  ``--deadline``; each writes its records as it goes (a cut process keeps the figures it took).

``--cpu-smoke``: the kernel part at tiny shapes under the Triton interpreter and the models part with a
tiny Qwen3-MoE config on the CPU (float32): a check that the script runs, not a measurement.

    PYTHONPATH=. python3 benchmarks/gpu_int4_moe.py --out $OUT [--parts kernel,models] [--deadline 85]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

TOKENS = (1, 16, 64, 256)
SHAPE = dict(H=2048, E=128, top_k=8, I=768, group=128)
SMOKE_SHAPE = dict(H=64, E=8, top_k=2, I=32, group=32)
SMOKE_MODEL = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64,
                   intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                   max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _random_gptq_experts(e: int, n: int, k: int, group: int, dev: str, g: torch.Generator):
    """``GroupQuantExperts`` of random 4-bit codes, symmetric, fp16 scales (a GPTQ checkpoint's layout)."""
    from kvserve.layers.moe.group_quant_experts import GroupQuantExperts
    from kvserve.layers.quantization.group_quant import GroupQuantWeight

    ws = [GroupQuantWeight(torch.randint(0, 16, (n, k), device=dev, generator=g, dtype=torch.uint8),
                           (torch.rand(n, k // group, device=dev, generator=g) * 0.004 + 0.001).half().float(),
                           None, 4, group) for _ in range(e)]
    return GroupQuantExperts(ws, torch.device(dev), torch.bfloat16)


_RECORDS: list[dict] = []  # every record of this run (int4_moe.json)


def kernel_part(bw: float, emit, smoke: bool = False) -> None:
    from gpu_weight_quant import _time

    from kvserve.layers.moe import select_experts
    from kvserve.layers.moe import triton_moe as tm
    from kvserve.layers.moe.group_quant_experts import fused_experts_w4a16, w4a16_moe_config

    dev = "cpu" if smoke else "cuda"
    s = SMOKE_SHAPE if smoke else SHAPE
    h, e, k, i, grp = s["H"], s["E"], s["top_k"], s["I"], s["group"]
    g = torch.Generator(device=dev).manual_seed(0)
    n_copies = 1 if smoke else 4
    bf16 = [(torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
             torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=g) * 0.02) for _ in range(n_copies)]
    q4 = [(_random_gptq_experts(e, 2 * i, h, grp, dev, g), _random_gptq_experts(e, h, i, grp, dev, g))
          for _ in range(n_copies)]
    per_bf16 = 3 * h * i * 2
    per_q4 = sum(w.nbytes() for w in q4[0]) / e
    n_calls, iters = (1, 1) if smoke else (8, 20)
    for t in ((1, 16) if smoke else TOKENS):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
        routes = [select_experts(torch.randn(t, e, device=dev, generator=g), k, renormalize=True) for _ in range(8)]
        hit = statistics.fmean(int(torch.unique(ids).numel()) for _, ids in routes)
        base = dict(part="kernel", shape="qwen3-30b-a3b" if not smoke else "tiny", H=h, E=e, top_k=k, I=i,
                    group_size=grp, tokens=t, experts_hit=round(hit, 2))
        res = {}
        for name, fn, per in (
                ("bf16", lambda c, r: tm.fused_experts_triton(x, bf16[c][0], bf16[c][1], *r), per_bf16),
                ("gptq-int4", lambda c, r: fused_experts_w4a16(x, q4[c][0], q4[c][1], *r), per_q4)):
            nbytes = hit * per
            try:
                us = _time([lambda j=j: fn(j % n_copies, routes[j % 8]) for j in range(n_calls)], dev, iters) * 1e3
                res[name] = us
                rec = dict(base, experts=name, us=round(us, 2), expert_bytes=int(nbytes),
                           weight_gb_s=round(nbytes / us / 1e3, 1), floor_us=round(nbytes / bw * 1e6, 2),
                           roofline_fraction=round(nbytes / bw * 1e6 / us, 3),
                           config=list(w4a16_moe_config(t) if name != "bf16" else tm.moe_config(t)))
                if name != "bf16" and "bf16" in res:
                    rec["speedup_vs_bf16"] = round(res["bf16"] / us, 2)
                emit(rec)
            except Exception as ex:
                emit(dict(base, experts=name, error=repr(ex)[:300]))
        if smoke:  # the two paths agree on the same (dequantized) weights
            from kvserve.layers.moe import fused_experts_torch

            w13 = torch.stack([q4[0][0].dequantize(j) for j in range(e)])
            w2 = torch.stack([q4[0][1].dequantize(j) for j in range(e)])
            ref = fused_experts_torch(x.float(), w13, w2, *routes[0])
            got = fused_experts_w4a16(x.float(), q4[0][0], q4[0][1], *routes[0])
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def one_model(a: argparse.Namespace) -> None:
    """One engine configuration in this process (a child of ``models``); records rewritten into ``a.result``."""
    import numpy as np
    from gpu_moe import QWEN3_30B_A3B, bytes_per_token, write_config
    from workloads import _step_times

    from kvserve import LLM, SamplingParams

    out: list[dict] = []

    def emit(r: dict) -> None:
        out.append(r)
        with open(a.result, "w") as f:
            json.dump(out, f)

    cfg = SMOKE_MODEL if a.cpu_smoke else QWEN3_30B_A3B
    path = write_config(cfg, a.tmp)
    quant = None if a.one == "bf16" else a.one
    args = dict(load_format="dummy", skip_tokenizer_init=True, disable_log_stats=True, max_model_len=1024,
                max_num_seqs=64, quantization=quant)
    args.update(dict(dtype="float32", device="cpu", kv_cache_memory="64MiB") if a.cpu_smoke else
                dict(dtype="bfloat16", gpu_memory_utilization=0.9))
    t0 = time.perf_counter()
    llm = LLM(model=path, **args)
    startup = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    steps = 24 if a.cpu_smoke else 72
    _step_times(llm, rng.integers(0, 10000 if not a.cpu_smoke else 200, 128).tolist(), 8)  # warm-up
    times = _step_times(llm, rng.integers(0, 10000 if not a.cpu_smoke else 200, 128).tolist(), steps)
    b = bytes_per_token(cfg)
    emit(dict(part="model", model="qwen3-30b-a3b" if not a.cpu_smoke else "tiny-qwen3-moe", experts=a.one,
              figure="batch-1 decode", ms_per_token=round(statistics.median(times[8:]), 3),
              bf16_bytes_per_token=b, startup_s=round(startup, 1), engine_args=args))
    n, isl, osl = (8, 32, 8) if a.cpu_smoke else (64, 128, 64)
    prompts = [rng.integers(0, min(cfg["vocab_size"], 10000), isl).tolist() for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=osl, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    emit(dict(part="model", model="qwen3-30b-a3b" if not a.cpu_smoke else "tiny-qwen3-moe", experts=a.one,
              figure=f"batch-{n} ISL/OSL {isl}/{osl}", output_tok_per_s=round(n_out / wall, 1),
              wall_s=round(wall, 2), output_tokens=n_out, engine_args=args))
    llm.shutdown()


def models_part(a: argparse.Namespace, deadline: float, emit) -> None:
    todo = ["bf16", "gptq"]
    for n_done, name in enumerate(todo):
        timeout = max(20.0, (deadline - time.time()) / (len(todo) - n_done))
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--result", f.name, "--tmp", a.tmp]
            if a.cpu_smoke:
                cmd.append("--cpu-smoke")
            err = None
            try:
                subprocess.run(cmd, check=True, stdout=sys.stderr, timeout=timeout)
            except Exception as ex:  # keep what the child wrote before failing or running out of time
                err = repr(ex)[:300]
            try:
                recs = json.load(open(f.name))
            except (OSError, ValueError):
                recs = []
            if err:
                recs.append(dict(part="model", experts=name, error=err))
        for r in recs:
            emit(r)
    ms = {r["experts"]: r for r in _RECORDS if r.get("figure") == "batch-1 decode"}
    if "bf16" in ms and "gptq" in ms:
        emit(dict(part="model", figure="gptq vs bf16", batch1_speedup=round(ms["bf16"]["ms_per_token"] /
                                                                            ms["gptq"]["ms_per_token"], 3)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="kernel,models", help="kernel, models")
    ap.add_argument("--deadline", type=float, default=85, help="seconds from start: the model processes share the "
                                                               "time left after the kernel part")
    ap.add_argument("--tmp", default=os.path.join(tempfile.gettempdir(), "kvserve-int4-moe"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one engine configuration
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter): a check "
                                                             "that the script runs")
    a = ap.parse_args()
    if a.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.makedirs(a.tmp, exist_ok=True)
    if a.one:
        one_model(a)
        return
    if not torch.cuda.is_available() and not a.cpu_smoke:
        sys.exit("gpu_int4_moe.py needs a CUDA GPU (or --cpu-smoke)")
    start = time.time()
    os.makedirs(a.out, exist_ok=True)
    out_path = os.path.join(a.out, "int4_moe.json")

    def emit(r: dict) -> None:
        _RECORDS.append(r)
        print(json.dumps(r), flush=True)
        with open(out_path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if not a.cpu_smoke else "cpu", torch=torch.__version__,
                           records=_RECORDS), f, indent=1)

    parts = a.parts.split(",")
    if "kernel" in parts:
        from gpu_moe import copy_bandwidth

        kernel_part(copy_bandwidth() if not a.cpu_smoke else 1e11, emit, a.cpu_smoke)
    if "models" in parts:  # the interpreter's kernel smoke takes minutes: no deadline there
        models_part(a, start + (a.deadline if not a.cpu_smoke else 1200), emit)
    print("\nexperts    figure                      value", flush=True)
    for r in _RECORDS:
        if r.get("part") == "kernel" and "us" in r:
            print(f"{r['experts']:<10} kernel T={r['tokens']:<4}             {r['us']:>9.1f} us "
                  f"{r['weight_gb_s']:>7.1f} GB/s" + (f"  x{r['speedup_vs_bf16']} vs bf16"
                                                      if "speedup_vs_bf16" in r else ""))
        elif r.get("part") == "model" and "ms_per_token" in r:
            print(f"{r['experts']:<10} batch-1 decode              {r['ms_per_token']:>9.3f} ms/token")
        elif r.get("part") == "model" and "output_tok_per_s" in r:
            print(f"{r['experts']:<10} {r['figure']:<27} {r['output_tok_per_s']:>9.1f} tok/s")


if __name__ == "__main__":
    main()
