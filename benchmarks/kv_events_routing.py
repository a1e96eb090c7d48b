"""KV-event routing vs the approximate tree: ``kvserve launch --replicas 2`` behind each policy,
the same multi-turn chat workload, the workers' prefix-cache hit rate.

For each policy (``kv_events``, ``cache_aware``) a fresh ``kvserve launch --prefill 0 --decode 0
--replicas 2 --policy P`` serves ``--conversations`` chats of ``--turns`` turns, sent one at a
time and interleaved (turn t of every chat, then turn t + 1), through ``/v1/chat/completions``
with text messages (so the kv_events router takes token ids from a worker's ``/tokenize``). A
returning turn is the history + the reply + a short user message: the approximate tree only
ever saw the user text, so when the replies outweigh it the match falls under
``--cache-threshold`` and the least-loaded worker (not the one holding the chat) wins; the
exact policy sees the workers' blocks, replies included.

Reported per policy: prefix-cache hits / queries summed over the workers (tokens), the router's
decisions by reason, wall time. ``--model tiny`` (default) builds a tiny random Llama with a
word-level tokenizer and a chat template (dummy weights, CPU, no download); any other value is
passed to the workers as MODEL (e.g. the default model: ``--model default``).

    HF_HUB_OFFLINE=1 python benchmarks/kv_events_routing.py            # writes benchmarks/results/kv_events/
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

WORDS = 997  # vocabulary: <unk> <s> </s> + w3..w999


def tiny_model(d: str) -> list[str]:
    """A tiny Llama config + a word-level tokenizer with a chat template in ``d``; the workers' flags."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2).save_pretrained(d)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = ("{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} {{ m['content'] }} "
                "{% endfor %}{% if add_generation_prompt %}w4 {% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template=template).save_pretrained(d)
    return [d, "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "32MiB"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str, labels: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line)


def check_reset(workers: list[str]) -> list[dict]:
    """``POST /reset_prefix_cache`` on each worker: one more event published (AllBlocksCleared)."""
    out = []
    for w in workers:
        name = "kvserve:kv_events_published_total"
        before = metric(httpx.get(w + "/metrics", timeout=10).text, name)
        r = httpx.post(w + "/reset_prefix_cache", timeout=10)
        end, after = time.monotonic() + 10, before
        while after == before and time.monotonic() < end:
            time.sleep(0.2)
            after = metric(httpx.get(w + "/metrics", timeout=10).text, name)
        out.append({"worker": w, "status": r.status_code, "events_published_before": before,
                    "events_published_after": after})
    return out


def run_policy(policy: str, worker_args: list[str], ns, log_dir: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "launch", "--prefill", "0", "--decode", "0",
           "--replicas", "2", "--policy", policy, "--port", str(port), "--log-dir", os.path.join(log_dir, policy),
           *worker_args]
    log = open(os.path.join(log_dir, f"launch_{policy}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + ns.startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launch exited ({proc.returncode}); see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise RuntimeError("launch did not become healthy")
            time.sleep(1)
        workers = [w["url"] for w in httpx.get(url + "/workers", timeout=5).json()["workers"]]

        def hits() -> tuple[float, float]:
            texts = [httpx.get(w + "/metrics", timeout=10).text for w in workers]
            return (sum(metric(t, "kvserve:prefix_cache_hits_total") for t in texts),
                    sum(metric(t, "kvserve:prefix_cache_queries_total") for t in texts))

        rng = random.Random(ns.seed)
        words = lambda n: " ".join(f"w{rng.randrange(5, 1000)}" for _ in range(n))  # noqa: E731
        chats = [[{"role": "user", "content": words(ns.user_words)}] for _ in range(ns.conversations)]
        h0, q0 = hits()
        t0 = time.perf_counter()
        for _ in range(ns.turns):
            for msgs in chats:
                body = {"messages": msgs, "max_tokens": ns.reply_tokens, "temperature": 0,
                        "ignore_eos": True}
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
                r.raise_for_status()
                msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": words(ns.user_words)}]
        wall = time.perf_counter() - t0
        h1, q1 = hits()
        rtext = httpx.get(url + "/metrics", timeout=10).text
        reasons = {}
        for line in rtext.splitlines():
            if line.startswith("kvserve_router:routing_decisions_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                reasons[reason] = reasons.get(reason, 0) + float(line.rsplit(" ", 1)[1])
        out = {"policy": policy, "hit_tokens": h1 - h0, "query_tokens": q1 - q0,
               "hit_rate": (h1 - h0) / max(q1 - q0, 1), "decisions": reasons, "wall_s": round(wall, 2)}
        if policy == "kv_events":
            out["reset"] = check_reset(workers)
        return out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (built here) | default | a model path")
    ap.add_argument("--conversations", type=int, default=5, help="odd: least-loaded alternation cannot line up")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-words", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="benchmarks/results/kv_events/kv_events_routing.json")
    ns = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = tempfile.mkdtemp(prefix="kv_events_routing_")
    if ns.model == "tiny":
        worker_args = tiny_model(os.path.join(tmp, "tiny"))
    else:
        worker_args = [] if ns.model == "default" else [ns.model]
        worker_args += ["--max-model-len", "2048", "--kv-cache-memory", "256MiB"]
    results = [run_policy(p, worker_args, ns, tmp) for p in ("kv_events", "cache_aware")]
    print(f"{'policy':<12} {'hit rate':>9} {'hit/query tokens':>18} {'wall s':>7}  decisions")
    for r in results:
        print(f"{r['policy']:<12} {r['hit_rate']:>9.3f} {int(r['hit_tokens']):>8}/{int(r['query_tokens']):<9} "
              f"{r['wall_s']:>7.1f}  {r['decisions']}")
    out = {"model": ns.model, "conversations": ns.conversations, "turns": ns.turns, "user_words": ns.user_words,
           "reply_tokens": ns.reply_tokens, "results": results}
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {ns.out}; logs in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
