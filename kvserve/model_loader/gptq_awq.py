"""GPTQ and AWQ checkpoints kept quantized (``--quantization gptq|awq``, vLLM's ``*_marlin`` names too).

Detected from config.json's ``quantization_config.quant_method`` (``gptq`` / ``awq``). Each quantized
projection ``{layer}`` stores, as AutoGPTQ / GPTQModel and AutoAWQ write them:

GPTQ (``bits`` 4 or 8, ``p = 32 / bits`` values per int32, fields filled from the low bits up):
  ``qweight`` int32 ``[K / p, N]`` — packed along K: field ``j`` of ``qweight[i, n]`` is ``q[p*i + j, n]``;
  ``qzeros`` int32 ``[G, N / p]`` — packed along N the same way; ``scales`` float16 ``[G, N]``;
  ``g_idx`` int32 ``[K]`` — the group of each input feature (``desc_act`` / activation order: not sorted).
  ``w[n, k] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``. The stored zero is ``z - 1``
  (AutoGPTQ's v1 convention) unless ``checkpoint_format`` is ``gptq_v2`` (GPTQModel), which stores ``z``.
AWQ ("gemm" version, 4 bits):
  ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]`` packed along N in AutoAWQ's
  interleaved order: field ``i`` of word ``c`` holds column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``;
  ``scales`` float16 ``[G, N]``; ``w[n, k] = scales[k // g, n] * (q[k, n] - z[k // g, n])``.

``G = K / group_size`` (1 for per channel, ``group_size: -1``). Everything is unpacked to a
``GroupQuantWeight`` and repacked into the kernel layout (``PackedGroupQuant``: the Triton W4A16 GEMM on
CUDA, int4pack or ``cpu_int4`` on the CPU). ``desc_act``: K is sorted by group at load and the activations are gathered in
that order at run time. Tensor parallelism: column-parallel layers take their output rows; row-parallel
layers their input slice, which must hold whole groups (else a ValueError).

Mixture-of-experts layers (``FusedMoE``: Qwen2/3-MoE, Mixtral, DeepSeek): each expert's projections
(``...experts.{e}.gate_proj|up_proj|down_proj``, Mixtral's ``w1|w3|w2``) in the same formats are kept
packed as ``GroupQuantExperts`` (gate and up rows stacked, as the dense ``w13``) and run by the fused
W4A16 MoE kernel (``layers.moe.group_quant_experts``). Tensor parallel: gate/up take this rank's
intermediate rows, down its intermediate input slice (whole groups, else a ValueError); expert
parallel: whole experts. ``desc_act``: each expert's K sorted by group, its order kept for the kernel's
activation gather (gate and up must share it, as GPTQ gives them). Routers and
shared experts load as the checkpoint stores them (dense when excluded: ``modules_to_not_convert``,
GPTQ ``dynamic`` ``-:`` rules). Unsupported bits / group
sizes / formats and missing or mis-shaped tensors are start-up ValueErrors naming the tensor and shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from kvserve.layers.quantization import PACKED_SHARDS, quantized_linears
from kvserve.layers.quantization.group_quant import GROUP_SIZES, GroupQuantWeight, PackedGroupQuant

#: ``--quantization`` names -> the checkpoint format they select (vLLM's *_marlin names: the same kernel path here)
METHOD_ALIASES = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ WQLinear_GEMM: field i of a word holds column AWQ_ORDER[i]
_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
#: a per-expert projection of a checkpoint: (the experts' prefix, expert, projection)
_EXPERT_LAYER_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
_EXPERT_SHARD = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


@dataclass(frozen=True)
class GptqAwqConfig:
    """The parsed ``quantization_config`` of a GPTQ or AWQ checkpoint."""

    method: str  # gptq | awq
    bits: int
    group_size: int  # -1: per output channel
    sym: bool
    desc_act: bool
    zero_offset: int  # added to the stored zero point: 1 for GPTQ v1, else 0

    @classmethod
    def from_dict(cls, q: dict) -> "GptqAwqConfig":
        """Raises ValueError naming the field for anything unsupported."""
        method = q.get("quant_method")
        if method == "gptq":
            bits = int(q.get("bits", 4))
            if bits not in (4, 8):
                raise ValueError(f"GPTQ quantization_config.bits={bits} is not supported (4 or 8)")
            if q.get("is_marlin_format"):
                raise ValueError("GPTQ quantization_config.is_marlin_format=true (Marlin-repacked storage) is not "
                                 "supported; use the GPTQ checkpoint it was made from")
            fmt = q.get("checkpoint_format") or "gptq"
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ quantization_config.checkpoint_format={fmt!r} is not supported "
                                 "(gptq, gptq_v2)")
            if q.get("lm_head"):
                raise ValueError("GPTQ quantization_config.lm_head=true (a quantized LM head) is not supported")
            overrides = [k for k in (q.get("dynamic") or {}) if not str(k).startswith("-:")]
            if overrides:  # "-:<regex>" only excludes modules, which the checkpoint then stores dense
                raise ValueError(f"GPTQ quantization_config.dynamic overrides {overrides} are not supported "
                                 "(only '-:' exclusions)")
            if str(q.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
                raise ValueError(f"GPTQ quantization_config.pack_dtype={q['pack_dtype']!r}: only int32 is supported")
            cfg = cls("gptq", bits, int(q.get("group_size", 128)), bool(q.get("sym", True)),
                      bool(q.get("desc_act", False)), 1 if fmt == "gptq" else 0)
        elif method == "awq":
            bits = int(q.get("bits", q.get("w_bit", 4)))
            if bits != 4:
                raise ValueError(f"AWQ quantization_config.bits={bits} is not supported (4)")
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ quantization_config.version={version!r} is not supported (gemm)")
            if not q.get("zero_point", True):
                raise ValueError("AWQ quantization_config.zero_point=false is not supported (AWQ gemm stores zeros)")
            cfg = cls("awq", 4, int(q.get("group_size", q.get("q_group_size", 128))), False, False, 0)
        else:
            raise ValueError(f"quant_method {method!r} is not GPTQ or AWQ")
        if cfg.group_size not in GROUP_SIZES:
            raise ValueError(f"{method.upper()} quantization_config.group_size={cfg.group_size} is not supported "
                             f"({', '.join(map(str, GROUP_SIZES))})")
        return cfg


def quantization_config_of(hf_config: Any) -> Optional[dict]:
    q = getattr(hf_config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return q


def resolve_gptq_awq(requested: Optional[str], hf_config: Any, load_format: str, path: str = ""
                     ) -> Optional[str]:
    """``gptq`` / ``awq`` when the checkpoint (or, for dummy weights, the flag) asks for it, else None.

    Raises ValueError when ``--quantization`` names GPTQ/AWQ and the checkpoint is something else, or
    another method is asked of a GPTQ/AWQ checkpoint, or its ``quantization_config`` is unsupported.
    """
    q = quantization_config_of(hf_config) if load_format == "safetensors" else None
    qm = (q or {}).get("quant_method")
    want = METHOD_ALIASES.get(requested or "")
    if qm in ("gptq", "awq"):
        if requested is not None and want != qm:
            raise ValueError(f"{path or 'the model'} is a {qm.upper()} checkpoint; --quantization {requested} "
                             f"cannot apply to it: leave --quantization unset or pass {qm} / {qm}_marlin")
        GptqAwqConfig.from_dict(q)
        return qm
    if want is None:
        return None
    if load_format == "dummy":
        return want
    raise ValueError(f"--quantization {requested} needs a checkpoint whose config.json has "
                     f"quantization_config.quant_method {want!r}; {path or 'this model'} has {qm or 'none'}")


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` packed along rows -> int ``[R * p, C]`` (field j of row i -> row p*i + j)."""
    p = 32 // bits
    shifts = torch.arange(p, dtype=torch.int32) * bits
    v = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return v.reshape(packed.shape[0] * p, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int, order: Optional[tuple] = None) -> torch.Tensor:
    """int32 ``[R, C]`` packed along columns -> int ``[R, C * p]`` (field i of word c -> column p*c + order[i])."""
    p = 32 // bits
    shifts = torch.arange(p, dtype=torch.int32) * bits
    v = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # [R, C, field]
    if order is not None:
        v = v[..., torch.argsort(torch.tensor(order))]  # field -> column position
    return v.reshape(packed.shape[0], packed.shape[1] * p)


@dataclass
class Decoded:
    """One checkpoint layer unpacked: ``q`` uint8 ``[N, K]`` (model input order), ``scale`` / ``zero`` float32
    ``[N, G]`` (zero None: symmetric), ``g_idx`` int64 ``[K]``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    g_idx: torch.Tensor


def _need(t: dict, layer: str, key: str, shape: tuple, what: str) -> torch.Tensor:
    if key not in t:
        raise ValueError(f"malformed {what} checkpoint: tensor {layer}.{key} is missing (expected shape {shape})")
    x = t[key]
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"malformed {what} checkpoint: {layer}.{key} has shape {tuple(x.shape)}, "
                         f"expected {tuple(shape)}")
    return x


def decode_layer(layer: str, cfg: GptqAwqConfig, t: dict[str, torch.Tensor]) -> Decoded:
    """One layer's ``qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``) -> ``Decoded``. ValueError names a
    missing or mis-shaped tensor (with the expected shape) or a group size that does not divide K."""
    what = cfg.method.upper()
    bits, p = cfg.bits, 32 // cfg.bits
    if "qweight" not in t or "scales" not in t:
        missing = "qweight" if "qweight" not in t else "scales"
        raise ValueError(f"malformed {what} checkpoint: tensor {layer}.{missing} is missing")
    qw, sc = t["qweight"], t["scales"]
    if qw.dim() != 2 or sc.dim() != 2 or qw.dtype != torch.int32:
        raise ValueError(f"malformed {what} checkpoint: {layer}.qweight is {qw.dtype} {tuple(qw.shape)} and "
                         f"{layer}.scales {tuple(sc.shape)}; expected int32 2-D and 2-D")
    if cfg.method == "gptq":
        k, n = qw.shape[0] * p, qw.shape[1]
    else:
        k, n = qw.shape[0], qw.shape[1] * p
    g = k if cfg.group_size == -1 else cfg.group_size
    if k % g:
        raise ValueError(f"{what} {layer}: group_size {g} does not divide in_features {k} "
                         f"({layer}.qweight {tuple(qw.shape)})")
    n_groups = k // g
    _need(t, layer, "scales", (n_groups, n), what)
    if n % p:
        raise ValueError(f"{what} {layer}: out_features {n} is not a multiple of {p} (qzeros packing)")
    qz = _need(t, layer, "qzeros", (n_groups, n // p), what)
    if cfg.method == "gptq":
        q = _unpack_rows(qw, bits).t()
        z = _unpack_cols(qz, bits) + cfg.zero_offset
        if "g_idx" in t:
            gi = _need(t, layer, "g_idx", (k,), what).long()
            if gi.numel() and (gi.min() < 0 or gi.max() >= n_groups):
                raise ValueError(f"malformed {what} checkpoint: {layer}.g_idx values must lie in [0, {n_groups})")
        else:
            gi = torch.arange(k) // g
    else:
        q = _unpack_cols(qw, bits, AWQ_ORDER).t()
        z = _unpack_cols(qz, bits, AWQ_ORDER)
        gi = torch.arange(k) // g
    z = z.t().float()
    zero = None if cfg.sym and bool((z == (1 << (bits - 1))).all()) else z
    return Decoded(q.to(torch.uint8).contiguous(), sc.t().float().contiguous(), zero, gi)


def _to_weight(d: Decoded, bits: int, layer: str, tp_note: str = "") -> GroupQuantWeight:
    """Sort K by group (``desc_act``) and check that every group is whole; -> ``GroupQuantWeight``."""
    k = d.q.shape[1]
    used, counts = torch.unique(d.g_idx, return_counts=True)
    if len(used) and not bool((counts == counts[0]).all()):
        raise ValueError(f"{layer}: its input features{tp_note} do not hold whole quantization groups "
                         f"(group sizes {sorted(set(counts.tolist()))} in g_idx); the groups must be equal")
    g = k // max(1, len(used))
    if len(used) > 1 and g not in (32, 64, 128, 256):
        raise ValueError(f"{layer}: its input features{tp_note} hold groups of {g}, which the kernels cannot run "
                         "(32, 64, 128, 256): tensor-parallel shards must be cut on group boundaries")
    perm = None
    if not bool((d.g_idx[1:] >= d.g_idx[:-1]).all()):
        perm = torch.argsort(d.g_idx, stable=True)
    q = d.q if perm is None else d.q[:, perm]
    scale, zero = d.scale[:, used], (d.zero[:, used] if d.zero is not None else None)
    return GroupQuantWeight(q.contiguous(), scale.contiguous(), zero.contiguous() if zero is not None else None,
                            bits, g, perm)


def _shard(linear: nn.Module, part: int, d: Decoded) -> Decoded:
    """This rank's slice of one HF shard of ``linear`` (column-parallel: output rows; row-parallel: inputs)."""
    from kvserve.layers.linear import ColumnParallelLinear, RowParallelLinear

    if isinstance(linear, ColumnParallelLinear) and linear.tp_size > 1:
        s, n = linear.local_starts[part], linear.local_sizes[part]
        return Decoded(d.q[s:s + n], d.scale[s:s + n], d.zero[s:s + n] if d.zero is not None else None, d.g_idx)
    if isinstance(linear, RowParallelLinear) and linear.tp_size > 1:
        kl = linear.in_features
        s = linear.tp_rank * kl
        return Decoded(d.q[:, s:s + kl], d.scale, d.zero, d.g_idx[s:s + kl])
    return d


class GptqAwqLoader:
    """Splits a checkpoint's tensors: quantized projections' to ``decode_layer``, the rest to the dense load.

    ``filter(weights)`` yields the dense ``(name, tensor)`` pairs and, per quantized layer, a zero-stride
    ``{layer}.weight`` placeholder of its full ``[N, K]`` shape (so the dense load checks it against the
    model); ``apply(model, dtype)`` then swaps each projection for a ``QuantizedLinear``.
    """

    def __init__(self, model: nn.Module, cfg: GptqAwqConfig) -> None:
        self.cfg = cfg
        names = {id(m): n for n, m in model.named_modules()}
        self.layers = {f"{names[id(p)]}.{s}" for p, attr, _ in quantized_linears(model)
                       for s in PACKED_SHARDS.get(attr, (attr,))}
        self.decoded: dict[str, Decoded] = {}
        from kvserve.layers.moe import FusedMoE

        self.moes = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
        self.hf_mlp = f".{getattr(model, 'hf_mlp_name', 'mlp')}."
        #: (FusedMoE name, expert, shard w1/w3/w2) -> (checkpoint layer name, its raw tensors)
        self.experts: dict[tuple[str, int, str], tuple[str, dict[str, torch.Tensor]]] = {}

    def _expert_key(self, layer: str) -> Optional[tuple[str, int, str]]:
        m = _EXPERT_LAYER_RE.match(layer)
        if m is None:
            return None
        prefix = m.group(1).replace(self.hf_mlp, ".mlp.", 1)
        if prefix not in self.moes:
            return None
        return prefix, int(m.group(2)), _EXPERT_SHARD[m.group(3)]

    def _expert_shape(self, layer: str, t: dict[str, torch.Tensor]) -> tuple[int, int]:
        """``[N, K]`` of an expert projection from its ``qweight`` (decoded and checked in ``apply``)."""
        qw = t.get("qweight")
        if qw is None or qw.dim() != 2:
            raise ValueError(f"malformed {self.cfg.method.upper()} checkpoint: tensor {layer}.qweight is "
                             f"{'missing' if qw is None else f'of shape {tuple(qw.shape)}, not 2-D'}")
        p = 32 // self.cfg.bits
        return (qw.shape[1], qw.shape[0] * p) if self.cfg.method == "gptq" else (qw.shape[1] * p, qw.shape[0])

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        collected: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            layer, _, key = name.rpartition(".")
            if key in _TENSORS:
                ek = self._expert_key(layer) if layer not in self.layers else None
                if ek is not None:
                    self.experts.setdefault(ek, (layer, {}))[1][key] = tensor
                    continue
                if layer not in self.layers:
                    raise ValueError(f"{self.cfg.method.upper()}: {name} is a quantized tensor of a layer that is not "
                                     "a decoder projection (q/k/v/o, gate/up/down) or an MoE expert's; only those "
                                     "load quantized")
                collected.setdefault(layer, {})[key] = tensor
            else:
                yield name, tensor
        for layer, t in collected.items():
            d = decode_layer(layer, self.cfg, t)
            self.decoded[layer] = d
            yield f"{layer}.weight", torch.zeros((), dtype=torch.float32).expand(*d.q.shape)
        for layer, t in self.experts.values():  # placeholders: the model checks every expert is there
            yield f"{layer}.weight", torch.zeros((), dtype=torch.float32).expand(*self._expert_shape(layer, t))

    @torch.no_grad()
    def apply(self, model: nn.Module, dtype: torch.dtype) -> int:
        """Swap each projection whose shards are all quantized; returns the count. ValueError for fused shards
        stored differently (some dense, or different activation orders) or shards not on group boundaries."""
        from kvserve.layers.linear import RowParallelLinear
        from kvserve.layers.quantization import QuantizedLinear

        names = {id(m): n for n, m in model.named_modules()}
        done = 0
        for parent, attr, linear in quantized_linears(model):
            prefix = names[id(parent)]
            layers = [f"{prefix}.{s}" for s in PACKED_SHARDS.get(attr, (attr,))]
            have = [n in self.decoded for n in layers]
            if not any(have):
                continue
            if not all(have):
                raise ValueError(f"{', '.join(layers)} are fused into one {attr}: all must be quantized or none "
                                 f"(dense: {[n for n, h in zip(layers, have) if not h]})")
            row = isinstance(linear, RowParallelLinear) and linear.tp_size > 1
            note = f" on tensor-parallel rank {linear.tp_rank} of {linear.tp_size}" if row else ""
            ws = [_to_weight(_shard(linear, i, self.decoded[n]), self.cfg.bits, n, note) for i, n in enumerate(layers)]
            w0 = ws[0]
            for n, w in zip(layers[1:], ws[1:]):
                same_perm = (w.perm is None and w0.perm is None) or (
                    w.perm is not None and w0.perm is not None and torch.equal(w.perm, w0.perm))
                if w.group_size != w0.group_size or not same_perm:
                    raise ValueError(f"{n} and {layers[0]} are fused into one {attr} but have different g_idx "
                                     "(activation orders or group sizes)")
            zero = None if all(w.zero is None for w in ws) else torch.cat([w.zeros() for w in ws])
            w = GroupQuantWeight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]), zero,
                                 self.cfg.bits, w0.group_size, w0.perm)
            bias = linear.bias.detach() if linear.bias is not None else None
            dev = linear.weight.device
            ql = QuantizedLinear(self.cfg.method, PackedGroupQuant(w, dev, dtype), w.q.shape[1], w.q.shape[0], bias,
                                 tp_reduce=row)
            setattr(parent, attr, ql)
            done += 1
        self.decoded.clear()  # free the unpacked copies
        for prefix, moe in self.moes.items():
            done += self._apply_experts(prefix, moe, dtype)
        self.experts.clear()
        return done

    def _expert_weight(self, moe: nn.Module, prefix: str, e: int, shard: str) -> GroupQuantWeight:
        """One local expert's projection decoded, cut to this rank's slice (``GroupQuantWeight``)."""
        layer, t = self.experts[(prefix, e, shard)]
        d = decode_layer(layer, self.cfg, t)
        i, full_i = moe.intermediate_local, moe.intermediate_size
        want = (moe.hidden_size, full_i) if shard == "w2" else (full_i, moe.hidden_size)
        if tuple(d.q.shape) != want:
            raise ValueError(f"malformed {self.cfg.method.upper()} checkpoint: {layer} is {tuple(d.q.shape)} "
                             f"(out, in features), expected {want}")
        note = ""
        if moe.ep_size == 1 and moe.tp_size > 1:
            s = moe.tp_rank * i
            if shard == "w2":
                d = Decoded(d.q[:, s:s + i], d.scale, d.zero, d.g_idx[s:s + i])
                note = f" on tensor-parallel rank {moe.tp_rank} of {moe.tp_size}"
            else:
                d = Decoded(d.q[s:s + i], d.scale[s:s + i], d.zero[s:s + i] if d.zero is not None else None, d.g_idx)
        return _to_weight(d, self.cfg.bits, layer, note)

    def _apply_experts(self, prefix: str, moe: nn.Module, dtype: torch.dtype) -> int:
        """Pack one ``FusedMoE``'s quantized experts into ``GroupQuantExperts``; 0 when its experts are dense.
        ValueError names a missing expert tensor (with the expected shape) or a mixed dense / quantized layer."""
        from kvserve.layers.moe.group_quant_experts import GroupQuantExperts

        have = {k for k in self.experts if k[0] == prefix}
        if not have:
            return 0
        w13, w2 = [], []
        for e in moe.local_experts:
            for shard in ("w1", "w3", "w2"):
                if (prefix, e, shard) not in have:
                    i, h = moe.intermediate_size, moe.hidden_size
                    n, k = (h, i) if shard == "w2" else (i, h)
                    p = 32 // self.cfg.bits
                    qshape = (k // p, n) if self.cfg.method == "gptq" else (k, n // p)
                    raise ValueError(f"{prefix}: expert {e} {shard} is not stored quantized like the layer's other "
                                     f"experts (expected its qweight of shape {qshape}, scales, qzeros)")
            gate, up, down = (self._expert_weight(moe, prefix, e, s) for s in ("w1", "w3", "w2"))
            same_perm = (gate.perm is None and up.perm is None) or (
                gate.perm is not None and up.perm is not None and torch.equal(gate.perm, up.perm))
            if gate.group_size != up.group_size or not same_perm:
                raise ValueError(f"{self.experts[(prefix, e, 'w3')][0]} and {self.experts[(prefix, e, 'w1')][0]} "
                                 "are fused into one gate/up GEMM but have different g_idx (activation orders or "
                                 "group sizes)")
            zero = None if gate.zero is None and up.zero is None else torch.cat([gate.zeros(), up.zeros()])
            w13.append(GroupQuantWeight(torch.cat([gate.q, up.q]), torch.cat([gate.scale, up.scale]), zero,
                                        self.cfg.bits, gate.group_size, gate.perm))
            w2.append(down)
            for s in ("w1", "w3", "w2"):  # free the raw tensors as they are packed
                self.experts.pop((prefix, e, s), None)
        dev = moe.w13.device
        moe.set_group_quant_experts(self.cfg.method, GroupQuantExperts(w13, dev, dtype, f"{prefix}.w13"),
                                    GroupQuantExperts(w2, dev, dtype, f"{prefix}.w2"))
        return 1


@torch.no_grad()
def quantize_dummy(model: nn.Module, method: str, dtype: torch.dtype, hf_config: Any = None) -> int:
    """Dummy weights in a GPTQ / AWQ layout: each projection's and MoE expert's (random) dense weight
    quantized at load.

    Parameters come from ``hf_config``'s ``quantization_config`` when it is GPTQ/AWQ, else AWQ's
    (4 bits, group 128, zero points) / GPTQ's most common (4 bits, group 128, symmetric). For
    benchmarks (``--load-format dummy --quantization awq``). Returns the number of layers replaced.
    """
    from kvserve.layers.linear import RowParallelLinear
    from kvserve.layers.quantization import QuantizedLinear
    from kvserve.layers.quantization.group_quant import quantize_groupwise

    q = quantization_config_of(hf_config) if hf_config is not None else None
    if q and q.get("quant_method") == method:
        cfg = GptqAwqConfig.from_dict(q)
    else:
        cfg = GptqAwqConfig(method, 4, 128, method == "gptq", False, 0)
    n = 0
    for parent, attr, linear in quantized_linears(model):
        k = linear.in_features
        g = cfg.group_size if cfg.group_size != -1 and k % cfg.group_size == 0 else -1
        w = quantize_groupwise(linear.weight.detach(), cfg.bits, g, cfg.sym)
        row = isinstance(linear, RowParallelLinear) and linear.tp_size > 1
        bias = linear.bias.detach() if linear.bias is not None else None
        setattr(parent, attr, QuantizedLinear(method, PackedGroupQuant(w, linear.weight.device, dtype), k,
                                              linear.out_features, bias, tp_reduce=row))
        n += 1
    from kvserve.layers.moe import FusedMoE
    from kvserve.layers.moe.group_quant_experts import GroupQuantExperts

    for name, moe in list(model.named_modules()):
        if not isinstance(moe, FusedMoE) or moe.quant_method is not None:
            continue
        packed = []
        for wname in ("w13", "w2"):
            w = getattr(moe, wname).detach()
            k = w.shape[2]
            g = cfg.group_size if cfg.group_size != -1 and k % cfg.group_size == 0 else -1
            packed.append(GroupQuantExperts([quantize_groupwise(w[e], cfg.bits, g, cfg.sym) for e in range(w.shape[0])],
                                            w.device, dtype, f"{name}.{wname}"))
        moe.set_group_quant_experts(method, *packed)
        n += 1
    return n
