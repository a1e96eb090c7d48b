"""GPU: the fused MoE kernel alone and MoE models end to end (dummy weights), beside weight-read rooflines.

Parts (``--parts``, comma separated):

- ``kernel``: ``triton_moe.fused_experts_triton`` alone at the Qwen3-30B-A3B layer shape (H 2048, 128 experts,
  top-8, I 768, bf16; also FP8 experts at T = 1 and 16) and the gpt-oss-20b layer shape (H 2880, 32 experts,
  top-4, I 2880, biases, swigluoai) at T = 1, 16, 256, 4096 tokens. Timed from CUDA graphs of 32 calls (CUDA
  events, median of replays after warm-up; ``gpu_weight_quant._time``), the calls cycling over 4 copies of the
  layer's weights and 8 routings so that L2 holds none of the experts between calls. Roofline: bytes of the
  experts actually touched (distinct experts hit x 3 x H x I x bytes per weight, plus biases) over the device
  copy bandwidth measured here (a 2 GiB device-to-device copy, read + write bytes / time) -> fraction of the
  weight-read roofline. The torch loop (``fused_experts_torch``, eager: it syncs with the host) at T = 1 and 16
  for comparison.
- ``sweep``: kernel configurations around the table's at the Qwen3 shape, T = 1 and 16, until ``--deadline``
  (for retuning ``MOE_CONFIGS``).
- ``models``: each configuration in its own subprocess, through ``kvserve.LLM`` with ``load_format="dummy"`` and
  a config.json written here:
  * ``qwen3-moe``: Qwen3-30B-A3B shape (48 layers, hidden 2048, 128 experts top-8, moe_intermediate 768, 32 q /
    4 KV heads of 128, vocab 151936): batch-1 decode ms/token (``workloads._step_times``: median interval of
    engine steps 8..256 after a 128-token prompt) and its floor (bytes read per token: attention and router
    weights, the 8 routed experts per layer, the embedding row and the whole LM head, over the copy
    bandwidth); then offline output tok/s at ISL/OSL 1000/1000 (512 prompts of random ids, ignore_eos).
  * ``gpt-oss``: gpt-oss-20b shape (24 layers, hidden 2880, 64 q / 8 KV heads of 64, 32 experts top-4,
    intermediate 2880, sliding window 128 on alternate layers, vocab 201088) at ISL/OSL 1000/1000 beside
    TensorRT-LLM's published 13,890 output tok/s on one H200. Skipped with a message when
    ``GptOssForCausalLM`` is not a registered architecture (likewise ``Qwen3MoeForCausalLM``).

JSON records go to ``--out/moe.json`` (one list, rewritten after each record), the table to the console last.

    PYTHONPATH=. python3 benchmarks/gpu_moe.py --out $OUT --parts kernel[,sweep --deadline 100]
    PYTHONPATH=. python3 benchmarks/gpu_moe.py --out $OUT --parts models [--models qwen3-moe,gpt-oss]
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

TRT_LLM_GPT_OSS_20B_H200 = 13890.0  # output tok/s, ISL/OSL 1000/1000, one H200 (TensorRT-LLM's published figure)

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)
GPT_OSS_20B = dict(
    model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, swiglu_limit=7.0,
    rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                           truncate=False, original_max_position_embeddings=4096),
    max_position_embeddings=131072, initial_context_length=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)
MODELS = {"qwen3-moe": QWEN3_30B_A3B, "gpt-oss": GPT_OSS_20B}
# Kernel shapes: (name, H, E, top_k, I, activation, bias)
KERNEL_SHAPES = [("qwen3-30b-a3b", 2048, 128, 8, 768, "silu", False),
                 ("gpt-oss-20b", 2880, 32, 4, 2880, "swigluoai", True)]
TOKENS = (1, 16, 256, 4096)


def copy_bandwidth(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth, bytes/s: (read + write) bytes of a ``nbytes`` device-to-device copy / time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def _time_eager(fn, iters: int = 20) -> float:
    """Median ms per call, CUDA events around each call (for paths that sync with the host)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():  # --cpu-smoke
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_part(bw: float, sweep: bool, deadline: float, emit, smoke: bool = False) -> None:
    """The kernel figures; ``sweep``: instead, only the configuration sweep (Qwen3 shape, T = 1 and 16) until
    ``deadline`` (time.time()). ``smoke``: tiny shapes on the CPU under the Triton interpreter (script check)."""
    from gpu_weight_quant import _time

    from kvserve.layers.moe import fused_experts_torch, select_experts
    from kvserve.layers.moe import triton_moe as tm

    dev = "cpu" if smoke else "cuda"
    shapes = [(n, 32, 8, min(k, 2), 32, act, b) for n, _, _, k, _, act, b in KERNEL_SHAPES] if smoke else KERNEL_SHAPES
    tokens = (1, 16) if smoke else TOKENS
    for name, h, e, k, i, act, bias in (shapes[:1] if sweep else shapes):
        g = torch.Generator(device=dev).manual_seed(0)
        copies = []
        for _ in range(4):
            w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
            w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
            b13 = torch.randn(e, 2 * i, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 if bias else None
            b2 = torch.randn(e, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 if bias else None
            copies.append((w13, w2, b13, b2))
        per_expert = 3 * h * i * 2 + ((3 * i + h) * 2 if bias else 0)
        fp8 = None
        if name.startswith("qwen3") and not sweep:  # FP8 experts (weight-only, per-channel scales) at decode sizes
            from kvserve.layers.moe.layer import quantize_expert_weights

            fp8 = [(*quantize_expert_weights(c[0], "fp8"), *quantize_expert_weights(c[1], "fp8")) for c in copies]
        for t in ((1, 16) if sweep else tokens):
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
            routes = [select_experts(torch.randn(t, e, device=dev, generator=g), k, renormalize=True)
                      for _ in range(8)]
            hit = statistics.fmean(int(torch.unique(ids).numel()) for _, ids in routes)
            nbytes = hit * per_expert
            floor_us = nbytes / bw * 1e6
            base = dict(part="kernel", shape=name, H=h, E=e, top_k=k, I=i, activation=act, bias=bias, tokens=t,
                        experts_hit=round(hit, 2), expert_bytes=int(nbytes), floor_us=round(floor_us, 2))

            n_calls, iters = (1, 1) if smoke else (8, 30)

            def calls(fn_of):
                return [lambda j=j: fn_of(copies[j % 4], routes[j]) for j in range(n_calls)]

            kw = dict(activation=act)
            if sweep:
                t_deadline = time.time() + (deadline - time.time()) / (2 if t == 1 else 1)  # half for T = 1
                for cfg in _sweep_configs(t)[:2 if smoke else None]:
                    if time.time() > t_deadline:
                        break
                    try:
                        us = _time(calls(lambda c, r: tm.fused_experts_triton(
                            x, c[0], c[1], *r, w13_bias=c[2], w2_bias=c[3], config=cfg, **kw)), dev,
                            min(iters, 20)) * 1e3
                        emit(dict(base, part="sweep", config=list(cfg), us=round(us, 2),
                                  roofline_fraction=round(floor_us / us, 3)))
                    except Exception as ex:
                        emit(dict(base, part="sweep", config=list(cfg), error=repr(ex)[:200]))
                continue
            try:
                us = _time(calls(lambda c, r: tm.fused_experts_triton(x, c[0], c[1], *r, w13_bias=c[2],
                                                                      w2_bias=c[3], **kw)), dev, iters) * 1e3
                emit(dict(base, path="triton", dtype="bf16", us=round(us, 2), roofline_fraction=round(floor_us / us, 3),
                          weight_gb_s=round(nbytes / us / 1e3, 1), config=list(tm.moe_config(t))))
            except Exception as ex:
                emit(dict(base, path="triton", dtype="bf16", error=repr(ex)[:300]))
            if t <= 16:
                try:
                    us = _time_eager(lambda: fused_experts_torch(x, copies[0][0], copies[0][1], *routes[0],
                                                                 w13_bias=copies[0][2], w2_bias=copies[0][3],
                                                                 **kw), iters) * 1e3
                    emit(dict(base, path="torch-loop", dtype="bf16", us=round(us, 2),
                              roofline_fraction=round(floor_us / us, 3)))
                except Exception as ex:
                    emit(dict(base, path="torch-loop", dtype="bf16", error=repr(ex)[:300]))
            if fp8 is not None and t <= 16:
                fb = hit * 3 * h * i  # one byte per weight (scales: 4 bytes per row, negligible)
                try:
                    us = _time([lambda j=j: tm.fused_experts_triton(x, fp8[j % 4][0], fp8[j % 4][2], *routes[j],
                                                                    w13_scale=fp8[j % 4][1], w2_scale=fp8[j % 4][3])
                                for j in range(n_calls)], dev, iters) * 1e3
                    emit(dict(base, path="triton", dtype="fp8", expert_bytes=int(fb), floor_us=round(fb / bw * 1e6, 2),
                              us=round(us, 2), roofline_fraction=round(fb / bw * 1e6 / us, 3)))
                except Exception as ex:
                    emit(dict(base, path="triton", dtype="fp8", error=repr(ex)[:300]))
        del copies, fp8
        torch.cuda.empty_cache()


def _sweep_configs(t: int) -> list[tuple]:
    """Decode-sized configurations around the table's first rows: (w13 BN, BK, warps, stages) x w2 ditto."""
    out = []
    for stages in (4, 3):
        for bn13, bk13 in ((32, 128), (16, 256), (32, 256), (64, 128)):
            for bn2, bk2 in ((64, 128), (32, 128), (64, 256), (128, 128)):
                out.append((t, 16, (bn13, bk13, 4, stages), (bn2, bk2, 4, stages), 1))
    return out


def write_config(cfg: dict, root: str) -> str:
    """config.json of ``cfg`` (through transformers' config class when it knows the model type)."""
    path = os.path.join(root, f"{cfg['model_type']}-bench-config")
    kw = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
    try:
        from transformers import AutoConfig

        AutoConfig.for_model(cfg["model_type"], **kw).save_pretrained(path)
    except (ImportError, ValueError, KeyError):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    return path


def bytes_per_token(cfg: dict) -> dict:
    """Weight bytes one batch-1 decode step reads (bf16): attention (+ router) weights of every layer, the
    routed experts (top-k per layer), one embedding row, the whole LM head."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    e = cfg.get("num_experts") or cfg["num_local_experts"]
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    k = cfg["num_experts_per_tok"]
    attn = L * (h * (q + 2 * kv) + q * h) * 2
    router = L * e * h * 2
    experts = L * k * 3 * h * i * 2
    emb = h * 2 + cfg["vocab_size"] * h * 2
    return dict(attention=attn, router=router, routed_experts=experts, embedding_and_lm_head=emb,
                total=attn + router + experts + emb)


def _llm(path: str, **kw):
    from kvserve import LLM

    args = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, disable_log_stats=True,
                max_model_len=4096, gpu_memory_utilization=0.9)
    args.update(kw)
    return LLM(model=path, **args), args


def _throughput(llm, n: int, isl: int, osl: int, vocab: int) -> dict:
    import numpy as np

    from kvserve import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(vocab, 10000), isl).tolist() for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=osl, ignore_eos=True)
    llm.generate([list(range(64))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(output_tok_per_s=round(n_out / wall, 1), wall_s=round(wall, 2), output_tokens=n_out,
                num_prompts=n, isl=isl, osl=osl, preemptions=getattr(llm.llm_engine.stats, "num_preemptions", None))


def one_model(name: str, a: argparse.Namespace) -> None:
    """One configuration in this process (the child of ``models``); records are rewritten into ``a.result``
    after each one, so a figure taken before a time-out survives it."""
    from kvserve.models.registry import supported_architectures

    out: list[dict] = []

    def emit(r: dict) -> None:
        out.append(r)
        with open(a.result, "w") as f:
            json.dump(out, f)

    cfg = MODELS[name]
    arch = cfg["architectures"][0]
    if arch not in supported_architectures():
        print(f"gpu_moe.py: skipping {name}: {arch} is not a registered kvserve architecture", file=sys.stderr)
        emit(dict(part="model", model=name, skipped=f"{arch} is not a registered kvserve architecture"))
        return
    path = write_config(cfg, a.tmp)
    bw = a.bandwidth or copy_bandwidth()
    llm, args = _llm(path, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=8192)
    if name == "qwen3-moe":
        from workloads import _step_times

        import numpy as np

        rng = np.random.default_rng(0)
        _step_times(llm, rng.integers(0, 10000, 128).tolist(), 16)  # warm-up
        times = _step_times(llm, rng.integers(0, 10000, 128).tolist(), 256)
        ms = statistics.median(times[8:])
        b = bytes_per_token(cfg)
        floor = b["total"] / bw * 1e3
        emit(dict(part="model", model=name, figure="batch-1 decode", ms_per_token=round(ms, 3),
                        floor_ms=round(floor, 3), floor_fraction=round(floor / ms, 3), bytes_per_token=b,
                        copy_gb_s=round(bw / 1e9, 1), engine_args=args))
    t = _throughput(llm, a.num_prompts, 1000, 1000, cfg["vocab_size"])
    rec = dict(part="model", model=name, figure="ISL/OSL 1000/1000", **t, engine_args=args)
    if name == "gpt-oss":
        rec.update(trt_llm_h200_tok_s=TRT_LLM_GPT_OSS_20B_H200,
                   vs_trt_llm=round(t["output_tok_per_s"] / TRT_LLM_GPT_OSS_20B_H200, 3))
    emit(rec)


def models_part(a: argparse.Namespace, bw: float, deadline: float, emit) -> None:
    """Each registered configuration in a child process, sharing the time left before ``deadline`` equally."""
    from kvserve.models.registry import supported_architectures

    todo = []
    for name in a.models.split(","):
        arch = MODELS[name]["architectures"][0]
        if arch in supported_architectures():
            todo.append(name)
        else:
            print(f"gpu_moe.py: skipping {name}: {arch} is not a registered kvserve architecture", flush=True)
            emit(dict(part="model", model=name, skipped=f"{arch} is not a registered kvserve architecture"))
    for n_done, name in enumerate(todo):
        timeout = max(30.0, (deadline - time.time()) / (len(todo) - n_done))
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--result", f.name, "--tmp", a.tmp,
                   "--bandwidth", str(bw), "--num-prompts", str(a.num_prompts), "--max-num-seqs", str(a.max_num_seqs)]
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
                recs.append(dict(part="model", model=name, error=err))
        for r in recs:
            emit(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="kernel,models", help="kernel, sweep, models")
    ap.add_argument("--models", default="qwen3-moe,gpt-oss", help=f"of {','.join(MODELS)}")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds from start: the sweep stops there; the model subprocesses share the time to it "
                         "(default: 400 s for models, no limit for the sweep)")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--tmp", default=os.path.join(tempfile.gettempdir(), "kvserve-moe"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one model configuration
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cpu-smoke", action="store_true", help="kernel/sweep parts at tiny shapes on the CPU (Triton "
                    "interpreter): checks the script runs")
    a = ap.parse_args()
    if a.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (kernel_part imports it)
    if a.one:
        one_model(a.one, a)
        return
    if not torch.cuda.is_available() and not a.cpu_smoke:
        sys.exit("gpu_moe.py needs a CUDA GPU (or --cpu-smoke)")
    os.makedirs(a.out, exist_ok=True)
    start = time.time()
    records: list[dict] = []

    def emit(r: dict) -> None:
        records.append(r)
        print(json.dumps(r), flush=True)
        with open(os.path.join(a.out, "moe.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if not a.cpu_smoke else "cpu", torch=torch.__version__,
                           records=records), f, indent=1)

    bw = copy_bandwidth() if not a.cpu_smoke else 1e11
    emit(dict(part="copy", copy_gb_s=round(bw / 1e9, 1)))
    parts = a.parts.split(",")
    if "kernel" in parts:
        kernel_part(bw, False, 0, emit, a.cpu_smoke)
    if "sweep" in parts:
        kernel_part(bw, True, start + (a.deadline or 1e9), emit, a.cpu_smoke)
    if "models" in parts:
        models_part(a, bw, start + (a.deadline or 400), emit)
    print("\n| part | shape | T | path | figure |\n|--|--|--|--|--|")
    for r in records:
        if r["part"] == "kernel":
            fig = r.get("error") or (f"{r['us']} us, floor {r['floor_us']} us ({r['roofline_fraction']:.0%}), "
                                     f"{r['experts_hit']} experts hit")
            print(f"| kernel | {r['shape']} | {r['tokens']} | {r['path']} {r['dtype']} | {fig} |")
        elif r["part"] == "model":
            if "skipped" in r or "error" in r:
                fig = r.get("skipped") or r.get("error")
            elif "ms_per_token" in r:
                fig = f"{r['ms_per_token']} ms/token, floor {r['floor_ms']} ms ({r['floor_fraction']:.0%})"
            else:
                fig = f"{r['output_tok_per_s']} out tok/s" + (f" ({r['vs_trt_llm']:.0%} of TensorRT-LLM's 13,890)"
                                                             if "vs_trt_llm" in r else "")
            print(f"| model | {r['model']} | {r.get('figure', '')} | kvserve | {fig} |")
        elif r["part"] == "copy":
            print(f"| copy | device-to-device | | | {r['copy_gb_s']} GB/s |")


if __name__ == "__main__":
    main()
