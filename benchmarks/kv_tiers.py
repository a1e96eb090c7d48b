"""Tiered KV cache benchmarks: CPU tier, swap preemption, disk persistence, transfers.

Parts (``--parts``, comma-separated):

- ``multiturn``: ``--convs`` conversations x ``--turns`` turns; each turn's prompt is the
  conversation so far (previous prompt + answer + ``--turn-tokens`` new tokens), all of a
  turn submitted at once. The device pool is sized so the working set is ~10x it. Tier off
  vs ``--kv-offloading-size``: p50 TTFT of returning turns (turn >= 2), throughput
  (prompt + output tokens / s), cached tokens.
- ``zero``: random prompts (no reuse), tier on vs off: throughput; and a decode-heavy run
  (output tok/s, i.e. decode step time).
- ``swap``: memory pressure (long outputs, small pool): recompute vs swap: throughput,
  preemptions, recomputed tokens.
- ``persist``: a ``--persist-len``-token prompt on an engine with a fresh disk tier (cold),
  then on a new engine over the same directory (restart): cached tokens, TTFT.
- ``bandwidth``: the worker's block saves (device -> host) and loads (host -> device), GB/s.

Usage:
    CPU (default model, float32):  HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/kv_tiers.py --out r.json
    GPU (Llama-3.1-8B shape, dummy bf16): PYTHONPATH=. python3 benchmarks/kv_tiers.py --gpu8b --out $OUT/tiers.json
    CPU smoke of the GPU path's code (tiny random model): python benchmarks/kv_tiers.py --tiny
Prints a table last and writes every figure to --out (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvserve import LLM, SamplingParams  # noqa: E402

LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def _config_dir(tmp: str, cfg: dict) -> str:
    from transformers import LlamaConfig

    path = os.path.join(tmp, "model")
    LlamaConfig(**cfg).save_pretrained(path)
    return path


class Bench:
    def __init__(self, ns) -> None:
        self.ns = ns
        self.tmp = tempfile.mkdtemp(prefix="kv_tiers_")
        if ns.gpu8b or ns.tiny:
            self.base = dict(model=_config_dir(self.tmp, LLAMA31_8B if ns.gpu8b else TINY), load_format="dummy",
                             skip_tokenizer_init=True)
            self.vocab = (LLAMA31_8B if ns.gpu8b else TINY)["vocab_size"]
        else:
            self.base = dict(model=ns.model, skip_tokenizer_init=True)
            self.vocab = 49152
        if ns.gpu8b:
            self.base["dtype"] = "bfloat16"
        self.base.update(disable_log_stats=True, block_size=16)
        self.rng = random.Random(0)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1000 if self.vocab > 2000 else 3, self.vocab) for _ in range(n)]

    def llm(self, **kw) -> LLM:
        args = dict(self.base)
        args.update(kw)
        return LLM(**args)

    @staticmethod
    def close(llm: LLM) -> None:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- parts --------------------------------------------------------------------------
    def multiturn(self) -> list[dict]:
        ns = self.ns
        final = ns.first_tokens + (ns.turns - 1) * (ns.turn_tokens + ns.output_len) + ns.output_len
        working_set = ns.convs * final
        blocks = max(working_set // 10 // 16 + 1, final // 16 + 2)
        rng = random.Random(1)
        base_convs = [[rng.randrange(1000 if self.vocab > 2000 else 3, self.vocab) for _ in range(ns.first_tokens)]
                      for _ in range(ns.convs)]
        news = [[[rng.randrange(1000 if self.vocab > 2000 else 3, self.vocab) for _ in range(ns.turn_tokens)]
                 for _ in range(ns.convs)] for _ in range(ns.turns)]
        out = []
        ref_tokens = None
        for name, kw in (("off", {}), ("cpu_tier", dict(kv_offloading_size=ns.tier_gib))):
            llm = self.llm(num_gpu_blocks_override=blocks, max_model_len=(blocks - 1) * 16, **kw)
            convs = [list(c) for c in base_convs]
            sp = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
            ttft_ret, toks, n_prompt, n_cached, n_out = [], [], 0, 0, 0
            t0 = time.perf_counter()
            for t in range(ns.turns):
                res = llm.generate(convs, sp, use_tqdm=False)
                for c, r, new in zip(convs, res, news[t]):
                    o = list(r.outputs[0].token_ids)
                    toks.append(o)
                    n_prompt += len(c)
                    n_out += len(o)
                    if t >= 1:
                        ttft_ret.append(r.metrics.ttft)
                        n_cached += r.num_cached_tokens
                    c.extend(o)
                    c.extend(new)
            dt = time.perf_counter() - t0
            st = llm.llm_engine.engine_core.scheduler.get_stats()
            rec = dict(part="multiturn", config=name, convs=ns.convs, turns=ns.turns, device_blocks=blocks - 1,
                       working_set_tokens=working_set, seconds=dt, tok_per_s=(n_prompt + n_out) / dt,
                       p50_ttft_returning_s=statistics.median(ttft_ret), returning_cached_tokens=n_cached,
                       prompt_tokens=n_prompt, output_tokens=n_out, tier=st.kv_connector_stats)
            if ref_tokens is None:
                ref_tokens = toks
            rec["same_tokens_as_off"] = toks == ref_tokens
            out.append(rec)
            self.close(llm)
        out[1]["ttft_ratio"] = out[1]["p50_ttft_returning_s"] / out[0]["p50_ttft_returning_s"]
        out[1]["throughput_ratio"] = out[1]["tok_per_s"] / out[0]["tok_per_s"]
        return out

    def zero(self) -> list[dict]:
        ns = self.ns
        prompts = [self.tokens(ns.zero_len) for _ in range(ns.zero_n)]
        dec_prompts = [self.tokens(32) for _ in range(ns.zero_n)]
        out = []
        for name, kw in (("off", {}), ("cpu_tier", dict(kv_offloading_size=ns.tier_gib))):
            llm = self.llm(kv_cache_memory=ns.kv_cache_memory, max_model_len=2048, **kw)
            llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            sp = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            spd = SamplingParams(temperature=0, max_tokens=ns.decode_len, ignore_eos=True)
            t1 = time.perf_counter()
            llm.generate(dec_prompts, spd, use_tqdm=False)
            dt2 = time.perf_counter() - t1
            out.append(dict(part="zero_reuse", config=name, requests=ns.zero_n, prompt_len=ns.zero_len,
                            tok_per_s=ns.zero_n * (ns.zero_len + ns.output_len) / dt,
                            decode_out_tok_per_s=ns.zero_n * ns.decode_len / dt2, seconds=dt))
            self.close(llm)
        out[1]["throughput_ratio"] = out[1]["tok_per_s"] / out[0]["tok_per_s"]
        out[1]["decode_ratio"] = out[1]["decode_out_tok_per_s"] / out[0]["decode_out_tok_per_s"]
        return out

    def swap(self) -> list[dict]:
        ns = self.ns
        prompts = [self.tokens(ns.swap_prompt) for _ in range(ns.swap_n)]
        need = ns.swap_n * (ns.swap_prompt + ns.swap_out) // 16
        blocks = max(need // 3, (ns.swap_prompt + ns.swap_out) // 16 + 2)
        out, ref = [], None
        for mode in ("recompute", "swap"):
            kw = dict(preemption_mode="swap", kv_offloading_size=ns.tier_gib) if mode == "swap" else {}
            llm = self.llm(num_gpu_blocks_override=blocks, max_model_len=(blocks - 1) * 16, **kw)
            sp = SamplingParams(temperature=0, max_tokens=ns.swap_out, ignore_eos=True)
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            toks = [list(r.outputs[0].token_ids) for r in res]
            ref = ref or toks
            st = llm.llm_engine.engine_core.scheduler.get_stats()
            out.append(dict(part="swap", config=mode, requests=ns.swap_n, device_blocks=blocks - 1, seconds=dt,
                            tok_per_s=ns.swap_n * (ns.swap_prompt + ns.swap_out) / dt,
                            preemptions=st.num_preemptions, recomputed_tokens=st.num_recomputed_tokens,
                            same_tokens=toks == ref))
            self.close(llm)
        return out

    def persist(self) -> list[dict]:
        ns = self.ns
        d = os.path.join(self.tmp, "disk")
        os.makedirs(d, exist_ok=True)
        prompt = self.tokens(ns.persist_len)
        out = []
        for run in ("cold", "restart"):
            llm = self.llm(kv_cache_memory=ns.kv_cache_memory, max_model_len=ns.persist_len + 64,
                           kv_offloading_size=ns.tier_gib, kv_disk_path=d)
            llm.generate([self.tokens(16)], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            r = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            out.append(dict(part="persist", config=run, prompt_len=ns.persist_len, ttft_s=r.metrics.ttft,
                            cached_tokens=r.num_cached_tokens, cached_frac=r.num_cached_tokens / ns.persist_len))
            self.close(llm)
        out[1]["ttft_ratio"] = out[1]["ttft_s"] / out[0]["ttft_s"]
        return out

    def bandwidth(self) -> list[dict]:
        ns = self.ns
        llm = self.llm(kv_cache_memory=ns.kv_cache_memory, max_model_len=2048, kv_offloading_size=ns.tier_gib)
        w = llm.llm_engine.engine_core.model_runner.kv_connector.worker
        nblk = min(ns.bw_blocks, w.num_host_blocks, w.caches[0].shape[1] - 1)
        bpb = llm.llm_engine.engine_core.kv_cache_config.bytes_per_block
        out = []
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        for _ in range(2):
            pairs = [(1 + i, i) for i in range(nblk)]
            sync()
            t0 = time.perf_counter()
            w.save(pairs)
            w.wait_for_save()
            sync()
            ts = time.perf_counter() - t0
            t0 = time.perf_counter()
            w.swap_out_and_load([], [(i, 1 + i) for i in range(nblk)])
            sync()
            tl = time.perf_counter() - t0
        out.append(dict(part="bandwidth", blocks=nblk, bytes=nblk * bpb, save_GBps=nblk * bpb / ts / 1e9,
                        load_GBps=nblk * bpb / tl / 1e9, save_s=ts, load_s=tl))
        self.close(llm)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="multiturn,zero,swap,persist,bandwidth")
    ap.add_argument("--model", default=None)
    ap.add_argument("--gpu8b", action="store_true", help="Llama-3.1-8B shape, dummy bf16 weights (GPU)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke run)")
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=256)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--tier-gib", type=float, default=2.0)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--zero-n", type=int, default=16)
    ap.add_argument("--zero-len", type=int, default=256)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--swap-n", type=int, default=8)
    ap.add_argument("--swap-prompt", type=int, default=128)
    ap.add_argument("--swap-out", type=int, default=128)
    ap.add_argument("--persist-len", type=int, default=2048)
    ap.add_argument("--bw-blocks", type=int, default=512)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    b = Bench(ns)
    records = []
    try:
        for part in ns.parts.split(","):
            t0 = time.perf_counter()
            try:
                recs = getattr(b, part)()
            except Exception as exc:  # one part failing must not lose the others
                recs = [dict(part=part, error=f"{type(exc).__name__}: {exc}")]
            for r in recs:
                r["part_seconds"] = time.perf_counter() - t0
                print(json.dumps(r, default=str), flush=True)
            records.extend(recs)
            if ns.out:
                with open(ns.out, "w") as f:
                    json.dump(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                   threads=torch.get_num_threads(), args=vars(ns), records=records), f, indent=1,
                              default=str)
    finally:
        shutil.rmtree(b.tmp, ignore_errors=True)
    print("\npart        config      tok/s      ratio   p50 TTFT / TTFT   cached   extra")
    for r in records:
        if "error" in r:
            print(f"{r['part']:<11} ERROR {r['error']}")
            continue
        ttft = r.get("p50_ttft_returning_s", r.get("ttft_s"))
        cached = r.get("returning_cached_tokens", r.get("cached_tokens", ""))
        keys = ("ttft_ratio", "decode_ratio", "recomputed_tokens", "preemptions", "save_GBps", "load_GBps",
                "same_tokens_as_off", "same_tokens")
        extra = {k: round(r[k], 3) if isinstance(r[k], float) else r[k] for k in keys if k in r}
        tps = r.get("tok_per_s")
        print(f"{r['part']:<11} {r.get('config', ''):<10} {tps if tps is None else round(tps, 1)!s:>9} "
              f"{round(r.get('throughput_ratio', 0), 3) or '':>8} {ttft if ttft is None else round(ttft, 4)!s:>12}"
              f"   {cached!s:>7}   {json.dumps(extra)}")


if __name__ == "__main__":
    main()
