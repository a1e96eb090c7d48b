"""Hybrid KV cache manager: capacity, long-prompt throughput and decode step time, hybrid
(sliding-window groups free blocks outside the window) vs ``--disable-hybrid-kv-cache-manager``
on the same KV byte budget, dummy weights at real shapes.

Models (HF configs written here):
  * ``gemma3-270m``: Gemma 3 270M (18 layers, every 6th global, window 512, 1 KV head x 256)
    when ``Gemma3ForCausalLM`` is registered; otherwise the same attention/KV shape as a Qwen2
    config with ``layer_types`` (5 sliding : 1 full), named ``gemma3-270m-kvshape``.
  * ``mistral-style``: the same dims with every layer windowed (window 512).

Parts (``--parts``):
  * ``capacity``: the start-up plan (max concurrency at ``--max-model-len``) and a measured
    run of ``--num-requests`` long prompts: peak running requests, preemptions, tok/s.
  * ``prefix``: multi-turn chat prefix-cache hit rate, hybrid vs full-attention cache.
  * ``decode``: median engine decode step (batch ``--decode-batch``) at 2K and 32K context.
  * ``kernel``: Triton decode kernel time of a window layer vs a full layer at 2K and 32K.

Usage (repo root):
  GPU: PYTHONPATH=. python3 benchmarks/hybrid_kv.py --out $OUT
  CPU: PYTHONPATH=. python3 benchmarks/hybrid_kv.py --cpu-smoke --out /tmp/h
Writes ``hybrid_kv.json`` (one record per figure) under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GEMMA3_270M = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
    rope_local_base_freq=10000.0, sliding_window=512, query_pre_attn_scalar=256, sliding_window_pattern=6,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, architectures=["Gemma3ForCausalLM"],
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
)


def _shape(smoke: bool) -> dict:
    """The common dims (tiny for the CPU smoke run)."""
    if smoke:
        return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, sliding_window=16)
    return dict(vocab_size=32000, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512)


def model_dirs(tmp: str, smoke: bool) -> dict[str, str]:
    """Write the HF config directories; returns name -> path."""
    import transformers

    from kvserve.models.registry import supported_architectures

    base = _shape(smoke)
    n = base["num_hidden_layers"]
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    out = {}
    cfg = None
    if not smoke and "Gemma3ForCausalLM" in supported_architectures() and hasattr(transformers, "Gemma3TextConfig"):
        try:
            name, cfg = "gemma3-270m", transformers.Gemma3TextConfig(**GEMMA3_270M)
        except Exception as e:  # config fields differ across transformers versions
            print(f"Gemma3TextConfig failed ({e!r}); using the KV-shape stand-in", flush=True)
    if cfg is None:
        name = "gemma3-270m-kvshape"
        cfg = transformers.Qwen2Config(**base, use_sliding_window=True, max_window_layers=0, layer_types=types,
                                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                                       architectures=["Qwen2ForCausalLM"], bos_token_id=1, eos_token_id=2)
    out[name] = os.path.join(tmp, name)
    cfg.save_pretrained(out[name])
    out["mistral-style"] = os.path.join(tmp, "mistral-style")
    transformers.MistralConfig(**base, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                               architectures=["MistralForCausalLM"], bos_token_id=1,
                               eos_token_id=2).save_pretrained(out["mistral-style"])
    return out


def _llm(path: str, hybrid: bool, args, max_model_len: int, eager: bool = False):
    from kvserve import LLM

    # Prefill-bound parts run eagerly: no start-up graph capture per engine.
    return LLM(model=path, load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
               kv_cache_memory=args.kv_cache_memory, max_model_len=max_model_len, disable_log_stats=True,
               enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid,
               max_num_seqs=args.max_num_seqs, enforce_eager=eager)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def capacity(name: str, path: str, hybrid: bool, args) -> dict:
    """Planned max concurrency, then ``num_requests`` prompts of ``prompt_len`` tokens: peak
    running requests, preemptions and throughput."""
    from kvserve import SamplingParams
    from kvserve.core.kv_cache_spec import bytes_per_request, max_concurrency

    llm = _llm(path, hybrid, args, args.max_model_len, eager=True)
    eng = llm.llm_engine
    core = eng.engine_core
    cfg = core.kv_cache_config
    sc = eng.config.scheduler_config
    planned = max_concurrency(cfg, args.max_model_len, min(sc.max_num_batched_tokens, sc.max_model_len))
    flat = cfg.total_bytes / bytes_per_request(cfg, args.max_model_len, hybrid=False)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=args.gen_len, ignore_eos=True)
    for _ in range(args.num_requests):
        eng.add_request(None, torch.randint(3, 500, (args.prompt_len,), generator=g).tolist(), sp)
    peak = 0
    _sync()
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, len(core.scheduler.running))
    _sync()
    dt = time.perf_counter() - t0
    tokens = args.num_requests * (args.prompt_len + args.gen_len)
    rec = dict(part="capacity", model=name, hybrid=hybrid, max_model_len=args.max_model_len,
               kv_bytes=cfg.total_bytes, groups=cfg.describe(), planned_max_concurrency=round(planned, 2),
               flat_max_concurrency=round(flat, 2), num_requests=args.num_requests, prompt_len=args.prompt_len,
               gen_len=args.gen_len, peak_running=peak, preemptions=core.scheduler.num_preemptions,
               seconds=round(dt, 3), tok_per_s=round(tokens / dt, 1))
    llm.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def prefix_hit_rate(name: str, path: str, hybrid: bool, args) -> dict:
    """Multi-turn chat: ``chat_convs`` conversations x ``chat_turns`` turns, each turn's prompt
    the conversation so far plus a new ``chat_msg``-token message, ``chat_gen`` tokens out; all
    conversations' turn t run together. Prefix-cache hit rate (tokens) and tok/s."""
    from kvserve import SamplingParams

    from kvserve import LLM

    llm = LLM(model=path, load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
              kv_cache_memory=args.chat_kv_memory, max_model_len=args.max_model_len, disable_log_stats=True,
              disable_hybrid_kv_cache_manager=not hybrid, max_num_seqs=args.max_num_seqs, enforce_eager=True)
    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    g = torch.Generator().manual_seed(1)
    hist = [torch.randint(3, 500, (args.chat_first,), generator=g).tolist() for _ in range(args.chat_convs)]
    sp = SamplingParams(temperature=0, max_tokens=args.chat_gen, ignore_eos=True)
    tokens = 0
    _sync()
    t0 = time.perf_counter()
    for turn in range(args.chat_turns):
        if turn:
            hist = [h + torch.randint(3, 500, (args.chat_msg,), generator=g).tolist() for h in hist]
        outs = llm.generate(hist, sp, use_tqdm=False)
        tokens += sum(len(h) for h in hist) + args.chat_gen * len(hist)
        hist = [h + o.outputs[0].token_ids for h, o in zip(hist, outs)]
    _sync()
    dt = time.perf_counter() - t0
    rec = dict(part="prefix", model=name, hybrid=hybrid, convs=args.chat_convs, turns=args.chat_turns,
               final_len=len(hist[0]), kv_memory=args.chat_kv_memory, queries=sched.prefix_cache_queries,
               hits=sched.prefix_cache_hits, hit_rate=round(sched.prefix_cache_hits / sched.prefix_cache_queries, 4),
               preemptions=sched.num_preemptions, tok_per_s=round(tokens / dt, 1))
    llm.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def decode_steps(name: str, path: str, ctx: int, args) -> dict:
    """Median wall time of engine steps while ``decode_batch`` requests of ``ctx`` prompt
    tokens all decode (after their prefill)."""
    from kvserve import SamplingParams

    llm = _llm(path, True, args, args.decode_max_len)
    eng = llm.llm_engine
    sched = eng.engine_core.scheduler
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    g = torch.Generator().manual_seed(ctx)
    ids = [eng.add_request(None, torch.randint(3, 500, (ctx,), generator=g).tolist(), sp)
           for _ in range(args.decode_batch)]
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        eng.step()
    running = len(sched.running)
    _sync()
    stamps = [time.perf_counter()]
    for _ in range(args.decode_steps):
        eng.step()
        stamps.append(time.perf_counter())
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    ms = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    llm.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(part="decode", model=name, context=ctx, batch=args.decode_batch, running=running,
                step_ms_median=round(statistics.median(ms[3:] or ms), 3))


def kernel(ctx: int, window: int | None, args) -> dict:
    """Triton decode kernel (one layer, batch ``decode_batch``, Gemma 3 270M heads) at ``ctx``."""
    from kvserve.attention.triton import decode_attention

    smoke = args.cpu_smoke
    h, hkv, d, bs = (4, 1, 16, 16) if smoke else (4, 1, 256, 16)
    b = args.decode_batch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if smoke else torch.bfloat16
    nb = -(-ctx // bs)
    cache = torch.randn(2, b * nb + 1, bs, hkv, d, device=dev, dtype=dtype)
    bt = (torch.arange(b * nb, device=dev, dtype=torch.int32) + 1).view(b, nb)
    q = torch.randn(b, h, d, device=dev, dtype=dtype)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    def call():
        decode_attention(q, cache, bt, seq, qsl, b, ctx, d ** -0.5, window, out=out)

    for _ in range(2):
        call()
    _sync()
    reps = 3 if smoke else 50
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    _sync()
    us = (time.perf_counter() - t0) / reps * 1e6
    return dict(part="kernel", context=ctx, window=window, batch=b, us=round(us, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/kvserve-hybrid")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ap.add_argument("--parts", default="capacity,prefix,decode,kernel")
    ap.add_argument("--models", default="", help="comma-separated subset of the model names")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (hybrid_kv<_tag>.json)")
    ns = ap.parse_args()
    smoke = ns.cpu_smoke
    args = argparse.Namespace(
        cpu_smoke=smoke, dtype="float32" if smoke else "bfloat16",
        kv_cache_memory="2MiB" if smoke else "4GiB", max_model_len=512 if smoke else 32768,
        prompt_len=480 if smoke else 32000, gen_len=8 if smoke else 32, num_requests=12 if smoke else 40,
        max_num_seqs=64, decode_batch=4 if smoke else 16, decode_steps=8 if smoke else 40,
        decode_max_len=1024 + 64 if smoke else 32768,  # the model's own context: 32000 + the steps fit
        chat_convs=4 if smoke else 32, chat_turns=5 if smoke else 6, chat_first=40 if smoke else 1000,
        chat_msg=20 if smoke else 200, chat_gen=16 if smoke else 128, chat_kv_memory="512KiB" if smoke else "1GiB",
    )
    contexts = [256, 1000] if smoke else [2048, 32000]
    os.makedirs(ns.out, exist_ok=True)
    parts = set(ns.parts.split(","))
    records = []
    path_json = os.path.join(ns.out, f"hybrid_kv{'_' + ns.tag if ns.tag else ''}.json")

    def add(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)
        with open(path_json, "w") as f:
            json.dump(records, f, indent=1)

    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs(tmp, smoke)
        if ns.models:
            dirs = {k: v for k, v in dirs.items() if k in ns.models.split(",")}
        for name, path in dirs.items():
            if "capacity" in parts:
                for hybrid in (True, False):
                    try:
                        add(capacity(name, path, hybrid, args))
                    except Exception as e:  # one failure must not stop the others
                        add(dict(part="capacity", model=name, hybrid=hybrid, error=repr(e)[:300]))
            if "prefix" in parts:
                for hybrid in (True, False):
                    try:
                        add(prefix_hit_rate(name, path, hybrid, args))
                    except Exception as e:
                        add(dict(part="prefix", model=name, hybrid=hybrid, error=repr(e)[:300]))
            if "decode" in parts:
                for ctx in contexts:
                    try:
                        add(decode_steps(name, path, ctx, args))
                    except Exception as e:
                        add(dict(part="decode", model=name, context=ctx, error=repr(e)[:300]))
    if "kernel" in parts and (torch.cuda.is_available() or smoke):
        w = 16 if smoke else 512
        for ctx in contexts:
            for window in (w, None):
                try:
                    add(kernel(ctx, window, args))
                except Exception as e:
                    add(dict(part="kernel", context=ctx, window=window, error=repr(e)[:300]))

    print("\n| part | model | setting | figure |\n|---|---|---|---|")
    for r in records:
        if "error" in r:
            setting = r.get("hybrid", r.get("context", ""))
            print(f"| {r['part']} | {r.get('model', '')} | {setting} | ERROR {r['error'][:80]} |")
        elif r["part"] == "capacity":
            print(f"| capacity | {r['model']} | hybrid={r['hybrid']} | planned {r['planned_max_concurrency']}x "
                  f"(flat {r['flat_max_concurrency']}x), peak running {r['peak_running']}, "
                  f"{r['preemptions']} preemptions, {r['tok_per_s']} tok/s |")
        elif r["part"] == "prefix":
            print(f"| prefix | {r['model']} | hybrid={r['hybrid']} | hit rate {r['hit_rate']} over {r['convs']} "
                  f"chats x {r['turns']} turns (to {r['final_len']} tokens), {r['preemptions']} preemptions, "
                  f"{r['tok_per_s']} tok/s |")
        elif r["part"] == "decode":
            print(f"| decode | {r['model']} | ctx {r['context']} x {r['batch']} | {r['step_ms_median']} ms/step |")
        else:
            print(f"| kernel | - | ctx {r['context']} window {r['window']} x {r['batch']} | {r['us']} us |")


if __name__ == "__main__":
    sys.exit(main())
