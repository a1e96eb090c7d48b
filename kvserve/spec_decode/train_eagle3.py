"""Train an EAGLE-3 head for a Llama-family target by self-distillation, on CUDA or the CPU.

EAGLE-3 (Li et al., arXiv:2503.01840); the head and its training-time test are in
``kvserve.spec_decode.eagle3_train_head``. The steps:

1. Prompts: ``train_prompts.training_conversations`` (chat, instructions, code, math,
   summaries, multi-turn; the benchmark's held-out chat and its topics kept out, asserted).
2. Answers: the target itself, through kvserve's ``LLM`` on the same device: greedy, and a
   share (``--sample-share``) sampled at ``--temperature`` (the head sees the target's
   distribution away from its greedy path too); a multi-turn conversation gets its second
   answer after its first. Generation is batched and stops at a deadline (``--gen-seconds``).
3. Features: the target re-reads each conversation (paged prefills through the engine's own
   model runner, many sequences per forward): the three residual-stream states the head
   fuses (``eagle3_layers``), its final-normed hidden state and its argmax token, kept on the
   device (bf16 on CUDA).
4. Draft vocabulary: the ``--draft-vocab-size`` most frequent tokens of the answers (``d2t``
   / ``t2d``); ``lm_head`` starts as the target's rows of them, ``norm`` as its final norm.
5. Training: AdamW, warm-up + cosine over the step or time budget (``--train-seconds``),
   length-bucketed padded batches of ``--batch-tokens``, bf16 autocast on CUDA, TTT over
   ``--ttt-steps`` steps (loss weights ``0.8 ** j``). ``--holdout`` conversations are kept out
   and the head's per-step top-1 agreement with the target on them is logged.
6. The head is written in the published EAGLE-3 layout (``kvserve.models.llama_eagle`` loads
   it as ``{"method": "eagle3", "model": OUT}``) with a README holding the exact command.

    HF_HUB_OFFLINE=1 python -m kvserve.spec_decode.train_eagle3 --device cuda \\
        --num-prompts 4000 --gen-seconds 70 --train-seconds 120 --out /tmp/eagle3-head
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.spec_decode.eagle3_train_head import (Eagle3TrainHead, draft_vocabulary, save_eagle3_head,
                                                   ttt_loss)


@dataclass
class Sample:
    """One conversation's training data (device tensors): ``ids [T]`` int64, ``aux [T, 3H]``
    (target states), ``h [T, H]`` (final-normed hidden), ``top [T]`` int64 (target argmax),
    ``a0``: index of the first answer token."""

    ids: torch.Tensor
    aux: torch.Tensor
    h: torch.Tensor
    top: torch.Tensor
    a0: int


def make_llm(model: str | None, device: str, max_model_len: int, kv_cache_memory: str, max_num_seqs: int,
             seed: int, **kw):
    """The generating engine (prefix caching off: every sequence is re-read whole)."""
    from kvserve import LLM

    args = dict(kv_cache_memory=kv_cache_memory, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                disable_log_stats=True, enable_prefix_caching=False, seed=seed, device=device)
    if model:
        args["model"] = model
    args.update(kw)
    return LLM(**args)


def generate(llm, convs: list[list[str]], max_tokens: int, sample_share: float, temperature: float, seed: int,
             deadline: float | None = None, chunk: int = 512, log=print) -> list[tuple[list[int], int]]:
    """Answer ``convs`` with ``llm``; returns ``(token ids, answer start)`` per answered
    conversation (its last answer is the trained one). Chunks of ``chunk`` conversations until
    ``deadline`` (``time.perf_counter()`` value; None: all)."""
    from kvserve import SamplingParams

    tok = llm.get_tokenizer()
    rng = random.Random(seed)
    out: list[tuple[list[int], int]] = []

    def sp(i: int):
        if rng.random() < sample_share:
            return SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens, seed=seed * 100003 + i)
        return SamplingParams(temperature=0, max_tokens=max_tokens)

    def template(msgs):
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    for c0 in range(0, len(convs), chunk):
        if deadline is not None and time.perf_counter() > deadline:
            log(f"generation deadline: {len(out)} of {len(convs)} conversations answered")
            break
        part = convs[c0:c0 + chunk]
        msgs = [[{"role": "user", "content": c[0]}] for c in part]
        res = llm.generate([template(m) for m in msgs], [sp(c0 + i) for i in range(len(part))], use_tqdm=False)
        multi = [i for i, c in enumerate(part) if len(c) > 1]
        if multi:
            for i in multi:
                msgs[i] = msgs[i] + [{"role": "assistant", "content": res[i].outputs[0].text.strip()},
                                     {"role": "user", "content": part[i][1]}]
            res2 = llm.generate([template(msgs[i]) for i in multi], [sp(c0 + i + 7919) for i in multi],
                                use_tqdm=False)
            for i, r in zip(multi, res2):
                res[i] = r
        for r in res:
            ans = list(r.outputs[0].token_ids)
            if ans:
                out.append((list(r.prompt_token_ids) + ans, len(r.prompt_token_ids)))
    return out


@torch.inference_mode()
def extract_features(runner, seqs: list[tuple[list[int], int]], aux_layers: tuple[int, ...],
                     token_budget: int = 16384, store_dtype: torch.dtype | None = None) -> list[Sample]:
    """Target features of ``seqs`` (``(ids, answer start)``) by paged prefills through
    ``runner`` (many sequences per forward, at most ``token_budget`` tokens and the runner's KV
    blocks; run with no request in flight). ``store_dtype``: the kept states' dtype (default:
    the model's). Raises ValueError for a sequence longer than the runner's KV pool."""
    from kvserve.attention.forward_context import forward_context

    model = runner.model
    inner = model.model
    bs = runner.block_size
    nblocks = runner.kv_cache_config.groups[0].num_blocks - 1  # block 0 stays the padding block
    dev = runner.device
    out: list[Sample] = []
    inner.aux_hidden_state_layers = tuple(aux_layers)
    try:
        i = 0
        while i < len(seqs):
            batch, tokens, blocks = [], 0, 0
            while i < len(seqs):
                n, nb = len(seqs[i][0]), -(-len(seqs[i][0]) // bs)
                if nb > nblocks:
                    raise ValueError(f"a sequence of {n} tokens needs {nb} KV blocks, the runner has {nblocks}")
                if batch and (tokens + n > token_budget or blocks + nb > nblocks):
                    break
                batch.append(seqs[i])
                tokens, blocks, i = tokens + n, blocks + nb, i + 1
            lens = [len(s[0]) for s in batch]
            width = max(-(-x // bs) for x in lens)
            bt = np.zeros((len(batch), width + 1), dtype=np.int32)
            nxt = 1
            for r, x in enumerate(lens):
                k = -(-x // bs)
                bt[r, :k] = np.arange(nxt, nxt + k)
                nxt += k
            metas, pos = runner.backend.metadata_builder_cls.dummy(bt, lens, bs, dev)
            ids = torch.tensor([t for s in batch for t in s[0]], dtype=torch.long, device=dev)
            with forward_context(metas):
                h = model(ids, pos)
            aux = torch.cat([inner.aux_hidden_states[j] for j in aux_layers], dim=-1)
            top = torch.cat([model.compute_logits(h[c:c + 4096]).argmax(-1) for c in range(0, len(h), 4096)])
            dt = store_dtype or h.dtype
            o = 0
            for s, x in zip(batch, lens):
                out.append(Sample(ids[o:o + x].clone(), aux[o:o + x].to(dt).clone(), h[o:o + x].to(dt).clone(),
                                  top[o:o + x].clone(), s[1]))
                o += x
    finally:
        inner.aux_hidden_state_layers = ()
        inner.aux_hidden_states = {}
    return out


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices of ``samples`` grouped by length into batches of at most ``batch_tokens`` padded
    tokens (at least one sample each), in shuffled order."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].ids), rng.random()))
    out, cur, longest = [], [], 0
    for i in order:
        n = len(samples[i].ids)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(samples: list[Sample], idx: list[int], device, dtype: torch.dtype):
    """Padded batch: ``(aux [B, T, 3H], ids [B, T], h [B, T, H], top [B, T], mask [B, T])``;
    ``mask[b, t]``: the prediction at position ``t`` (of token ``t + 1``) is trained (answers
    only: ``t >= a0 - 1``, ``t < len``)."""
    ss = [samples[i] for i in idx]
    t = max(len(s.ids) for s in ss)
    b = len(ss)
    a = ss[0].aux
    aux = torch.zeros(b, t, a.shape[-1], dtype=dtype, device=device)
    hid = torch.zeros(b, t, ss[0].h.shape[-1], dtype=dtype, device=device)
    ids = torch.zeros(b, t, dtype=torch.long, device=device)
    top = torch.zeros(b, t, dtype=torch.long, device=device)
    mask = torch.zeros(b, t, dtype=torch.bool, device=device)
    for r, s in enumerate(ss):
        n = len(s.ids)
        aux[r, :n] = s.aux.to(device, dtype)
        hid[r, :n] = s.h.to(device, dtype)
        ids[r, :n] = s.ids.to(device)
        top[r, :n] = s.top.to(device)
        mask[r, max(s.a0 - 1, 0):n] = True
    return aux, ids, hid, top, mask


def target_weights(target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(embedding [V, H], lm_head [V, H], final norm weight [H] or None)`` of a kvserve Llama."""
    emb = target.model.embed_tokens.weight.detach()
    lm = emb if getattr(target, "lm_head", None) is None else target.lm_head.weight.detach()
    norm = getattr(target.model, "norm", None)
    return emb, lm, (norm.weight.detach() if norm is not None else None)


def token_counts(samples: list[Sample], vocab: int) -> torch.Tensor:
    """How often each token id is an answer token or the target's argmax there ``[vocab]``."""
    c = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        c += torch.bincount(s.ids[s.a0:].cpu(), minlength=vocab)[:vocab]
        c += torch.bincount(s.top[max(s.a0 - 1, 0):].cpu(), minlength=vocab)[:vocab]
    return c


@torch.no_grad()
def evaluate(head: Eagle3TrainHead, samples: list[Sample], emb_w, lm_w, steps: int, batch_tokens: int) -> dict:
    """Teacher-forced TTT agreement on ``samples``: per-step top-1 agreement with the target
    and the chain's estimated mean acceptance length ``1 + sum_j prod_{i<=j} acc_i`` per k."""
    if not samples:
        return {}
    dev = lm_w.device
    t2d = _t2d_index(head, lm_w.shape[0])
    hits = [0.0] * steps
    cnt = [0] * steps
    head.eval()
    for idx in batches(samples, batch_tokens, random.Random(0)):
        aux, ids, hid, top, mask = collate(samples, idx, dev, torch.float32 if dev.type == "cpu" else emb_w.dtype)
        with _autocast(dev):
            _, acc, n = ttt_loss(head, aux, ids, hid, top, mask, emb_w, lm_w[head.draft_ids], t2d, steps)
        for j in range(steps):
            hits[j] += acc[j] * n[j]
            cnt[j] += n[j]
    head.train()
    acc = [h / c if c else 0.0 for h, c in zip(hits, cnt)]
    est, prod = {}, 1.0
    tot = 1.0
    for j, a in enumerate(acc):
        prod *= a
        tot += prod
        est[j + 1] = round(tot, 3)
    return {"step_agreement": [round(a, 4) for a in acc], "est_mean_acceptance_length": est}


def _t2d_index(head: Eagle3TrainHead, vocab: int) -> torch.Tensor:
    t2d = torch.full((vocab,), -1, dtype=torch.long, device=head.draft_ids.device)
    t2d[head.draft_ids] = torch.arange(len(head.draft_ids), device=t2d.device)
    return t2d


def _autocast(dev: torch.device):
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(samples: list[Sample], cfg, emb_w: torch.Tensor, lm_w: torch.Tensor, norm_w: torch.Tensor | None,
          draft_vocab_size: int, *, steps: int = 6, lr: float = 1e-3, seed: int = 0, max_steps: int | None = None,
          seconds: float | None = None, batch_tokens: int = 8192, warmup: int = 20, log=print,
          eval_samples: list[Sample] | None = None) -> tuple[Eagle3TrainHead, dict]:
    """Train an EAGLE-3 head on ``samples`` until ``max_steps`` optimizer steps or ``seconds``
    (whichever comes first; at least one of them). Returns ``(head, info)``; info holds the
    steps, epochs, last losses and the held-out evaluation. Raises ValueError without a budget."""
    if max_steps is None and seconds is None:
        raise ValueError("train: give max_steps or seconds")
    dev = lm_w.device
    torch.manual_seed(seed)
    counts = token_counts(samples, lm_w.shape[0])
    draft_ids = draft_vocabulary(counts, draft_vocab_size)
    head = Eagle3TrainHead(cfg, draft_ids)
    head.init_from_target(lm_w.float().cpu(), None if norm_w is None else norm_w.float().cpu(), seed)
    head.to(dev)
    head.rotary.build_cache()
    emb_w, lm_w = emb_w.detach(), lm_w.detach()
    lm_draft = lm_w[draft_ids.to(dev)]
    t2d = _t2d_index(head, lm_w.shape[0])
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    step = epoch = 0
    losses: list[float] = []
    accs: list[list[float]] = []
    store = torch.float32 if dev.type == "cpu" else torch.bfloat16
    done = False
    while not done:
        epoch += 1
        for idx in batches(samples, batch_tokens, rng):
            frac = step / max_steps if max_steps else 0.0
            if seconds:
                frac = max(frac, (time.perf_counter() - t0) / seconds)
            if frac >= 1.0:
                done = True
                break
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * frac))
            aux, ids, hid, top, mask = collate(samples, idx, dev, store)
            with _autocast(dev):
                loss, acc, _ = ttt_loss(head, aux, ids, hid, top, mask, emb_w, lm_draft, t2d, steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            losses.append(loss.item())
            accs.append(acc)
            if step % 50 == 0 or step == 1:
                log(f"step {step} epoch {epoch}: loss {loss.item():.4f} agreement "
                    f"{' '.join(f'{a:.3f}' for a in acc)} ({time.perf_counter() - t0:.0f} s)")
    info = dict(steps=step, epochs=epoch, seconds=round(time.perf_counter() - t0, 1),
                first_loss=round(losses[0], 4) if losses else None,
                last_loss=round(float(np.mean(losses[-10:])), 4) if losses else None,
                train_step_agreement=[round(float(np.mean([a[j] for a in accs[-10:]])), 4) for j in range(steps)]
                if accs else [], draft_vocab_size=draft_vocab_size,
                draft_vocab_coverage=round(float(counts[draft_ids].sum() / max(int(counts.sum()), 1)), 4))
    if eval_samples:
        info["held_out"] = evaluate(head, eval_samples, emb_w, lm_w, steps, batch_tokens)
        log(f"held-out: {info['held_out']}")
    return head, info


README = """# EAGLE-3 head for {model}

One decoder layer + `fc` fusing target layers {layers} (EAGLE-3, arXiv:2503.01840), draft
vocabulary of {dv} tokens (`d2t` / `t2d`), bf16, {mb:.1f} MB. Trained by self-distillation with
training-time test ({ttt} steps) on {n} conversations ({tok} answer tokens) answered by the
target itself (`kvserve.spec_decode.train_eagle3`), {steps} optimizer steps in {secs:.0f} s on {device}:

    {command}

Use: `--speculative-config '{{"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": 4}}'`.
Held-out teacher-forced agreement per TTT step: {agree}.
"""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the default model's GGUF)")
    ap.add_argument("--out", required=True, help="head directory to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=4000)
    ap.add_argument("--holdout", type=int, default=64, help="conversations kept out of training (evaluated)")
    ap.add_argument("--max-tokens", type=int, default=256, help="answer length")
    ap.add_argument("--sample-share", type=float, default=0.25, help="share of answers sampled, not greedy")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--gen-seconds", type=float, default=None, help="generation deadline")
    ap.add_argument("--train-seconds", type=float, default=None, help="training budget (time)")
    ap.add_argument("--max-steps", type=int, default=None, help="training budget (optimizer steps)")
    ap.add_argument("--ttt-steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per batch (default: 32768 "
                                                                   "on CUDA, 2048 on the CPU)")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="generating batch (default 256 CUDA / 16 CPU)")
    ap.add_argument("--kv-cache-memory", default=None, help="generating engine's KV (default 8GiB CUDA / 256MiB CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if ns.max_steps is None and ns.train_seconds is None:
        ap.error("give --train-seconds or --max-steps")
    from kvserve.spec_decode.eagle import eagle3_layers
    from kvserve.spec_decode.train_prompts import training_conversations

    cuda = ns.device.startswith("cuda")
    t0 = time.perf_counter()
    convs = training_conversations(ns.num_prompts + ns.holdout, ns.seed)
    held_convs, convs = convs[:ns.holdout], convs[ns.holdout:]
    llm = make_llm(ns.model, ns.device, 2048, ns.kv_cache_memory or ("8GiB" if cuda else "256MiB"),
                   ns.max_num_seqs or (256 if cuda else 16), ns.seed)
    gen_deadline = t0 + ns.gen_seconds if ns.gen_seconds else None
    held = generate(llm, held_convs, ns.max_tokens, 0.0, ns.temperature, ns.seed + 1)
    seqs = generate(llm, convs, ns.max_tokens, ns.sample_share, ns.temperature, ns.seed, gen_deadline,
                    chunk=512 if cuda else 64)
    runner = llm.llm_engine.engine_core.model_runner
    target = runner.model
    cfg = target.config if hasattr(target, "config") else llm.llm_engine.config.model_config.hf_config
    aux_layers = eagle3_layers(cfg.num_hidden_layers)
    n_ans = sum(len(s[0]) - s[1] for s in seqs)
    print(f"data: {len(seqs)} conversations, {n_ans} answer tokens (+{len(held)} held out), "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    samples = extract_features(runner, seqs, aux_layers, 32768 if cuda else 4096)
    held_s = extract_features(runner, held, aux_layers, 32768 if cuda else 4096)
    # copies: the engine (and its weights) goes away before training; float32 on the CPU
    emb_w, lm_w, norm_w = (None if x is None else (x if cuda else x.float()).clone() for x in target_weights(target))
    llm.shutdown()
    del llm, runner, target
    if cuda:
        torch.cuda.empty_cache()
    t1 = time.perf_counter()
    print(f"features: {time.perf_counter() - t0:.0f} s", flush=True)
    head, info = train(samples, cfg, emb_w, lm_w, norm_w, ns.draft_vocab_size, steps=ns.ttt_steps, lr=ns.lr,
                       seed=ns.seed, max_steps=ns.max_steps, seconds=ns.train_seconds,
                       batch_tokens=ns.batch_tokens or (32768 if cuda else 2048),
                       log=lambda m: print(m, flush=True), eval_samples=held_s)
    args = list(argv if argv is not None else sys.argv[1:])
    for flag in ("--model", "--out"):  # no machine path in the shipped command: the file's name
        if flag in args[:-1]:
            i = args.index(flag)
            args[i + 1] = os.path.basename(args[i + 1].rstrip("/"))
    if "--model" in args[:-1] and args[args.index("--model") + 1] == "SmolLM2-135M-Instruct.Q4_1.gguf":
        i = args.index("--model")
        del args[i:i + 2]  # the default model: the trainer's default
    cmd = "HF_HUB_OFFLINE=1 python -m kvserve.spec_decode.train_eagle3 " + " ".join(shlex.quote(a) for a in args)
    readme = README.format(model=os.path.basename(ns.model or "SmolLM2-135M-Instruct"), layers=list(aux_layers),
                           dv=ns.draft_vocab_size, mb=0.0, ttt=ns.ttt_steps, n=len(samples), tok=n_ans,
                           steps=info["steps"], secs=info["seconds"], command=cmd,
                           device=torch.cuda.get_device_name() if cuda else "the CPU",
                           agree=info.get("held_out", {}).get("step_agreement"))
    size = save_eagle3_head(head, ns.out, readme, aux_layers)
    readme = readme.replace(" 0.0 MB", f" {size / 1e6:.1f} MB")
    with open(os.path.join(ns.out, "README.md"), "w") as f:
        f.write(readme)
    info.update(conversations=len(samples), answer_tokens=n_ans, held_out_conversations=len(held_s),
                data_seconds=round(t1 - t0, 1), head_bytes=size, aux_layers=list(aux_layers), command=cmd)
    print(f"wrote {ns.out} ({size / 1e6:.1f} MB), total {time.perf_counter() - t0:.0f} s", flush=True)
    return info


if __name__ == "__main__":
    main()
