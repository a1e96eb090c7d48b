"""GPU: greedy equality vs transformers (Qwen3-0.6B shape, dummy weights)
and workload W1 with the torch_ref attention backend (the baseline for the kernel work).

Usage (on the GPU machine, from the repo root):
    PYTHONPATH=. python benchmarks/gpu_equality.py --out $OUT
Writes ``equality.json`` and ``w1_torch_ref.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], bos_token_id=1, eos_token_id=2,
)


def env() -> dict:
    import triton
    import transformers

    commit = os.environ.get("KVSERVE_COMMIT")  # first: a copied tree may carry stale git metadata
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:
            commit = "unknown"
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, python=platform.python_version(), commit=commit,
                command=" ".join([sys.executable] + sys.argv))


def equality(tmp: str) -> dict:
    """Greedy tokens of our engine vs transformers, float32, same safetensors weights."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from kvserve import LLM, SamplingParams

    cfg = Qwen3Config(**QWEN3_06B)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    path = os.path.join(tmp, "qwen3-0.6b-dummy")
    hf.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    lens = [1, 7, 16, 33, 100, 255, 512, 1000]
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in lens]
    new = 32
    ref = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
            ref.append(y[0, len(ids):].tolist())
    del hf
    torch.cuda.empty_cache()
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.5,
              max_model_len=4096, max_num_batched_tokens=512, disable_log_stats=True)
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    first_diff = []
    for a, b in zip(batched, ref):
        first_diff.append(next((k for k in range(new) if a[k] != b[k]), None))
    res = dict(test="greedy_equality_qwen3_0.6b_dummy_fp32", prompt_lens=lens, new_tokens=new,
               batched_equal=batched == ref, alone_equal=alone == ref, first_diff_batched=first_diff,
               max_num_batched_tokens=512)
    del llm
    torch.cuda.empty_cache()
    return res


def w1(tmp: str, backend: str = "torch_ref", async_scheduling: bool | None = None,
       profile_path: str | None = None) -> dict:
    """W1: 256 requests, prompts U[100,1024] random ids in [0,10000), outputs U[100,1024],
    ignore_eos, temperature 0.6, dummy bf16 weights. Metric: output tokens / wall seconds.

    ``profile_path``: also write a cProfile of the timed run there (host time per function;
    the figure is then slower than without it)."""
    import numpy as np
    from transformers import Qwen3Config

    from kvserve import LLM, SamplingParams

    path = os.path.join(tmp, "qwen3-0.6b-config")
    Qwen3Config(**QWEN3_06B).save_pretrained(path)
    rng = np.random.default_rng(0)
    in_lens = rng.integers(100, 1025, 256)
    out_lens = rng.integers(100, 1025, 256)
    prompts = [rng.integers(0, 10000, n).tolist() for n in in_lens]
    params = [SamplingParams(temperature=0.6, max_tokens=int(n), ignore_eos=True) for n in out_lens]
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              attention_backend=backend, max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.9, log_stats_interval=10,
              async_scheduling=async_scheduling)
    llm.generate([list(range(100))] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    prof = None
    if profile_path:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_callees("run|schedule|execute_model_async")
        with open(profile_path, "w") as f:
            f.write(buf.getvalue())
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == int(out_lens.sum())
    tps = n_out / wall
    cfg = llm.llm_engine.config
    preemptions = llm.llm_engine.stats.num_preemptions
    del llm
    torch.cuda.empty_cache()
    return dict(workload="W1" + ("" if profile_path is None else " (under cProfile)"), backend=backend,
                async_scheduling=cfg.async_scheduling, cuda_graphs=not cfg.enforce_eager,
                output_tok_per_s=round(tps, 1), wall_s=round(wall, 2),
                output_tokens=n_out, prompt_tokens=int(in_lens.sum()), num_requests=256,
                preemptions=preemptions, num_kv_blocks=cfg.cache_config.num_blocks,
                roofline_tok_per_s=26000, roofline_fraction=round(tps / 26000, 4),
                peer="transformers generate_batch 601.6 tok/s (GPU.md, earlier run on this H100 kind; not this run)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-gpu")
    ap.add_argument("--skip-equality", action="store_true")
    ap.add_argument("--skip-w1", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.tmp, exist_ok=True)
    e = env()
    rows = []
    if not a.skip_equality:
        r = {**equality(a.tmp), **e}
        json.dump(r, open(os.path.join(a.out, "equality.json"), "w"), indent=1)
        rows.append(("greedy equality (batched / alone)", f"{r['batched_equal']} / {r['alone_equal']}"))
    if not a.skip_w1:
        r = {**w1(a.tmp), **e}  # torch_ref
        json.dump(r, open(os.path.join(a.out, "w1_torch_ref.json"), "w"), indent=1)
        rows.append(("W1 torch_ref output tok/s", f"{r['output_tok_per_s']} ({r['wall_s']} s, {r['roofline_fraction']:.1%} of roofline)"))
    print(f"\n{e['device']} torch {e['torch']} triton {e['triton']} commit {e['commit'][:10]}")
    for k, v in rows:
        print(f"{k:40s} {v}")


if __name__ == "__main__":
    main()
