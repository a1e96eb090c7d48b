"""The EAGLE-3 head in plain torch for training: training-time test, loss, draft vocabulary.

EAGLE-3 (Li et al., arXiv:2503.01840): ``fc`` fuses three of the target's residual-stream
states (low / mid / high layers, ``kvserve.spec_decode.eagle.eagle3_layers``) into one feature;
one decoder layer reads ``concat(input_layernorm(embed(token)), hidden_norm(feature))`` and
returns the next feature; ``norm`` + ``lm_head`` score a reduced draft vocabulary whose index
``i`` is the target token ``i + d2t[i]``. Later draft steps feed the layer's own output back.
The math is the one of ``kvserve.models.llama_eagle.EagleHead`` (inference), parameter names
are the published ones (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).

**Training-time test** (TTT, the paper's section 3.2): the head is unrolled for ``steps``
steps on its own outputs, as it runs when drafting. Chain ``p`` starts at pair ``p`` (target
states of position ``p``, token ``p + 1``); its step ``j`` sits at position ``p + j``, reads
the true token ``p + 1 + j`` and the head's step ``j - 1`` output, and attends to the step-0
keys of positions ``<= p`` (the context the head caches from real target states) and to its
own steps ``1..j`` (the draft steps' keys): a causal block plus diagonal blocks, one
``scaled_dot_product_attention`` with a boolean mask. Step ``j`` learns the target's
distribution of token ``p + 2 + j`` (from the target's final hidden state at ``p + 1 + j``),
cross-entropy over the draft vocabulary, weighted ``decay ** j``; positions whose target
argmax lies outside the draft vocabulary are masked (as in the paper's code).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.layers.rotary import RotaryEmbedding, get_rope_params


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class _MidLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, _head_dim(cfg)
        self.nh = cfg.num_attention_heads
        self.nkv = getattr(cfg, "num_key_value_heads", None) or self.nh
        self.hd = hd
        self.self_attn = nn.ModuleDict(dict(q_proj=nn.Linear(2 * h, self.nh * hd, bias=False),
                                            k_proj=nn.Linear(2 * h, self.nkv * hd, bias=False),
                                            v_proj=nn.Linear(2 * h, self.nkv * hd, bias=False),
                                            o_proj=nn.Linear(self.nh * hd, h, bias=False)))
        i = cfg.intermediate_size
        self.mlp = nn.ModuleDict(dict(gate_proj=nn.Linear(h, i, bias=False), up_proj=nn.Linear(h, i, bias=False),
                                      down_proj=nn.Linear(i, h, bias=False)))
        eps = cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def ttt_mask(n: int, steps: int, device=None) -> torch.Tensor:
    """The boolean attention mask ``[n, (steps) * n]`` of TTT step ``steps - 1`` over ``n``
    chains: True = attend. Key block 0 (step-0 keys) is causal; key block ``i >= 1`` (step
    ``i``'s keys) is the diagonal (a chain sees only its own draft steps)."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (steps - 1), dim=1)


class Eagle3TrainHead(nn.Module):
    """Trainable EAGLE-3 head (float32 parameters; run under autocast on CUDA).

    Args:
        cfg: the target's HF config (hidden size, heads, rope, eps, intermediate size).
        draft_ids: the draft vocabulary, target token ids ``[dv]`` int64, ascending.
    """

    def __init__(self, cfg: Any, draft_ids: torch.Tensor) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        dv = int(draft_ids.numel())
        self.lm_head = nn.Linear(h, dv, bias=False)
        self.register_buffer("draft_ids", draft_ids.long().clone())
        self.rotary = RotaryEmbedding(_head_dim(cfg), getattr(cfg, "max_position_embeddings", None) or 2048,
                                      get_rope_params(cfg))

    # ---- the head's math (EagleHead's, batched [B, T, .]) ---------------------------------
    def qkv(self, x: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor):
        """x, emb ``[B, N, H]``, pos ``[N]`` -> rotated q ``[B, nh, N, hd]``, k / v ``[B, nkv, N, hd]``."""
        lay, a = self.midlayer, self.midlayer.self_attn
        z = torch.cat([lay.input_layernorm(emb), lay.hidden_norm(x)], dim=-1)
        b, n, _ = z.shape
        q, k, v = a["q_proj"](z), a["k_proj"](z), a["v_proj"](z)
        # the rotary caches of kvserve's RotaryEmbedding, applied out of place (its CUDA path
        # rotates in place, which autograd cannot follow); neox layout, as the inference head
        cos = self.rotary.cos_cache[pos].view(1, n, 1, lay.hd)
        sin = self.rotary.sin_cache[pos].view(1, n, 1, lay.hd)
        dt = q.dtype
        q = _rope(q.view(b, n, lay.nh, lay.hd).float(), cos, sin).to(dt).transpose(1, 2)
        k = _rope(k.view(b, n, lay.nkv, lay.hd).float(), cos, sin).to(dt).transpose(1, 2)
        v = v.view(b, n, lay.nkv, lay.hd).transpose(1, 2)
        return q, k, v

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual ``x`` ``[B, N, H]`` + attention output ``o`` ``[B, nh, N, hd]`` -> next feature."""
        lay = self.midlayer
        b, _, n, _ = o.shape
        r = lay.self_attn["o_proj"](o.transpose(1, 2).reshape(b, n, -1)) + x
        y = lay.post_attention_layernorm(r)
        m = lay.mlp
        return m["down_proj"](F.silu(m["gate_proj"](y)) * m["up_proj"](y)) + r

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """features ``[..., H]`` -> float32 draft-vocabulary logits ``[..., dv]``."""
        return self.lm_head(self.norm(feats)).float()

    def unroll(self, aux: torch.Tensor, emb: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test. aux ``[B, P, 3H]`` (target states of positions ``0..P-1``), emb
        ``[B, P + steps - 1, H]`` (embeddings of tokens ``1..P+steps-1``; pad past the end) ->
        ``steps`` feature tensors ``[B, P, H]`` (step ``j``, chain ``p``: the head's output at
        position ``p + j``). Raises ValueError for ``steps < 1`` or a short ``emb``."""
        b, n, _ = aux.shape
        if steps < 1 or emb.shape[1] < n + steps - 1:
            raise ValueError(f"unroll: steps {steps} >= 1 and emb [B, >= {n + steps - 1}, H] needed, "
                             f"got emb {tuple(emb.shape)}")
        lay = self.midlayer
        rep = lay.nh // lay.nkv
        x = self.fc(aux)
        ar = torch.arange(n, device=aux.device)
        ks, vs, outs = [], [], []
        for j in range(steps):
            q, k, v = self.qkv(x, emb[:, j:j + n], ar + j)
            ks.append(k.repeat_interleave(rep, 1))
            vs.append(v.repeat_interleave(rep, 1))
            mask = ttt_mask(n, j + 1, aux.device)
            o = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask)
            x = self.finish(x, o)
            outs.append(x)
        return outs

    # ---- init / export ----------------------------------------------------------------------
    @torch.no_grad()
    def init_from_target(self, lm_w: torch.Tensor, final_norm_w: torch.Tensor | None, seed: int) -> None:
        """``lm_head`` from the target's rows of the draft vocabulary and ``norm`` from its
        final norm (the head's features then start in the target's output space); the rest
        random (std 0.02, ``fc`` scaled for its three inputs) with ``seed``."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith("lm_head"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        self.lm_head.weight.copy_(lm_w[self.draft_ids.cpu()].float())
        if final_norm_w is not None:
            self.norm.weight.copy_(final_norm_w.float())

    def published(self) -> dict[str, torch.Tensor]:
        """The published EAGLE-3 tensors (``fc.weight``, ``midlayer.*``, ``norm.weight``,
        ``lm_head.weight``, ``d2t`` int64 ``[dv]``, ``t2d`` bool ``[vocab]``), on the CPU."""
        out = {n: t.detach().float().cpu() for n, t in self.state_dict().items()
               if not n.startswith("rotary") and n != "draft_ids"}
        ids = self.draft_ids.cpu()
        out["d2t"] = ids - torch.arange(len(ids))
        out["t2d"] = torch.zeros(self.cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        return out


def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``counts`` ``[vocab]`` (ties and unseen tokens:
    lower ids first, BPE's merge order), ascending ``[size]`` int64. Raises ValueError for a
    size outside ``1..vocab``."""
    v = counts.numel()
    if not 1 <= size <= v:
        raise ValueError(f"draft_vocab_size must be in [1, {v}], got {size}")
    key = counts.double() * v - torch.arange(v, dtype=torch.float64) / v  # count first, then lower id
    return torch.topk(key, size).indices.sort().values


def ttt_loss(head: Eagle3TrainHead, aux: torch.Tensor, ids: torch.Tensor, tgt_h: torch.Tensor,
             tgt_top: torch.Tensor, mask: torch.Tensor, emb_w: torch.Tensor, lm_w_draft: torch.Tensor,
             t2d_index: torch.Tensor, steps: int, decay: float = 0.8):
    """The TTT loss of one padded batch.

    Args:
        aux: ``[B, T, 3H]`` target states; ids ``[B, T]`` int64 tokens; tgt_h ``[B, T, H]`` the
            target's final-normed hidden states; tgt_top ``[B, T]`` int64 the target's argmax
            (whole vocabulary) at each position; mask ``[B, T]`` bool: the prediction made at
            position ``t`` (of token ``t + 1``) is trained.
        emb_w: the target's embedding ``[V, H]``; lm_w_draft: its lm_head rows of the draft
            vocabulary ``[dv, H]``; t2d_index: ``[V]`` int64, a target token's draft index or -1.
        steps: TTT unroll depth; decay: step ``j``'s weight ``decay ** j``.

    Returns ``(loss, [top-1 agreement of step j], [positions of step j])``.
    """
    b, t, _ = aux.shape
    n = t - 1  # chains p = 0..T-2
    if n < 1:
        raise ValueError(f"ttt_loss needs sequences of >= 2 tokens, got T={t}")
    pad = steps - 1
    ids_p = F.pad(ids, (0, pad))
    emb = F.embedding(ids_p[:, 1:], emb_w)  # tokens 1 .. T-1+pad
    feats = head.unroll(aux[:, :n], emb, steps)
    total = aux.new_zeros((), dtype=torch.float32)
    accs, counts = [], []
    for j, f in enumerate(feats):
        # chain p, step j predicts token p + 2 + j from the target's state at p + 1 + j
        idx = torch.arange(n, device=aux.device) + 1 + j
        ok = idx < t
        idx = idx.clamp(max=t - 1)
        m = mask[:, idx] & ok
        top = tgt_top[:, idx]
        didx = t2d_index[top]
        m = m & (didx >= 0)
        if not bool(m.any()):
            accs.append(0.0)
            counts.append(0)
            continue
        with torch.no_grad():
            tp = F.softmax((tgt_h[:, idx][m].float() @ lm_w_draft.float().T), dim=-1)
        logp = F.log_softmax(head.logits(f[m]), dim=-1)
        ce = -(tp * logp).sum(-1).mean()
        total = total + (decay ** j) * ce
        accs.append((logp.argmax(-1) == didx[m]).float().mean().item())
        counts.append(int(m.sum()))
    return total, accs, counts


def save_eagle3_head(head: Eagle3TrainHead, out: str, readme: str | None = None,
                     aux_layers: tuple[int, ...] | None = None) -> int:
    """Write ``out/config.json`` (the target's Llama config, one layer, ``draft_vocab_size``,
    ``eagle_aux_hidden_state_layer_ids``, ``architectures: LlamaForCausalLMEagle3``), the bf16
    tensors (int64 ``d2t``, bool ``t2d``) in two safetensors files (``fc`` + ``midlayer``;
    ``norm``, ``lm_head``, ``d2t``, ``t2d``: each stays under 16 MiB for the default model, the
    largest file the GPU machine hands back) and ``README.md`` when given; returns the total
    safetensors size in bytes."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    cfg = head.cfg
    d = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, list, dict, type(None)))}
    d.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
             torch_dtype="bfloat16", draft_vocab_size=int(head.draft_ids.numel()))
    if aux_layers is not None:
        d["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    d.pop("_name_or_path", None)  # no machine path in a shipped head
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
    t = {n: (x if x.dtype in (torch.int64, torch.bool) else x.to(torch.bfloat16)).contiguous()
         for n, x in head.published().items()}
    shards = [{n: x for n, x in t.items() if n.startswith(("fc.", "midlayer."))},
              {n: x for n, x in t.items() if not n.startswith(("fc.", "midlayer."))}]
    size = 0
    for i, shard in enumerate(shards):
        path = os.path.join(out, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        save_file(shard, path, metadata={"format": "pt", "layout": "eagle3"})
        size += os.path.getsize(path)
    if readme is not None:
        with open(os.path.join(out, "README.md"), "w") as f:
            f.write(readme)
    return size
