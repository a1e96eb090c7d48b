"""CPU: what a KV quantization scheme would cost in perplexity, simulated before it is built.

Runs ``kvserve bench accuracy`` (the real default model, the shipped corpus) with
``Attention.forward`` wrapped: for a step that prefills one whole document (so run with
``--max-num-seqs 1`` and documents that fit one step), each layer's output is replaced by
float32 attention over fake-quantized K/V (quantize, then dequantize) under the scheme given
here, while the engine's own cache is left as configured (``--kv-cache-dtypes auto`` is the
fastest: the engine's output is discarded anyway). Every query sees, per key position j:

- the exact K/V when ``j`` is in the query's own block of ``--exact-recent`` tokens (the
  block still filling at decode time, kept in the compute dtype: KIVI's residual,
  Liu et al., arXiv:2402.02750), or among the first ``--exact-sink`` tokens (attention sinks,
  Xiao et al., arXiv:2309.17453);
- otherwise the fake-quantized K/V: ``token`` = per-token min-max over the head dim (the
  shipped int4/int2 scheme, ``kvserve/attention/kv_quant.py``), ``channel`` = per-channel
  min-max over aligned groups of ``--channel-group`` tokens (KIVI's keys); ``-rot`` first
  rotates the head dim by the Hadamard ``R`` (``kv_rotation.py``); ``exact`` = unquantized.

The engine's own int4/int2 path is ``--keys token-rot --values token-rot`` with nothing exact
(it matches the engine's layer outputs to ~1e-5; perplexity on a few documents still moves by
about +-1% with any such change, so compare schemes over thousands of tokens).

Usage (repo root):
    python3 benchmarks/kv_scheme_sim.py --bits 4 --exact-recent 16 -- --max-docs 12 \\
        --max-doc-tokens 1024 --max-model-len 2048 --kv-cache-memory 256MiB --max-num-seqs 1 \\
        --kv-cache-dtypes auto --no-hf --num-chat-prompts 1 --chat-max-tokens 1
Prints the accuracy table (the ``auto`` row is the simulated scheme) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SCHEMES = ("token", "token-rot", "channel", "channel-rot", "exact")


def fake_quant(x: torch.Tensor, scheme: str, bits: int, group: int) -> torch.Tensor:
    """``x [n, hkv, d]`` (float32) quantized and dequantized under ``scheme``; float32 out."""
    from kvserve.attention.kv_quant import dequantize, quantize
    from kvserve.attention.kv_rotation import rotation_matrix
    from kvserve.core.kv_cache_spec import KV_FORMATS

    if scheme == "exact":
        return x
    r = rotation_matrix(x.shape[-1]) if scheme.endswith("-rot") else None
    y = x @ r if r is not None else x
    if scheme.startswith("token"):
        fmt = KV_FORMATS[{8: "int8", 4: "int4", 2: "int2"}[bits]]
        y = dequantize(quantize(y, fmt), y.shape[-1], torch.float32, fmt)
    else:  # per channel over aligned groups of `group` tokens (the last group padded by repetition)
        n, levels = y.shape[0], (1 << bits) - 1
        pad = (-n) % group
        yp = torch.cat([y, y[-1:].expand(pad, *y.shape[1:])]) if pad else y
        g = yp.view(-1, group, *y.shape[1:])
        mn, mx = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        s = ((mx - mn) / levels).clamp_min(2.0 ** -14).half().float()
        z = mn.half().float()
        y = ((torch.floor((g - z) / s + 0.5).clamp(0, levels)) * s + z).view(-1, *y.shape[1:])[:n]
    return y @ r.T if r is not None else y


def install(ns: argparse.Namespace) -> None:
    """Wrap ``Attention.forward`` with the simulated scheme."""
    from kvserve.attention.forward_context import get_forward_context
    from kvserve.layers import attention as layer_mod

    orig = layer_mod.Attention.forward

    def forward(self, q, k, v):
        out = orig(self, q, k, v)
        meta = get_forward_context().attn_metadata[self.kv_cache_group_id]
        n = q.shape[0]
        if meta.num_reqs != 1 or meta.num_decodes or meta.seq_lens_cpu[0] != n:
            return out  # only whole-document prefills are simulated
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        k, v = k.view(n, hkv, d).float(), v.view(n, hkv, d).float()
        if self.values_rotated:  # the weights already give v R: simulate in the model's basis
            v = v @ self.values_rotated_by.T.to(v.device)
        kq, vq = fake_quant(k, ns.keys, ns.bits, ns.channel_group), fake_quant(v, ns.values, ns.bits,
                                                                                ns.channel_group)
        rep = h // hkv
        ke, ve, kq, vq = (x.transpose(0, 1).repeat_interleave(rep, 0) for x in (k, v, kq, vq))
        qq = q.view(n, h, d).float().transpose(0, 1)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        exact = torch.zeros(n, n, dtype=torch.bool)
        if ns.exact_recent:
            exact |= j >= (i // ns.exact_recent) * ns.exact_recent
        if ns.exact_sink:
            exact |= j < ns.exact_sink
        s = torch.where(exact, qq @ ke.transpose(1, 2), qq @ kq.transpose(1, 2)) * self.scale
        p = torch.softmax(s.masked_fill(j > i, float("-inf")), -1)
        o = ((p * exact) @ ve + (p * ~exact) @ vq).transpose(0, 1)  # [n, h, d], model basis
        if self.values_rotated:  # o_proj expects the rotated output
            o = o @ self.values_rotated_by.to(o.device)
        return o.reshape(n, h * d).to(out.dtype)

    layer_mod.Attention.forward = forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, choices=(8, 4, 2), default=4)
    ap.add_argument("--keys", choices=SCHEMES, default="token-rot")
    ap.add_argument("--values", choices=SCHEMES, default="token-rot")
    ap.add_argument("--exact-recent", type=int, default=0, metavar="B",
                    help="keys in the query's own block of B tokens are exact (0: none)")
    ap.add_argument("--exact-sink", type=int, default=0, metavar="N", help="the first N tokens are exact")
    ap.add_argument("--channel-group", type=int, default=16, metavar="G", help="tokens per per-channel group")
    ap.add_argument("--label", default="")
    ap.add_argument("accuracy_args", nargs=argparse.REMAINDER, help="after --: kvserve bench accuracy's arguments")
    ns = ap.parse_args()
    args = [a for a in ns.accuracy_args if a != "--"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    install(ns)
    from kvserve.bench.accuracy import register_accuracy, run_accuracy

    parser = argparse.ArgumentParser()
    register_accuracy(parser.add_subparsers())
    acc = parser.parse_args(["accuracy", *args])
    run_accuracy(acc)
    row = acc.result["rows"][0]
    print(json.dumps({"label": ns.label, "bits": ns.bits, "keys": ns.keys, "values": ns.values,
                      "exact_recent": ns.exact_recent, "exact_sink": ns.exact_sink,
                      "channel_group": ns.channel_group, "perplexity": row["perplexity"]["all"],
                      "tokens": row["tokens"], "num_docs": acc.result["num_docs"],
                      "max_doc_tokens": acc.result["max_doc_tokens"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
