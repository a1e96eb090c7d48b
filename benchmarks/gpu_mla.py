"""GPU: multi-head latent attention (MLA). The Triton MLA decode kernel alone, and a
DeepSeek-V2-Lite-shaped engine with dummy weights.

Parts:
- ``kernel``: the absorbed decode kernel (``kvserve/attention/triton/mla_decode.py``) at batch
  64 x 8K context, latent rows of 512 + 64 values (bf16, and FP8 e4m3 + scale), for 16 heads
  (V2-Lite) and 128 heads (DeepSeek-V3): GB/s of latent read (``B * S * row bytes`` per call)
  against a measured device-to-device copy (bytes read + written per second; goal >= 75%) and
  TFLOP/s, over a sweep of tiles (the table's entry first, then ``_kernel_candidates``) and
  split counts within ``--kernel-budget`` seconds; every tile is checked against the torch path
  first. The best per case is recorded (``best``, ``best_num_splits``: the
  ``MLA_DECODE_CONFIGS`` entry to keep).
- ``tp`` (not in the default ``--parts``; two GPUs): the V2-Lite shape at tensor_parallel_size
  2 then 1, each engine in its own process: batch-1 ms/token and batch-64 decode tok/s
  (128-token prompts), within ``--tp-deadline`` seconds.
- ``engine`` (its own subprocess): DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads,
  kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, 64 routed + 2 shared experts, top-6,
  moe_intermediate 1408, first_k_dense_replace 1, vocab 102400) through ``kvserve.LLM``:
  batch-1 ms/token; KV capacity in tokens (and 32K-token requests) beside the same bytes
  holding the latent expanded to per-head K and V (computed); offline throughput of
  ``--num-requests`` requests of 1000 prompt / 1000 output tokens.
- ``mtp`` (not in the default ``--parts``): DeepSeek multi-token prediction (``deepseek_mtp``)
  on a DeepSeek-V3-shaped small config with one MTP layer (``V3_MTP``: query LoRA 1536,
  kv_lora_rank 512, 16 heads of 128 + 64, 64 routed experts top-8 in 8 groups + 1 shared,
  ``--mtp-layers`` decoder layers), dummy weights: batch-1 ms/token without speculation and
  with k = ``--mtp-ks``, ``dynamic`` off. Random weights accept (almost) no drafts, so this is
  the cost side only: ms per step with the verify (1 + k tokens) and the MTP layer's drafting,
  against a plain decode step; ``break_even_tokens_per_step`` is the mean accepted length a
  real checkpoint needs for MTP to pay off at batch 1.

- ``mtp-graphs`` (not in the default ``--parts``): the same V3-shaped config with
  ``deepseek_mtp`` k = 4: the MTP layer's draft steps eager vs captured in CUDA graphs, ms per
  call at batch 1 and 16 for k = 1..4, and engine ms/token with the draft graphs off vs on
  (``draft_graph_cost.py``; about 60 s).

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 benchmarks/gpu_mla.py --out $OUT [--parts kernel,engine]
    PYTHONPATH=. python3 benchmarks/gpu_mla.py --out $OUT --parts mtp [--mtp-ks 1,2]   (about 60 s)
    PYTHONPATH=. python3 benchmarks/gpu_mla.py --out $OUT --parts kernel --kernel-budget 40   (part mla-kernel)
    PYTHONPATH=. python3 benchmarks/gpu_mla.py --out $OUT --parts tp --tp-deadline 138        (part mla-tp2)
    PYTHONPATH=. python3 benchmarks/gpu_mla.py --cpu-smoke --out /tmp/mla [--parts kernel,engine,mtp,tp]
Writes ``--out/mla.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Iterator

V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
    max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=100000, eos_token_id=100001,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "beta_fast": 32, "beta_slow": 1},
    architectures=["DeepseekV2ForCausalLM"],
)
TINY = dict(V2_LITE, vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
            max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
V3_MTP = dict(
    vocab_size=129280, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1, n_routed_experts=64, num_experts_per_tok=8,
    n_group=8, topk_group=4, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    num_nextn_predict_layers=1, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "beta_fast": 32, "beta_slow": 1},
    architectures=["DeepseekV3ForCausalLM"],
)
TINY_MTP = dict(V3_MTP, vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=2,
                topk_group=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _time_cuda(fn, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` (CUDA events, after two warm-up calls)."""
    import torch

    fn()
    fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _time(fn, device: str, iters: int = 10) -> float:
    """Milliseconds of ``fn``: CUDA events on the GPU, one wall-clock call on the CPU (smoke)."""
    if device == "cuda":
        return _time_cuda(fn, iters)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read per second (a copy of N bytes reads N and writes N)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_cuda(lambda: dst.copy_(src), 10)
    return nbytes / (ms * 1e-3)


def _kernel_candidates(heads: int, fp8: bool, smoke: bool) -> list[tuple]:
    """Tiles to sweep after the table's entry, most promising first: ``(block_h, block_n, block_v,
    num_warps, num_stages, swap, ctas_per_sm, f16)``. Each fits the H200's 227 KiB of shared
    memory per block and compiles without (or with few) register spills for sm_90 (checked
    offline with ptxas): 64 positions x 576 values per stage take 72 KiB, and separate column
    blocks (``block_v < 512``) double the staged rows, so they are left out at these sizes."""
    if smoke:
        return [(16, 16, 32, 4, 1, True, 1, fp8), (16, 16, 16, 4, 1, False, 1, False)]
    if heads <= 16 and not fp8:
        return [(16, 32, 512, 4, 3, True, 3, False), (16, 64, 512, 4, 2, True, 1, False),
                (16, 64, 512, 8, 2, True, 1, False), (16, 32, 512, 4, 2, False, 2, False),
                (16, 64, 512, 8, 2, False, 1, False)]
    if heads <= 16:
        return [(16, 32, 512, 4, 3, True, 3, True), (16, 32, 512, 4, 3, True, 3, False),
                (16, 64, 512, 8, 3, False, 1, True), (16, 64, 512, 8, 2, True, 1, True)]
    if not fp8:
        return [(64, 32, 512, 8, 2, False, 1, False), (32, 64, 512, 8, 2, True, 1, False),
                (64, 64, 512, 8, 2, False, 1, False), (64, 32, 256, 8, 2, False, 1, False)]
    return [(32, 32, 512, 8, 3, False, 2, True), (32, 64, 512, 8, 3, False, 1, False),
            (16, 32, 512, 4, 3, True, 3, True), (64, 32, 512, 8, 3, False, 1, True)]


def kernel(device: str, smoke: bool, budget_s: float = 50.0) -> Iterator[dict]:
    """The MLA decode kernel vs the torch path, then timed over tile shapes and split counts
    (GPU) within ``budget_s`` seconds (compiles included), the best recorded per case."""
    import dataclasses

    import torch

    from kvserve.attention.kv_format import kv_format_for
    from kvserve.attention.mla import mla_decode_torch
    from kvserve.attention.triton.mla_decode import MLADecodeConfig, choose_num_splits, decode_config, mla_decode

    t_start = time.perf_counter()
    lora, rope, bs = (512, 64, 16) if not smoke else (32, 8, 4)
    batch, ctx = (64, 8192) if not smoke else (2, 40)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    copy_bps = copy_bandwidth() if device == "cuda" else None
    if copy_bps:  # the goal's reference: bytes a device copy moves (read + write) per second
        yield dict(part="copy", gb_s=round(copy_bps / 1e9, 1), copy_traffic_gb_s=round(2 * copy_bps / 1e9, 1))
    cases = [(16, False), (128, False), (16, True), (128, True)] if not smoke else [(4, False), (4, True)]
    shares = [0.35, 0.25, 0.25, 0.15][: len(cases)]  # of the budget: the memory-bound goal case first
    for i, (heads, fp8) in enumerate(cases):
        g = torch.Generator(device="cpu").manual_seed(0)
        nblk = batch * (ctx // bs) + 1
        gd = torch.Generator(device=device).manual_seed(0)  # 0.6 GB: drawn where it lives
        cache = torch.randn(1, nblk, bs, 1, lora + rope, generator=gd, device=device, dtype=dtype)
        fmt = kv_format_for("mla_fp8_e4m3", lora + rope) if fp8 else None
        if fp8:
            cache = fmt.encode(cache)
        tables = (torch.randperm(nblk - 1, generator=g)[: batch * (ctx // bs)] + 1).view(batch, ctx // bs)
        tables = tables.int().to(device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = (torch.randn(batch, heads, lora + rope, generator=g) * 0.1).to(dtype).to(device)
        scale = (128 + 64) ** -0.5
        k = min(4, batch)
        ref = mla_decode_torch(q[:k], cache, tables, [ctx] * k, lora, scale, fmt)
        default = decode_config(heads, fp8, torch.device(device))
        rec = dict(part="kernel", heads=heads, latent="fp8_e4m3" if fp8 else str(dtype).removeprefix("torch."),
                   batch=batch, context=ctx, kv_lora_rank=lora, qk_rope=rope, default=dataclasses.asdict(default))
        latent_bytes = batch * ctx * cache.shape[-1] * cache.element_size()
        flops = batch * ctx * heads * 2 * (2 * lora + rope)  # q.k over L + R, p.v over L
        rec.update(latent_bytes=latent_bytes, flops=flops)
        sweep: list[dict] = []
        best = None
        # each case gets an equal share of what is left of the budget
        now = time.perf_counter()
        case_end = now + (t_start + budget_s - now) * shares[i] / sum(shares[i:])
        cands = [default] + [MLADecodeConfig(*c) for c in _kernel_candidates(heads, fp8, smoke)]
        for j, cfg in enumerate(cands):
            if j > 0 and time.perf_counter() > case_end:
                sweep.append(dict(dataclasses.asdict(cfg), skipped="budget"))
                continue
            ent = dataclasses.asdict(cfg)
            try:
                got = mla_decode(q[:k], cache, tables[:k], lens[:k], lora, scale, ctx, fp8=fp8, config=cfg).float()
                ent["max_abs_err_vs_torch"] = round(float((got - ref).abs().max()), 5)
                if ent["max_abs_err_vs_torch"] > 2e-2:  # a wrong tile is not a fast one
                    ent["error"] = "mismatch"
                else:
                    ms = _time(lambda: mla_decode(q, cache, tables, lens, lora, scale, ctx, fp8=fp8, config=cfg),
                               device)
                    ent.update(us=round(ms * 1e3, 1), gb_s=round(latent_bytes / (ms * 1e-3) / 1e9, 1))
                    if best is None or ms < best[0]:
                        best = (ms, cfg, None)
            except Exception as e:  # a tile that does not fit (shared memory / registers)
                ent["error"] = repr(e)[:160]
            sweep.append(ent)
        rec["max_abs_err_vs_torch"] = max((e["max_abs_err_vs_torch"] for e in sweep if "max_abs_err_vs_torch" in e),
                                          default=None)
        if best is not None:  # split counts around the heuristic's, on the best tile (no recompile)
            cfg = best[1]
            hb = -(-heads // cfg.block_h) * (512 // cfg.block_v)
            auto = choose_num_splits(batch, hb, ctx, q.device, cfg.block_n, cfg.ctas_per_sm)
            rec["best_auto_num_splits"] = auto
            for ns in sorted(({max(1, auto // 2), auto * 2} | ({2, 4, 8, 16} if not smoke else set())) - {auto}):
                if time.perf_counter() > case_end + 3:
                    break
                ms = _time(lambda: mla_decode(q, cache, tables, lens, lora, scale, ctx, fp8=fp8, config=cfg,
                                              num_splits=ns), device)
                sweep.append(dict(dataclasses.asdict(cfg), num_splits=ns, us=round(ms * 1e3, 1),
                                  gb_s=round(latent_bytes / (ms * 1e-3) / 1e9, 1)))
                if ms < best[0]:
                    best = (ms, cfg, ns)
            ms_default = sweep[0]["us"] / 1e3 if "us" in sweep[0] else None
            ms, cfg, ns = best
            rec.update(us_default=round(ms_default * 1e3, 1) if ms_default else None,
                       gb_s_default=round(latent_bytes / (ms_default * 1e-3) / 1e9, 1) if ms_default else None,
                       us_best=round(ms * 1e3, 1), best=dataclasses.asdict(cfg), best_num_splits=ns,
                       gb_s_best=round(latent_bytes / (ms * 1e-3) / 1e9, 1),
                       tflops_best=round(flops / (ms * 1e-3) / 1e12, 1))
            if copy_bps:
                rec["fraction_of_copy_best"] = round(latent_bytes / (ms * 1e-3) / (2 * copy_bps), 3)
                if ms_default:
                    rec["fraction_of_copy_default"] = round(latent_bytes / (ms_default * 1e-3) / (2 * copy_bps), 3)
        rec["sweep"] = sweep
        yield rec
        cache = None  # free before the next case allocates


def _config_dir(tmp: str, cfg: dict) -> str:
    import transformers

    os.makedirs(tmp, exist_ok=True)
    kw = dict(cfg)
    arch = kw.pop("architectures")
    c = (transformers.DeepseekV3Config if arch == ["DeepseekV3ForCausalLM"] else transformers.DeepseekV2Config)(**kw)
    c.architectures = arch
    c.save_pretrained(tmp)
    return tmp


def engine_inner(path: str, device: str, smoke: bool, num_requests: int, eager: bool, out_path: str) -> dict:
    """Runs in its own process: capacity, batch-1 decode, offline throughput (the record is
    rewritten to ``out_path`` after each, so a timeout keeps what was measured)."""
    import numpy as np
    import torch

    from kvserve import LLM, SamplingParams

    cfg = TINY if smoke else V2_LITE
    kw = dict(model=path, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32",
              skip_tokenizer_init=True, device=device, max_model_len=4096 if not smoke else 256,
              max_num_seqs=num_requests, disable_log_stats=True, enforce_eager=eager)
    if smoke:
        kw.update(kv_cache_memory="8MiB", cpu_threads=1)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    eng = llm.llm_engine
    kv_cfg = eng.engine_core.kv_cache_config
    spec = kv_cfg.groups[0].spec
    layers = kv_cfg.num_layers
    tokens = (kv_cfg.groups[0].num_blocks - 1) * spec.block_size
    latent_bpt = kv_cfg.bytes_per_token
    mha_bpt = layers * spec.reference_bytes_per_token("bfloat16" if device == "cuda" else "float32")
    mha_tokens = int(kv_cfg.total_bytes // mha_bpt)
    rec = dict(part="engine", shape="DeepSeek-V2-Lite" if not smoke else "tiny", load_s=round(load_s, 1),
               enforce_eager=eager, kv_cache_gib=round(kv_cfg.total_bytes / 2**30, 2),
               latent_bytes_per_token=latent_bpt, expanded_mha_bytes_per_token=mha_bpt,
               kv_capacity_tokens=tokens, expanded_mha_capacity_tokens=mha_tokens,
               capacity_factor=round(tokens / max(mha_tokens, 1), 2),
               concurrent_32k_requests=tokens // 32768, expanded_mha_concurrent_32k_requests=mha_tokens // 32768,
               describe=kv_cfg.describe())

    def save() -> None:
        with open(out_path, "w") as f:
            json.dump(rec, f)

    save()
    # batch 1 decode
    n = 128 if not smoke else 8
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([[1, 2, 3, 4] * 32], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = llm.generate([list(range(10, 138))], sp, use_tqdm=False)[0]
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    m = out.metrics
    ttft = (m.first_token_time - m.arrival_time) if getattr(m, "first_token_time", None) else None
    decode_ms = (wall - (ttft or 0)) * 1e3 / max(n - 1, 1)
    rec.update(batch1_ms_per_token=round(decode_ms, 3), batch1_wall_s=round(wall, 2))
    # the weights a decode step reads at batch 1: dense parts + 6 routed + 2 shared experts per MoE layer
    if not smoke:
        h, i_moe, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
        model = eng.engine_core.model_runner.model
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        routed = (cfg["num_hidden_layers"] - 1) * e * 3 * h * i_moe * 2
        active = total - routed + (cfg["num_hidden_layers"] - 1) * cfg["num_experts_per_tok"] * 3 * h * i_moe * 2
        rec.update(weight_bytes=total, active_weight_bytes_batch1=active,
                   batch1_floor_ms_at_4_8TB_s=round(active / 4.8e12 * 1e3, 3))
    save()
    # offline throughput
    rng = np.random.default_rng(0)
    plen, olen = (1000, 1000) if not smoke else (16, 8)
    prompts = [rng.integers(0, cfg["vocab_size"], plen).tolist() for _ in range(num_requests)]
    sp = SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    rec.update(offline_requests=num_requests, offline_prompt_len=plen, offline_output_len=olen,
               offline_wall_s=round(wall, 1), offline_output_tok_s=round(num_requests * olen / wall, 1),
               preemptions=eng.stats.num_preemptions)
    save()
    return rec


def engine(tmp: str, device: str, smoke: bool, num_requests: int, timeout: float) -> list[dict]:
    """The engine part in a subprocess (a fresh CUDA context); CUDA graphs first, eager if that fails."""
    path = _config_dir(os.path.join(tmp, "v2-lite" if not smoke else "tiny"), TINY if smoke else V2_LITE)
    recs = []
    for eager in (False, True):
        out = os.path.join(tmp, f"engine_{int(eager)}.json")
        cmd = [sys.executable, __file__, "--engine-inner", path, "--engine-out", out,
               "--num-requests", str(num_requests)] + (["--cpu-smoke"] if smoke else []) + (["--eager"] if eager else [])
        if os.path.exists(out):
            os.remove(out)
        try:
            p = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
            sys.stdout.write(p.stdout[-4000:])
            sys.stderr.write(p.stderr[-4000:])
            ok = p.returncode == 0 and os.path.exists(out)
        except subprocess.TimeoutExpired:
            ok, p = False, None
            if os.path.exists(out):  # what was measured before the limit
                with open(out) as f:
                    recs.append(dict(json.load(f), timed_out=True))
                break
        if ok:
            with open(out) as f:
                recs.append(json.load(f))
            break
        recs.append(dict(part="engine", enforce_eager=eager,
                         error=("timeout" if p is None else (p.stderr or "")[-600:])))
    return recs


def _decode_rate(llm, prompt_len: int, out_len: int, batch: int, vocab: int) -> tuple[float, float]:
    """``gpu_tensor_parallel.decode_rate`` with prompts drawn below ``vocab``."""
    from gpu_tensor_parallel import decode_rate

    return decode_rate(llm, prompt_len, out_len, batch, vocab=vocab)


def tp_inner(path: str, tp: int, device: str, smoke: bool) -> dict:
    """Runs in its own process: one engine at ``tp`` ranks; batch-1 ms/token and batch-64
    decode tok/s (128-token prompts)."""
    from kvserve import LLM

    cfg = TINY if smoke else V2_LITE
    t0 = time.perf_counter()
    llm = LLM(model=path, load_format="dummy", dtype="float32" if smoke else "bfloat16", skip_tokenizer_init=True,
              max_model_len=512 if smoke else 2048, tensor_parallel_size=tp, max_num_seqs=64,
              kv_cache_memory="16MiB" if smoke else "16GiB", device=device, disable_log_stats=True,
              **({"cpu_threads": 1} if smoke else {}))
    startup = time.perf_counter() - t0
    n1, nb, b = (4, 2, 4) if smoke else (64, 32, 64)
    plen = 16 if smoke else 128
    _decode_rate(llm, plen, 4, 1, cfg["vocab_size"])  # warm-up
    ms1, _ = _decode_rate(llm, plen, n1, 1, cfg["vocab_size"])
    msb, tps = _decode_rate(llm, plen, nb, b, cfg["vocab_size"])
    rec = dict(part="tp", shape="DeepSeek-V2-Lite" if not smoke else "tiny", tp=tp, startup_s=round(startup, 1),
               batch1_ms_per_token=round(ms1, 3), batch=b, batch_ms_per_token=round(msb, 3),
               batch_tok_per_s=round(tps, 1), prompt_len=plen,
               kv_describe=llm.llm_engine.engine_core.kv_cache_config.describe())
    llm.shutdown()
    return rec


def tp_compare(tmp: str, device: str, smoke: bool, deadline: float) -> Iterator[dict]:
    """TP=2 then TP=1, each in its own process (a fresh CUDA context, GPUs released between),
    within ``deadline`` seconds: TP=2 gets 60% of it."""
    path = _config_dir(os.path.join(tmp, "v2-lite" if not smoke else "tiny"), TINY if smoke else V2_LITE)
    t_start = time.perf_counter()
    import signal

    for tp, share in ((2, 0.6), (1, 1.0)):
        left = deadline - (time.perf_counter() - t_start)
        limit = max(5.0, left * share)
        cmd = [sys.executable, __file__, "--tp-inner", f"{tp},{path}"] + (["--cpu-smoke"] if smoke else [])
        # its own session: a timeout ends the engine's workers too, before the next engine starts
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=limit)
            lines = [x for x in out.splitlines() if x.startswith("{")]
            yield json.loads(lines[-1]) if p.returncode == 0 and lines else \
                dict(part="tp", tp=tp, error=(err or out)[-1500:])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            yield dict(part="tp", tp=tp, error=f"timeout after {limit:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-mla")
    ap.add_argument("--parts", default="kernel,engine")
    ap.add_argument("--num-requests", type=int, default=128, help="offline requests of 1000/1000 tokens")
    ap.add_argument("--engine-timeout", type=float, default=420.0)
    ap.add_argument("--mtp-ks", default="1,2", help="mtp part: num_speculative_tokens values (beside 0: off)")
    ap.add_argument("--mtp-layers", type=int, default=8, help="mtp part: decoder layers of the target")
    ap.add_argument("--mtp-deadline", type=float, default=45.0, help="mtp part: start no engine after this (s)")
    ap.add_argument("--kernel-budget", type=float, default=45.0, help="kernel part: seconds for the tile sweep")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ap.add_argument("--tp-deadline", type=float, default=None,
                    help="tp part: seconds for TP=2 and TP=1 (default 140; 400 with --cpu-smoke)")
    ap.add_argument("--engine-inner", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp-inner", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    device = "cpu" if ns.cpu_smoke else "cuda"
    if ns.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if ns.tp_inner:
        tp, path = ns.tp_inner.split(",", 1)
        print(json.dumps(tp_inner(path, int(tp), device, ns.cpu_smoke)), flush=True)
        return
    if ns.engine_inner:
        engine_inner(ns.engine_inner, device, ns.cpu_smoke, ns.num_requests if not ns.cpu_smoke else 4, ns.eager,
                     ns.engine_out)
        return
    import torch

    os.makedirs(ns.out, exist_ok=True)
    records: list[dict] = []

    def emit(r: dict) -> None:
        records.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "sweep"}), flush=True)
        with open(os.path.join(ns.out, "mla.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", records=records), f,
                      indent=1)

    parts = ns.parts.split(",")
    if "kernel" in parts:
        try:
            for r in kernel(device, ns.cpu_smoke, ns.kernel_budget):
                emit(r)
        except Exception as e:
            emit(dict(part="kernel", error=repr(e)[:400]))
    if "engine" in parts:
        for r in engine(ns.tmp, device, ns.cpu_smoke, ns.num_requests, ns.engine_timeout):
            emit(r)
    if "mtp" in parts or "mtp-graphs" in parts:
        from gpu_mla_mtp import mtp, mtp_graphs
    if "mtp" in parts:
        try:
            for r in mtp(ns.tmp, device, ns.cpu_smoke, [int(x) for x in ns.mtp_ks.split(",") if x], ns.mtp_layers,
                         ns.mtp_deadline):
                emit(r)
        except Exception as e:
            emit(dict(part="mtp", error=repr(e)[:400]))
    if "mtp-graphs" in parts:
        try:
            for r in mtp_graphs(ns.tmp, device, ns.cpu_smoke, ns.mtp_layers):
                emit(r)
        except Exception as e:
            emit(dict(part="mtp-graphs", error=repr(e)[:400]))
    if "tp" in parts:
        try:
            for r in tp_compare(ns.tmp, device, ns.cpu_smoke, ns.tp_deadline or (400.0 if ns.cpu_smoke else 140.0)):
                emit(r)
        except Exception as e:
            emit(dict(part="tp", error=repr(e)[:400]))
    print("\n| part | figure |\n|--|--|")
    for r in records:
        if r.get("error"):
            fig = "error: " + r["error"].strip().splitlines()[-1][:120] if r["error"].strip() else "error"
        elif r["part"] == "copy":
            fig = f"device copy {r['gb_s']} GB/s read, {r.get('copy_traffic_gb_s')} GB/s read + write"
        elif r["part"] in ("draft_cost", "draft_engine"):
            from draft_graph_cost import table

            print(table([r])[0])
            continue
        elif r["part"] == "tp":
            fig = (f"{r['shape']} TP={r['tp']}: batch-1 {r['batch1_ms_per_token']} ms/token, batch {r['batch']} "
                   f"{r['batch_tok_per_s']} tok/s ({r['batch_ms_per_token']} ms/step), start-up {r['startup_s']} s")
        elif r["part"] == "mtp" and r["k"] == 0:
            fig = (f"{r['shape']} ({r['num_hidden_layers']} layers + 1 MTP): no speculation: batch-1 "
                   f"{r['batch1_ms_per_token']} ms/token")
        elif r["part"] == "mtp":
            fig = (f"{r['shape']} ({r['num_hidden_layers']} layers + 1 MTP): k={r['k']}: batch-1 "
                   f"{r['batch1_ms_per_token']} ms/token, {r.get('ms_per_step')} ms/step, propose "
                   f"{r.get('propose_ms_mean')} ms, acceptance {r.get('acceptance_rate')} (random weights)"
                   + (f", break-even {r['break_even_tokens_per_step']} tokens/step"
                      if "break_even_tokens_per_step" in r else ""))
        elif r["part"] == "kernel":
            fig = (f"H={r['heads']} {r['latent']} b{r['batch']} x {r['context']}: err {r['max_abs_err_vs_torch']}"
                   + (f", {r['us_best']} us, {r['gb_s_best']} GB/s ({r.get('fraction_of_copy_best')} of copy), "
                      f"{r['tflops_best']} TFLOP/s; default {r.get('gb_s_default')} GB/s; best "
                      + ",".join(f"{k}={v}" for k, v in r["best"].items()) + f",splits={r['best_num_splits']}"
                      if "us_best" in r else ""))
        else:
            fig = (f"{r['shape']}: batch-1 {r.get('batch1_ms_per_token')} ms/token; KV {r['kv_capacity_tokens']} tokens "
                   f"vs {r['expanded_mha_capacity_tokens']} expanded ({r['capacity_factor']}x); offline "
                   f"{r.get('offline_output_tok_s')} out tok/s")
        print(f"| {r['part']} | {fig} |")


if __name__ == "__main__":
    main()
