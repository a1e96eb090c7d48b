"""Host time of a speculative decode step (EAGLE-3, n-gram or suffix; chain drafts), split at the engine's seams.

While speculation is on the engine runs steps one at a time (the drafts of step N are needed
to schedule step N + 1), so every millisecond of host work in a speculative step is on the
critical path. This script runs decode steps of a tiny random Llama (6 layers, float32) with a
random EAGLE-3 head (``--method eagle3``) or a model-free proposer (``--method ngram`` / ``suffix``:
prompts of a repeated random span, so lookups find matches) on the CPU, ``k`` drafts per request, and reports per step the calling
thread's CPU time (``time.thread_time``: the figure that holds on a shared machine) and wall
time in these buckets:

- scheduler: ``Scheduler.schedule`` / ``update_from_output`` (drafts scheduled, accepted tokens applied);
- input prep: ``InputBatch.apply`` / ``prepare``, attention metadata, block ops, the rest of
  ``execute_model_async``;
- forward / logits: the target's forward (on the CPU the device time is the forward itself), ``compute_logits``;
- sampling + rejection: ``ModelRunner._sample`` (draft positions), ``Sampler.launch``, ``verify``,
  the seeded requests' generator replay;
- output: the read-back and token append (``AsyncModelRunnerOutput.get``), ``EngineCore._update``,
  the output processor;
- proposer: ``ModelRunner.propose``, ``record_hidden_states``, ``propose``'s per-request Python, the
  head's block allocation and block tables, its attention metadata, the draft graph runner's packed copy;
- draft forward: the head's forward and its greedy token choice (``k`` draft steps; with
  ``--draft-graphs`` the whole replay, one graph launch on CUDA);
- other: the rest of ``LLMEngine.step``.

Times are exclusive (a seam inside another is subtracted from the outer one), so the buckets
add up to the step. The seams are wrapped from here (``step_profile.SeamTimer``): the engine
carries no timers. ``--draft-graphs`` runs the head through the draft graph runner's CPU
stand-in (``DraftGraphRunner(eager=True)``: the static-buffer path the GPU replays), as on CUDA.

Usage:
    PYTHONPATH=. python3 benchmarks/spec_step_host.py --batch 1 16 --k 4 --steps 40 --out <dir>
    PYTHONPATH=. python3 benchmarks/spec_step_host.py --method ngram --batch 1 16 --k 4 --out <dir>
    PYTHONPATH=. python3 benchmarks/spec_step_host.py --cpu-smoke     # seconds: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from step_profile import SeamTimer, install_seams  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)

BUCKETS = {
    "schedule": "scheduler", "update_from_output": "scheduler",
    "batch.apply": "input prep", "batch.prepare": "input prep", "attn.prepare": "input prep",
    "attn.build": "input prep", "graph.run": "input prep", "block_ops": "input prep",
    "runner.execute_model_async": "input prep",
    "model.forward": "forward", "compute_logits": "logits",
    "runner._sample": "sampling + rejection", "sampler.launch": "sampling + rejection",
    "verify": "sampling + rejection", "replay_generator": "sampling + rejection",
    "output.get": "output", "engine._update": "output", "output_processor": "output",
    "runner.propose": "proposer", "proposer.record": "proposer", "proposer.propose": "proposer",
    "proposer.blocks": "proposer", "proposer.metadata": "proposer", "draft_graphs.run": "proposer",
    "draft.forward": "draft forward", "draft.greedy": "draft forward", "draft_graphs.replay": "draft forward",
    "step": "other",
}
ORDER = ["scheduler", "input prep", "forward", "logits", "sampling + rejection", "output", "proposer",
         "draft forward", "other"]


def install_spec_seams(llm) -> SeamTimer:
    """``step_profile``'s seams plus the proposer's and the verification's (see ``BUCKETS``)."""
    from kvserve.worker import runner_output

    t = install_seams(llm)
    runner = llm.llm_engine.engine_core.model_runner
    p = runner.proposer
    t.wrap(runner, "execute_model_async", "runner.execute_model_async")  # its own body: device inputs
    t.wrap(runner, "propose", "runner.propose")
    t.wrap(runner_output, "verify", "verify")
    t.wrap(runner_output, "replay_generator", "replay_generator")
    t.wrap(p, "propose", "proposer.propose")
    if not hasattr(p, "head"):  # a model-free proposer (ngram, suffix): its propose is all of it
        return t
    t.wrap(p, "record_hidden_states", "proposer.record")
    for name in ("_ensure_blocks", "_block_tables"):
        if hasattr(p, name):
            t.wrap(p, name, "proposer.blocks")
    t.wrap(p, "_forward", "proposer.metadata")  # the head's attention metadata; its forward is below
    t.wrap(p.head, "forward", "draft.forward")
    t.wrap(p.head, "greedy_tokens", "draft.greedy")
    if p.draft_graphs is not None:
        t.wrap(p.draft_graphs, "run", "draft_graphs.run")
        # the replayed steps: one graph launch on CUDA, the head's Python on the CPU stand-in
        t.wrap(p.draft_graphs, "_steps", "draft_graphs.replay")
    return t


def make_llm(a, batch: int, max_len: int):
    import transformers

    from kvserve import LLM
    from kvserve.models.llama_eagle import save_random_eagle_head

    tmp = tempfile.mkdtemp(prefix="spec-step-host-")
    cfg = transformers.LlamaConfig(**TINY)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    target = os.path.join(tmp, "target")
    model.save_pretrained(target)
    spec = {"method": a.method, "num_speculative_tokens": a.k, "dynamic": False}
    if a.method == "eagle3":
        head = os.path.join(tmp, "head")
        save_random_eagle_head(head, cfg, eagle3=True, seed=1, std=0.1)
        spec["model"] = head
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_memory="64MiB",
              max_num_seqs=max(batch, 1), max_model_len=max_len, disable_log_stats=True, cpu_threads=1,
              enable_prefix_caching=False, speculative_config=spec)
    if a.draft_graphs and a.method == "eagle3":
        llm.llm_engine.engine_core.model_runner.proposer.capture_cuda_graphs(eager=True)
    return llm


def profile(a, batch: int) -> dict:
    from kvserve import SamplingParams

    out_len = (a.steps + 8) * (a.k + 1) + 16
    llm = make_llm(a, batch, a.context + out_len + 64)
    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    timer = install_spec_seams(llm)
    timer.enabled = False
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(temperature=a.temperature, seed=a.seed, max_tokens=out_len, ignore_eos=True)
    for _ in range(batch):
        if a.method == "eagle3":
            prompt = torch.randint(3, TINY["vocab_size"], (a.context,), generator=g).tolist()
        else:  # an input-grounded prompt: a random span repeated, so that lookups find matches
            span = torch.randint(3, TINY["vocab_size"], (16,), generator=g).tolist()
            prompt = (span * (a.context // 16 + 1))[: a.context]
        eng.add_request(None, prompt, sp)
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        eng.step()
    for _ in range(4):  # the first drafting steps
        eng.step()
    timer.enabled = True
    timer.reset()
    walls = []
    stats0 = (eng.stats.num_draft_tokens, eng.stats.num_accepted_tokens)
    for _ in range(a.steps):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    timer.restore()
    n = a.steps
    seams = {k: v / n * 1e3 for k, v in sorted(timer.totals.items())}
    seams_cpu = {k: v / n * 1e3 for k, v in sorted(timer.cpu.items())}
    b_wall: dict[str, float] = defaultdict(float)
    b_cpu: dict[str, float] = defaultdict(float)
    for k in seams:
        b_wall[BUCKETS.get(k, "other")] += seams[k]
        b_cpu[BUCKETS.get(k, "other")] += seams_cpu[k]
    device_like = ("forward", "logits", "draft forward")
    drafted = eng.stats.num_draft_tokens - stats0[0]
    res = dict(method=a.method, batch=batch, running=len(sched.running), k=a.k, steps=n,
               step_ms=round(sum(walls) / n * 1e3, 3), step_ms_median=round(statistics.median(walls) * 1e3, 3),
               step_cpu_ms=round(sum(b_cpu.values()), 3),
               host_cpu_ms=round(sum(v for k, v in b_cpu.items() if k not in device_like), 3),
               host_ms=round(sum(v for k, v in b_wall.items() if k not in device_like), 3),
               buckets_cpu_ms={k: round(b_cpu.get(k, 0.0), 3) for k in ORDER},
               buckets_ms={k: round(b_wall.get(k, 0.0), 3) for k in ORDER},
               seams_cpu_ms={k: round(v, 3) for k, v in seams_cpu.items()},
               seams_ms={k: round(v, 3) for k, v in seams.items()},
               calls_per_step={k: round(v / n, 2) for k, v in sorted(timer.calls.items())},
               draft_tokens=drafted, accepted_tokens=eng.stats.num_accepted_tokens - stats0[1])
    eng.shutdown()
    return res


def print_result(r: dict) -> None:
    print(f"\nbatch {r['batch']} ({r['running']} running), k={r['k']}: {r['step_ms']:.2f} ms/step wall "
          f"(median {r['step_ms_median']:.2f}), {r['step_cpu_ms']:.2f} ms CPU; host (no forwards) "
          f"{r['host_cpu_ms']:.2f} ms CPU, {r['host_ms']:.2f} ms wall; accepted {r['accepted_tokens']} of "
          f"{r['draft_tokens']} drafts")
    print(f"  {'':<22} {'CPU ms':>8} {'wall ms':>8}")
    for k in ORDER:
        print(f"  {k:<22} {r['buckets_cpu_ms'][k]:8.3f} {r['buckets_ms'][k]:8.3f}")
    print("  seams (CPU ms): " + ", ".join(f"{k} {v:.3f}" for k, v in r["seams_cpu_ms"].items()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "ngram", "suffix"],
                    help="proposer: eagle3 (a random head), or a model-free lookup over a repeated-span prompt")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=40, help="speculative steps timed per batch")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None, help="per-request seed (seeded sampling)")
    ap.add_argument("--draft-graphs", action="store_true",
                    help="draft through the draft graph runner's CPU stand-in (the GPU path's host work)")
    ap.add_argument("--out", default=None, help="directory for spec_step_host.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny and short: checks that the script runs")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.batch, a.steps, a.context = [1, 4], 3, 16
    torch.set_num_threads(1)
    shape = "tiny-llama-6l (hidden 64, vocab 512)" + (" + random EAGLE-3 head" if a.method == "eagle3" else "")
    res = dict(device="cpu", method=a.method, shape=shape, k=a.k,
               context=a.context, temperature=a.temperature, seed=a.seed, draft_graphs=a.draft_graphs,
               torch=torch.__version__, results=[])
    for b in a.batch:
        r = profile(a, b)
        print_result(r)
        res["results"].append(r)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "spec_step_host.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
