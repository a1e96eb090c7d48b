"""Train an EAGLE-1/2 head for the default model by self-distillation, on the CPU.

1. Chat prompts: ``--prompts chat`` (everyday open requests assembled from templates and word
   lists, ``kvserve.spec_decode.chat_topics``; the benchmark's chat questions are kept out),
   ``corpus`` (real text shipped in the repo: HumanEval functions and KJV passages of
   ``kvserve/bench/data/accuracy_corpus.jsonl.gz``, "explain this code", "summarize this
   passage", ...) or a file of prompts (one JSON string or plain line each); chat-templated and
   answered by the engine itself (greedy, batched).
2. The target re-reads each prompt + answer once (one paged prefill through the engine's own
   model runner) and its final-normed hidden states are kept; the target's next-token
   distributions come from those states through its lm_head while training.
3. The head (fc + one decoder layer, randomly initialized) learns the
   EAGLE recipe (Li et al., arXiv:2401.15077): smooth-L1 regression of the next feature plus
   ``0.1 x`` cross-entropy against the target's distribution, on answer tokens, with uniform
   input noise, AdamW, a fixed seed, one thread. The cross-entropy is over the draft
   vocabulary (``--draft-vocab-size``: the head only ever drafts there; ~6x cheaper than the
   whole vocabulary). ``--holdout N`` keeps the last N prompts out of training and reports the
   head's top-1 agreement with the target on their answers after every epoch.
4. It is saved in the published layout (``config.json`` + bf16 ``model.safetensors`` with
   ``fc.*``, ``layers.0.*``) that ``kvserve.models.llama_eagle`` loads.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python -m kvserve.spec_decode.train_eagle \\
        --prompts chat --out kvserve/spec_decode/data/eagle-smollm2-135m
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from kvserve.layers.rotary import RotaryEmbedding, get_rope_params

CORPUS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "data", "accuracy_corpus.jsonl.gz")
_CODE_ASKS = ["Explain what this Python function does:", "Write a docstring-free version of this function and "
              "explain how it works:", "What is the time complexity of this function? Explain briefly.",
              "Give an example of calling this function and what it returns:"]
_PROSE_ASKS = ["Summarize this passage in a few sentences:", "Who are the people in this passage and what do "
               "they do?", "Explain the meaning of this passage in simple words:",
               "Write a short story inspired by this passage:"]


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` chat requests over the shipped corpus (code and prose halves), shuffled by ``seed``."""
    code, prose = [], []
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["kind"] == "code":
                code += [c.strip() for c in re.split(r"\n(?=def )", d["text"]) if c.strip().startswith("def ")]
            else:
                paras = [p.strip() for p in re.split(r"\n\s*\n|(?<=[.;:])\s+(?=\d+ )", d["text"]) if len(p) > 80]
                prose += [" ".join(paras[i:i + 3])[:700] for i in range(0, len(paras), 3)]
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    out = []
    for i in range(n):  # alternate code / prose; texts recur with another ask when a pool runs out
        j = i // 2
        if i % 2 == 0:
            out.append(f"{_CODE_ASKS[(j + j // len(code)) % len(_CODE_ASKS)]}\n\n```python\n"
                       f"{code[j % len(code)][:900]}\n```")
        else:
            out.append(f"{_PROSE_ASKS[(j + j // len(prose)) % len(_PROSE_ASKS)]}\n\n{prose[j % len(prose)]}")
    return out


class _Layer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_key_value_heads
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, kv, hd
        self.self_attn = nn.ModuleDict(dict(q_proj=nn.Linear(h, self.nh * hd, bias=False),
                                            k_proj=nn.Linear(h, kv * hd, bias=False),
                                            v_proj=nn.Linear(h, kv * hd, bias=False),
                                            o_proj=nn.Linear(self.nh * hd, h, bias=False)))
        i = cfg.intermediate_size
        self.mlp = nn.ModuleDict(dict(gate_proj=nn.Linear(h, i, bias=False), up_proj=nn.Linear(h, i, bias=False),
                                      down_proj=nn.Linear(i, h, bias=False)))
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)


class TrainHead(nn.Module):
    """Plain-torch EAGLE-1/2 head with the published parameter names (training only)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([_Layer(cfg)])
        self.rotary = RotaryEmbedding(h // cfg.num_attention_heads,
                                      getattr(cfg, "max_position_embeddings", 2048), get_rope_params(cfg))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb, hidden ``[T, H]`` (one sequence) -> next features ``[T, H]`` (causal)."""
        layer = self.layers[0]
        a = layer.self_attn
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        t = x.shape[0]
        q, k = self.rotary(torch.arange(t), a["q_proj"](x), a["k_proj"](x))
        v = a["v_proj"](x)
        q = q.view(t, layer.nh, layer.hd).transpose(0, 1)
        k = k.view(t, layer.nkv, layer.hd).transpose(0, 1).repeat_interleave(layer.nh // layer.nkv, 0)
        v = v.view(t, layer.nkv, layer.hd).transpose(0, 1).repeat_interleave(layer.nh // layer.nkv, 0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, -1)
        x = a["o_proj"](o) + x
        m, y = layer.mlp, layer.post_attention_layernorm(x)
        return m["down_proj"](F.silu(m["gate_proj"](y)) * m["up_proj"](y)) + x

    def published(self) -> dict[str, torch.Tensor]:
        """The state dict under published names (``fc.*``, ``layers.0.*``)."""
        return {n: t for n, t in self.state_dict().items() if "rotary" not in n and not n.endswith("_cache")}


def init_from_target(head: TrainHead, target, seed: int) -> None:
    """The decoder layer from the target's last layer; ``fc`` passes the feature through."""
    last = target.model.layers[-1]
    h = head.fc.out_features
    lay = head.layers[0]
    q, k, v = last.self_attn.qkv_proj.weight.float().split([lay.nh * lay.hd, lay.nkv * lay.hd, lay.nkv * lay.hd])
    g, u = last.mlp.gate_up_proj.weight.float().chunk(2, dim=0)
    a, m = head.layers[0].self_attn, head.layers[0].mlp
    with torch.no_grad():
        for dst, src in ((a["q_proj"], q), (a["k_proj"], k), (a["v_proj"], v),
                         (a["o_proj"], last.self_attn.o_proj.weight.float()), (m["gate_proj"], g), (m["up_proj"], u),
                         (m["down_proj"], last.mlp.down_proj.weight.float())):
            dst.weight.copy_(src)
        head.layers[0].post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        gen = torch.Generator().manual_seed(seed)
        head.fc.weight.copy_(torch.randn(h, 2 * h, generator=gen) * 0.01)
        head.fc.weight[:, h:] += torch.eye(h)
        head.fc.bias.zero_()


@torch.inference_mode()
def target_hidden(runner, token_ids: list[int]) -> torch.Tensor:
    """The target's final-normed hidden states ``[T, H]`` float32 for one sequence (one paged
    prefill over the runner's KV blocks ``1..``; run with no request in flight)."""
    from kvserve.attention.forward_context import forward_context

    bs = runner.block_size
    n = -(-len(token_ids) // bs)
    bt = np.zeros((1, n + 1), dtype=np.int32)
    bt[0, :n] = np.arange(1, n + 1)
    metas, pos = runner.backend.metadata_builder_cls.dummy(bt, [len(token_ids)], runner.block_size, runner.device)
    with forward_context(metas):
        h = runner.model(torch.tensor(token_ids, dtype=torch.long, device=runner.device), pos)
    return h.float().cpu()


def load_prompts(source: str, n: int, seed: int = 0) -> list[str]:
    """``n`` training prompts from ``source``: "chat" (``chat_topics.synthetic_chat_prompts``),
    "corpus" (``chat_prompts``) or a file path (one prompt a line: a JSON string, or plain text;
    the first ``n``). Raises ValueError for an unknown source or a file with fewer prompts."""
    if source == "chat":
        from kvserve.spec_decode.chat_topics import synthetic_chat_prompts

        return synthetic_chat_prompts(n, seed)
    if source == "corpus":
        return chat_prompts(n, seed)
    if not os.path.isfile(source):
        raise ValueError(f"--prompts must be chat, corpus or a file, got {source!r}")
    with open(source, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    out = [json.loads(ln) if ln.startswith('"') else ln for ln in lines][:n]
    if len(out) < n:
        raise ValueError(f"{source} holds {len(out)} prompts, asked for {n}")
    return out


def generate_data(prompts: list[str] | int, max_tokens: int, seed: int, kv_cache_memory: str = "256MiB",
                  max_num_seqs: int = 32):
    """Self-distillation data: ``(samples, runner, hf_config)``; each sample is
    ``(token ids [T], answer start, hidden [T, H] float32)``. ``prompts``: the user messages
    (an int ``n``: the first ``n`` corpus prompts, ``chat_prompts(n, seed)``), answered greedily
    in batches of up to ``max_num_seqs``."""
    from kvserve import LLM, SamplingParams

    if isinstance(prompts, int):
        prompts = chat_prompts(prompts, seed)
    llm = LLM(kv_cache_memory=kv_cache_memory, max_model_len=1536, max_num_seqs=max_num_seqs,
              disable_log_stats=True, enable_prefix_caching=False, seed=seed)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    runner = llm.llm_engine.engine_core.model_runner
    samples = []
    for o in outs:
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        samples.append((ids, len(o.prompt_token_ids), target_hidden(runner, ids)))
    return samples, runner, runner.model.config


def _head_step(head: TrainHead, sample, emb_w: torch.Tensor, lm_w: torch.Tensor, noise: float,
               loss_on_prompt: bool):
    """One sequence: (loss, top-1 agreement with the target, positions) over the loss mask."""
    ids, a0, hid = sample
    ids_t = torch.tensor(ids)
    # pair p = (h_p, t_{p+1}) predicts h_{p+1}; answer positions only (loss mask).
    h_in = hid[:-1] + (torch.rand_like(hid[:-1]) - 0.5) * noise if noise else hid[:-1]
    feats = head(F.embedding(ids_t[1:], emb_w), h_in)
    mask = torch.zeros(len(ids) - 1, dtype=torch.bool)
    mask[0 if loss_on_prompt else max(a0 - 1, 0):] = True
    f, tgt_h = feats[mask], hid[1:][mask]
    with torch.no_grad():
        tp = F.softmax(tgt_h @ lm_w.T, dim=-1)
    logp = F.log_softmax(f @ lm_w.T, dim=-1)
    ce = -(tp * logp).sum(-1).mean()
    loss = F.smooth_l1_loss(f, tgt_h) + 0.1 * ce
    agree = (logp.argmax(-1) == tp.argmax(-1)).float()
    return loss, agree.mean().item(), len(agree)


@torch.no_grad()
def evaluate(head: TrainHead, samples, target, vocab: int | None = None) -> float:
    """Top-1 agreement of the head's next-token choice with the target's on the answer
    positions of ``samples`` (teacher-forced target features, no noise), among token ids
    ``< vocab`` (None: all), token-weighted; in [0, 1] (0.0 for no samples)."""
    emb_w, lm_w = _weights(target, vocab)
    hits = n = 0
    for smp in samples:
        _, acc, k = _head_step(head, smp, emb_w, lm_w, 0.0, False)
        hits, n = hits + acc * k, n + k
    return hits / n if n else 0.0


def _weights(target, vocab: int | None):
    emb_w = target.model.embed_tokens.weight.detach().float()
    lm_w = emb_w if target.lm_head is None else target.lm_head.weight.detach().float()
    return emb_w, lm_w[:vocab] if vocab else lm_w


def train(samples, target, cfg, epochs: int, lr: float, seed: int, noise: float = 0.2,
          init: str = "random", loss_on_prompt: bool = False, log=print, vocab: int | None = None,
          eval_samples=None) -> TrainHead:
    """Train a head on ``samples`` (``generate_data``); returns it (float32). ``init``:
    "random" (default: measured better), "target" (the target's last layer; on the
    default model its outputs on final-normed inputs start far off and train slowly) or a
    head directory (``save_head`` layout) to continue training; ValueError if it does not fit.
    ``vocab``: the cross-entropy (and the logged agreement) over token ids ``< vocab`` only
    (None: the whole vocabulary). ``eval_samples``: held-out samples whose top-1 agreement
    (``evaluate``) is logged after every epoch."""
    torch.manual_seed(seed)
    head = TrainHead(cfg)
    if init == "target":
        init_from_target(head, target, seed)
    elif init != "random":  # a head directory: continue training it
        from safetensors.torch import load_file

        sd = {k.removeprefix("model."): v.float() for k, v in load_file(os.path.join(init, "model.safetensors")).items()}
        try:
            missing, unexpected = head.load_state_dict(sd, strict=False)
        except RuntimeError as exc:  # a tensor of another shape
            raise ValueError(f"{init}: not an EAGLE-1 head of this shape: {exc}") from None
        if unexpected or [m for m in missing if "rotary" not in m and not m.endswith("_cache")]:
            raise ValueError(f"{init}: not an EAGLE-1 head of this shape ({missing}, {unexpected})")
    emb_w, lm_w = _weights(target, vocab)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps = epochs * len(samples)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rng = random.Random(seed)
    order = list(range(len(samples)))
    for ep in range(epochs):
        rng.shuffle(order)
        tot = {"loss": 0.0, "acc": 0.0, "n": 0}
        for i in order:
            loss, acc, _ = _head_step(head, samples[i], emb_w, lm_w, noise, loss_on_prompt)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            tot["loss"] += loss.item()
            tot["acc"] += acc
            tot["n"] += 1
        held = f", held-out {evaluate(head, eval_samples, target, vocab):.3f}" if eval_samples else ""
        log(f"epoch {ep + 1}/{epochs}: loss {tot['loss'] / tot['n']:.4f} "
            f"top-1 agreement {tot['acc'] / tot['n']:.3f}{held}")
    return head


def save_head(head: TrainHead, cfg, out: str, draft_vocab_size: int | None = None) -> None:
    """Write ``out/config.json`` (the target's Llama config, one layer; ``draft_vocab_size``:
    draft among the first N token ids, see ``EagleHead.limit_draft_vocab``) and bf16
    ``model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    d = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, list, dict, type(None)))}
    d.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16")
    d.pop("_name_or_path", None)  # the target's local path: no machine path in a shipped head
    if draft_vocab_size:
        d["draft_vocab_size"] = draft_vocab_size
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in head.published().items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt", "layout": "eagle"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="kvserve/spec_decode/data/eagle-smollm2-135m")
    ap.add_argument("--prompts", default="corpus", help="chat (synthetic everyday requests), corpus (code and "
                                                         "prose of the shipped corpus) or a file (one a line)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--extra-corpus", type=int, default=0, help="also this many corpus prompts (with --prompts chat)")
    ap.add_argument("--holdout", type=int, default=0, help="keep the last N prompts out of training; log the "
                                                           "head's top-1 agreement on their answers every epoch")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--init", default="random", help="random, target (its last layer) or a head directory "
                                                      "to continue training")
    ap.add_argument("--loss-on-prompt", action="store_true", help="train on prompt positions too (more text)")
    ap.add_argument("--kv-cache-memory", default="256MiB", help="the generating engine's KV cache (more: larger "
                                                                  "batches, faster; outputs may differ slightly)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="the generating engine's batch")
    ap.add_argument("--draft-vocab-size", type=int, default=8192,
                    help="written to config.json: draft among the first N token ids (0: the whole vocabulary); "
                         "the cross-entropy is over the same ids")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.perf_counter()
    prompts = load_prompts(ns.prompts, ns.num_prompts, ns.seed)
    if ns.extra_corpus:
        prompts = chat_prompts(ns.extra_corpus, ns.seed) + prompts  # the held-out tail stays of --prompts
    samples, runner, cfg = generate_data(prompts, ns.max_tokens, ns.seed, ns.kv_cache_memory, ns.max_num_seqs)
    held = samples[len(samples) - ns.holdout:] if ns.holdout else []
    samples = samples[:len(samples) - len(held)]
    n_tok = sum(len(s[0]) - s[1] for s in samples)
    print(f"data: {len(samples)} conversations, {n_tok} answer tokens (+{len(held)} held out), "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    t1 = time.perf_counter()
    head = train(samples, runner.model, cfg, ns.epochs, ns.lr, ns.seed, init=ns.init,
                 loss_on_prompt=ns.loss_on_prompt, log=lambda m: print(m, flush=True),
                 vocab=ns.draft_vocab_size or None, eval_samples=held)
    print(f"training: {time.perf_counter() - t1:.0f} s", flush=True)
    save_head(head, cfg, ns.out, ns.draft_vocab_size or None)
    print(f"wrote {ns.out} ({os.path.getsize(os.path.join(ns.out, 'model.safetensors')) / 1e6:.1f} MB), "
          f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
