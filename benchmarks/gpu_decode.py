"""GPU decode benchmarks: W2 (batch-1 decode latency, Llama-3.1-8B shape) beside transformers'
static-cache `generate`, W1 with a chosen attention backend, and the decode step time at
batch 1, 8, 64, 256 with 1k context (Qwen3-0.6B shape), each next to its roofline.

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 benchmarks/gpu_decode.py --out $OUT --backends torch_ref,triton [--w1-backends triton] [--skip-peer]
Writes one JSON record per figure to --out/decode_bench.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_equality import QWEN3_06B, env, w1  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HBM_BYTES_PER_S = 3.0e12  # measured device-to-device copy on the H100 (GPU.md)

LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
)


def _config_dir(tmp: str, name: str, cfg: dict, cls_name: str) -> str:
    import transformers

    path = os.path.join(tmp, name)
    getattr(transformers, cls_name)(**cfg).save_pretrained(path)
    return path


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_latency(llm, prompt_len: int, out_len: int, batch: int) -> list[float]:
    """Wall times (ms) between ``out_len`` consecutive engine steps while all ``batch``
    requests decode (measured after every prompt is prefilled; the requests are given
    enough tokens to still be running then, and aborted after).

    No device syncs inside the timed loop: with async scheduling the host prepares step
    N+1 while the device runs step N, and a step's return marks its tokens reaching the
    host, so in steady state the interval is the time per step as a user sees it.
    """
    from kvserve import SamplingParams

    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    budget = eng.config.scheduler_config.max_num_batched_tokens
    prefill_steps = -(-batch * prompt_len // budget)
    sp = SamplingParams(temperature=0, max_tokens=out_len + prefill_steps + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    ids = [eng.add_request(None, torch.randint(0, 10000, (prompt_len,), generator=g).tolist(), sp)
           for _ in range(batch)]
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        eng.step()  # prefill (early requests already decode meanwhile)
    assert len(sched.running) == batch, (len(sched.running), batch)
    torch.cuda.synchronize()
    stamps = [time.perf_counter()]
    for _ in range(out_len):
        eng.step()
        stamps.append(time.perf_counter())
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def w2_ours(tmp: str, backend: str) -> dict:
    from kvserve import LLM

    path = _config_dir(tmp, "llama-3.1-8b-config", LLAMA31_8B, "LlamaConfig")
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              attention_backend=backend, max_model_len=4096, kv_cache_memory="4GiB", disable_log_stats=True)
    weight_bytes = _param_bytes(llm.llm_engine.engine_core.model_runner.model)
    decode_latency(llm, 128, 16, 1)  # warm-up
    times = decode_latency(llm, 128, 256, 1)
    ms = statistics.median(times[8:])
    floor = weight_bytes / HBM_BYTES_PER_S * 1e3
    del llm
    torch.cuda.empty_cache()
    return dict(workload="W2", backend=backend, ms_per_token=round(ms, 3), roofline_ms=round(floor, 3),
                roofline_fraction=round(floor / ms, 4), weight_bytes=weight_bytes)


def w2_peer() -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA31_8B), dtype=torch.bfloat16).cuda().eval()
    x = torch.randint(0, 10000, (1, 128), device="cuda")
    res = {}
    for label, n in (("warm", 16), ("short", 8), ("long", 264)):
        gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                              eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
        torch.cuda.synchronize()
        res[label] = time.perf_counter() - t0
    # (long - short) / 256 cancels the prefill and the first steps.
    ms = (res["long"] - res["short"]) / 256 * 1e3
    del model
    torch.cuda.empty_cache()
    return dict(workload="W2", peer="transformers generate, static cache", ms_per_token=round(ms, 3))


def _bytes_per_token(runner) -> int:
    """KV bytes per token (this tree's KV cache spec, or the older runner attribute)."""
    cfg = getattr(runner, "kv_cache_config", None)
    return cfg.bytes_per_token if cfg is not None else runner.bytes_per_token


def graph_replay_ms(runner, b: int) -> float | None:
    """Device time of the decode forward alone (the CUDA graph of batch ``b``, replayed on
    the last step's inputs; CUDA events), to split a step into kernel time and the rest."""
    gr = runner.graph_runner
    keys = list(getattr(gr, "graphs", {}))
    key = b  # older runners: per batch size; then (b, q); now (b, q, aux), the plain graph without aux
    if keys and isinstance(keys[0], tuple):
        key = (b, 1) if len(keys[0]) == 2 else (b, 1, False)
    if gr is None or key not in gr.graphs:
        return None
    graph, _ = gr.graphs[key]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / 20, 3)


def decode_steps(tmp: str, backend: str, profile_dir: str | None = None) -> list[dict]:
    from kvserve import LLM

    path = _config_dir(tmp, "qwen3-0.6b-config", QWEN3_06B, "Qwen3Config")
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              attention_backend=backend, max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.8,
              disable_log_stats=True)
    runner = llm.llm_engine.engine_core.model_runner
    weight_bytes = _param_bytes(runner.model)
    out = []
    decode_latency(llm, 64, 8, 4)  # warm-up
    for b in (1, 8, 64, 256):
        times = decode_latency(llm, 1024, 24, b)
        ms = statistics.median(times[4:])
        kv_bytes = _bytes_per_token(runner) * b * (1024 + 12)
        floor = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
        out.append(dict(workload=f"decode_step_qwen3-0.6b_b{b}_ctx1k", backend=backend, ms_per_step=round(ms, 3),
                        output_tok_per_s=round(b / ms * 1e3, 1), roofline_ms=round(floor, 4),
                        roofline_fraction=round(floor / ms, 4), gpu_forward_ms=graph_replay_ms(runner, b)))
    if profile_dir:
        import cProfile
        import io
        import pstats

        for b in (1, 256):  # host time per step by function; the GPU wait is *synchronize
            prof = cProfile.Profile()
            prof.enable()
            times = decode_latency(llm, 1024, 64, b)
            prof.disable()
            st = pstats.Stats(prof)
            wait = sum(v[2] for k, v in st.stats.items() if "synchronize" in k[2])
            steps = len(times) + 1
            host_ms = (st.total_tt - wait) / steps * 1e3
            buf = io.StringIO()
            buf.write(f"batch {b}: median step {statistics.median(times[4:]):.3f} ms under cProfile; "
                      f"host (not waiting for the GPU) {host_ms:.3f} ms/step over {steps} steps\n")
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
            with open(os.path.join(profile_dir, f"decode_b{b}_profile.txt"), "w") as f:
                f.write(buf.getvalue())
            out.append(dict(workload=f"host_time_qwen3-0.6b_b{b}_ctx1k", backend=backend,
                            host_ms_per_step=round(host_ms, 3), gpu_wait_ms_per_step=round(wait / steps * 1e3, 3),
                            note="cProfile: total time minus time in *synchronize, per step"))
    del llm
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-gpu")
    ap.add_argument("--backends", default="torch_ref,triton")
    ap.add_argument("--w1-backends", default="triton", help="backends to run W1 with ('' for none)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--w1-sync-too", action="store_true", help="also run W1 with async scheduling off")
    ap.add_argument("--w1-profile", action="store_true", help="also run W1 under cProfile (w1_profile.txt)")
    ap.add_argument("--step-profile", action="store_true",
                    help="profile decode steps at batch 1 and 256: host time per step (decode_b*_profile.txt)")
    ap.add_argument("--skip-w2", action="store_true")
    ap.add_argument("--skip-steps", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.tmp, exist_ok=True)
    e = env()
    recs = []

    def emit(r):
        r = {**r, **e}
        recs.append(r)
        json.dump(recs, open(os.path.join(a.out, "decode_bench.json"), "w"), indent=1)
        print(json.dumps({k: v for k, v in r.items() if k not in e}), flush=True)

    if not a.skip_peer:
        emit(w2_peer())
    for b in a.backends.split(","):
        if not a.skip_w2:
            emit(w2_ours(a.tmp, b))
        if not a.skip_steps:
            for r in decode_steps(a.tmp, b, a.out if (a.w1_profile or a.step_profile) else None):
                emit(r)
        if b in a.w1_backends.split(","):
            emit(w1(a.tmp, b))
            if a.w1_sync_too:
                emit(w1(a.tmp, b, async_scheduling=False))
            if a.w1_profile:
                emit(w1(a.tmp, b, profile_path=os.path.join(a.out, "w1_profile.txt")))
    print(f"\n{e['device']} torch {e['torch']} triton {e['triton']} commit {e['commit'][:10]}")
    for r in recs:
        fig = r.get("ms_per_token") or r.get("ms_per_step") or r.get("output_tok_per_s") or r.get("host_ms_per_step")
        print(f"{r['workload']:36s} {r.get('backend', r.get('peer', '')):36s} {fig!s:>10s}  roofline {r.get('roofline_fraction', '')}")


if __name__ == "__main__":
    main()
