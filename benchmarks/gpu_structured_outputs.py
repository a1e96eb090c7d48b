"""Structured outputs on the GPU: the grammar bitmask applied to
logits on CUDA (correctness vs. the CPU, time per step), and the engine with constrained
requests mixed into a W1-like batch (CUDA graphs + async scheduling): every constrained token
obeys its mask, plain requests are unaffected, throughput with and without constrained
requests.

The GPU machine has no xgrammar and no tokenizer for dummy weights, so the constrained
requests use an allow-set "grammar" (a fixed set of token ids) through the same seam as
xgrammar's matchers: ``StructuredOutputManager.make_request_state`` / ``grammar_bitmask`` and
the ``SchedulerOutput.grammar_bitmask`` the worker applies.

Usage (repo root): PYTHONPATH=. python3 benchmarks/gpu_structured_outputs.py --out $OUT [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], bos_token_id=1, eos_token_id=2,
)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=1e4, rms_norm_eps=1e-6,
            tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], bos_token_id=1, eos_token_id=2)


def bitmask_part(device: str, vocab: int, batches: list[int]) -> list[dict]:
    from kvserve.structured_output import apply_grammar_bitmask, bitmask_width

    out = []
    rng = np.random.default_rng(0)
    for b in batches:
        bm = rng.integers(-2**31, 2**31 - 1, size=(b, bitmask_width(vocab)), dtype=np.int64).astype(np.int32)
        logits = torch.randn(b + 3, vocab, device=device, dtype=torch.float32)
        rows = list(range(3, b + 3))
        ref = logits.cpu().clone()
        apply_grammar_bitmask(ref, bm, rows)
        got = logits.clone()
        apply_grammar_bitmask(got, bm, rows)
        ok = torch.equal(got.cpu(), ref)
        times = []
        for _ in range(20):
            x = logits.clone()
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            apply_grammar_bitmask(x, bm, rows)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rec = {"part": "bitmask", "device": device, "batch": b, "vocab": vocab, "equal_to_cpu": ok,
               "median_ms": 1000 * sorted(times)[len(times) // 2]}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


class _AllowSetState:
    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def accept(self, tok: int) -> bool:
        return tok in self.allowed

    @property
    def is_terminated(self) -> bool:
        return False


class AllowSetManager:
    """Stands in for xgrammar: every constrained request may only emit ``allowed`` ids."""

    def __init__(self, vocab: int, allowed: list[int]) -> None:
        from kvserve.structured_output import bitmask_width

        self.allowed = set(allowed)
        row = np.zeros(bitmask_width(vocab), dtype=np.uint32)
        for t in allowed:
            row[t // 32] |= np.uint32(1) << np.uint32(t % 32)
        self.row = row.view(np.int32)

    def make_request_state(self, params):
        return _AllowSetState(self.allowed)

    def grammar_bitmask(self, states):
        return np.repeat(self.row[None], len(states), axis=0)


def engine_part(device: str, cfg: dict, n_req: int, n_constrained: int, prompt_len: int, out_len: int) -> list[dict]:
    import transformers

    import kvserve.engine.llm_engine as le
    from kvserve import LLM, SamplingParams

    orig_validate = le.validate_request

    def validate(ids, params, *a, **kw):  # the allow-set needs no tokenizer
        return orig_validate(ids, params.clone(structured_outputs=None) if params.structured_outputs else params,
                             *a, **kw)

    le.validate_request = validate
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "cfg")
    transformers.Qwen3Config(**cfg).save_pretrained(path)
    kw = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=prompt_len + out_len + 16,
              max_num_seqs=max(n_req, 8), disable_log_stats=True)
    if device == "cpu":
        kw.update(device="cpu", kv_cache_memory="64MiB")
    llm = LLM(path, **kw)
    core = llm.llm_engine.engine_core
    allowed = list(range(100, 164))
    mgr = AllowSetManager(cfg["vocab_size"], allowed)
    core.structured_output_manager = core.scheduler.structured_output_manager = mgr
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, min(cfg["vocab_size"], 10000), size=prompt_len).tolist() for _ in range(n_req)]
    plain = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    cons = SamplingParams(temperature=0.8, seed=0, max_tokens=out_len, ignore_eos=True,
                          structured_outputs={"regex": "allow-set"})
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    recs = []
    results = {}
    for name, params in (("plain", [plain] * n_req),
                         ("mixed", [cons] * n_constrained + [plain] * (n_req - n_constrained))):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = [o.outputs[0].token_ids for o in outs]
        results[name] = toks
        rec = {"part": "engine", "device": device, "run": name, "requests": n_req,
               "constrained": n_constrained if name == "mixed" else 0, "output_tokens": sum(map(len, toks)),
               "seconds": dt, "tok_s": sum(map(len, toks)) / dt, "async_scheduling": core.async_scheduling}
        if name == "mixed":
            rec["constrained_tokens_all_allowed"] = all(t in mgr.allowed for ts in toks[:n_constrained] for t in ts)
            same = sum(a == b for a, b in zip(results["plain"][n_constrained:], toks[n_constrained:]))
            rec["plain_outputs_equal_to_plain_run"] = f"{same}/{n_req - n_constrained}"
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    llm.shutdown() if hasattr(llm, "shutdown") else None
    le.validate_request = orig_validate
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvserve-out"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--skip-engine", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    device = "cpu" if a.cpu_smoke or not torch.cuda.is_available() else "cuda"
    recs = []
    try:
        recs += bitmask_part(device, TINY["vocab_size"] if a.cpu_smoke else 151936,
                             [4] if a.cpu_smoke else [1, 64, 256])
    except Exception as exc:  # noqa: BLE001 - keep going
        recs.append({"part": "bitmask", "error": repr(exc)})
    if not a.skip_engine:
        try:
            if a.cpu_smoke:
                recs += engine_part("cpu", TINY, 8, 2, 16, 8)
            else:
                recs += engine_part(device, QWEN3_06B, 64, 8, 512, 128)
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            recs.append({"part": "engine", "error": repr(exc)})
    with open(os.path.join(a.out, "structured_outputs.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "records": recs}, f,
                  indent=1)
    print(f"\n{'part':8} {'what':34} {'value':>14}")
    for r in recs:
        if "error" in r:
            print(f"{r['part']:8} {'ERROR':34} {r['error'][:60]}")
        elif r["part"] == "bitmask":
            print(f"{'bitmask':8} {'b=%d V=%d equal=%s' % (r['batch'], r['vocab'], r['equal_to_cpu']):34} "
                  f"{r['median_ms']:>11.3f} ms")
        else:
            ok, same = r.get("constrained_tokens_all_allowed", ""), r.get("plain_outputs_equal_to_plain_run", "")
            extra = f" ok={ok} same={same}"
            print(f"{'engine':8} {r['run'] + extra:34} {r['tok_s']:>9.1f} tok/s")


if __name__ == "__main__":
    main()
