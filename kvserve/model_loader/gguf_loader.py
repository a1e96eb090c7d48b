"""GGUF checkpoints (llama.cpp): config, tokenizer and dequantized weights under HF names."""

from __future__ import annotations

import functools
import os
import re
import shutil
from typing import Any, Iterator

import torch

from kvserve.model_loader.gguf_dequant import dequantize_tensor

# llama.cpp tensor name (without blk.N.) -> HF name inside model.layers.N.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Mixture of experts (qwen3moe, qwen2moe, llama with expert_count = Mixtral): the router,
    # experts stacked [E, ...], Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 3 (sandwich norms): llama.cpp's names for its four per-layer norms.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs.weight"}  # llama3 rope factors; we recompute them from the config
_BLK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str) -> Any:
    """Parse ``path`` with ``gguf.GGUFReader`` (memory-mapped), array metadata skipped.

    ``reader.tensors`` are ``GGUFReader``'s; ``reader.fields`` holds the scalar and string
    metadata only (arrays such as ``tokenizer.ggml.tokens`` are stepped over, see
    ``_reader_class``). The last two readers are kept (keyed by path, size and mtime): the
    weights and ``--quantization gguf`` both read them.
    Raises ValueError("<path> is not a valid GGUF file ...: <reason>") when the header or the
    metadata cannot be parsed or tensor data runs past the end of the file (truncation).
    """
    st = os.stat(path)
    return _open_gguf(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime_ns: int) -> Any:
    try:
        reader = _reader_class()(path)
    except Exception as e:  # the reader raises assorted errors on bad bytes
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated?): {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(
                f"{path} is not a valid GGUF file (truncated?): tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes} but the file has {size} bytes"
            )
    return reader


@functools.lru_cache(maxsize=1)
def _reader_class() -> type:
    """``GGUFReader`` that steps over array-valued metadata instead of parsing it.

    ``GGUFReader`` builds a numpy view per array item: ~100k views (seconds) for the
    vocabulary and merges, which the weights never need (the tokenizer and the config are
    read by transformers or from kvserve's caches). Scalars and strings are parsed as
    ``GGUFReader`` does; array fields are left out of ``reader.fields``. Tensors are unchanged.
    """
    import struct
    import sys

    import numpy as np
    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class _Reader(GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            buf = memoryview(self.data)  # struct on a buffer: no numpy view per read
            order = "<" if (sys.byteorder == "little") == (self.byte_order == "I") else ">"
            u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
            for _ in range(int(count)):
                orig_offs = offs
                klen, kdata = self._get_str(offs)
                offs += 8 + int(klen[0])
                raw_type = self._get(offs, np.uint32)
                offs += 4
                if raw_type[0] != GGUFValueType.ARRAY:
                    size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                    self._push_field(ReaderField(orig_offs, str(bytes(kdata), encoding="utf-8"),
                                                 [klen, kdata, raw_type, *parts], [i + 3 for i in idxs], types),
                                     skip_sum=True)
                    offs += size
                    continue
                itype, n = GGUFValueType(u32.unpack_from(buf, offs)[0]), u64.unpack_from(buf, offs + 4)[0]
                offs += 12
                if itype == GGUFValueType.STRING:
                    for _ in range(n):
                        offs += 8 + u64.unpack_from(buf, offs)[0]
                elif itype in self.gguf_scalar_to_np:
                    offs += n * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
                else:  # arrays of arrays: rare and small, parse them the library's way
                    for _ in range(n):
                        offs += self._get_field_parts(offs, itype)[0]
            return offs

    return _Reader


def gguf_architecture(reader: Any) -> str:
    """The ``general.architecture`` string of an open reader (e.g. ``llama``, ``qwen2``)."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("GGUF file has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


def cache_dir() -> str:
    """kvserve's cache directory: ``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    return os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")


def _config_cache_path(path: str) -> str:
    import hashlib

    import transformers

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(cache_dir(), "gguf-configs", hashlib.sha256(key.encode()).hexdigest()[:24])


def load_gguf_config(path: str) -> Any:
    """``transformers`` config built from the GGUF metadata. Raises ValueError on a bad file.

    The config is cached under ``cache_dir()/gguf-configs`` keyed by the file's path, size,
    mtime and the transformers version: transformers re-parses the whole file (vocabulary
    included, ~10 s for a 262k-token one) to build it. Only files that parsed are cached.
    """
    from transformers import AutoConfig

    cached = _config_cache_path(path)
    d, name = os.path.split(os.path.abspath(path))
    if os.path.isfile(os.path.join(cached, "config.json")):
        try:
            config = AutoConfig.from_pretrained(cached)
            config.name_or_path = d  # as if read from the GGUF's directory
            return config
        except Exception:  # an unreadable cache entry: rebuild it below
            pass
    reader = open_gguf(path)  # validate first so corrupt files give a clear ValueError
    config = _moe_config(AutoConfig.from_pretrained(d, gguf_file=name), reader)
    tmp = f"{cached}.{os.getpid()}.tmp"
    try:  # write then rename: concurrent start-ups never read half a file
        config.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:  # a read-only cache, or another process won the rename: only costs time
        shutil.rmtree(tmp, ignore_errors=True)
    return config


def _scalar(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.parts[field.data[0]][0].item()


def _moe_config(config: Any, reader: Any) -> Any:
    """Fill in the MoE fields transformers' GGUF config leaves out: the expert (and shared
    expert) intermediate sizes of ``qwen3moe`` / ``qwen2moe``; a ``llama`` file with
    ``llama.expert_count`` is Mixtral (llama.cpp writes Mixtral as llama) and becomes a
    ``MixtralConfig``."""
    arch = gguf_architecture(reader)
    experts = _scalar(reader, f"{arch}.expert_count")
    if not experts:
        return config
    if arch in ("qwen3moe", "qwen2moe"):
        config.num_experts = int(experts)
        ffn = _scalar(reader, f"{arch}.expert_feed_forward_length")
        if ffn:
            config.moe_intermediate_size = int(ffn)
        shared = _scalar(reader, f"{arch}.expert_shared_feed_forward_length")
        if shared and arch == "qwen2moe":
            config.shared_expert_intermediate_size = int(shared)
    elif arch == "llama":
        from transformers import MixtralConfig

        d = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
        d.update(num_local_experts=int(experts), num_experts_per_tok=int(_scalar(reader, "llama.expert_used_count")))
        config = MixtralConfig(**d)
    return config


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """Map a llama.cpp tensor name to the HF checkpoint name; None for tensors we skip.

    ``arch`` is the file's ``general.architecture`` (``gemma3`` names its norms differently).
    Raises ValueError on names we do not know.
    """
    if name in _IGNORED:
        return None
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = _BLK_RE.match(name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"unknown GGUF tensor name {name!r}")


def reverse_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for ``n_heads`` heads.

    llama.cpp's converter interleaves the two rotary halves of each head's rows (GPT-J
    style rope); HF/kvserve use rotate_half, so put each head's rows back as
    [even pairs..., odd pairs...]. ``w``: ``[n_heads * head_dim, ...]``.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iterate_gguf(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, float32 CPU tensor)`` for every GGUF tensor, dequantized.

    For ``llama``-architecture files Q and K are un-permuted, and for ``gemma3`` files the
    ``+1`` llama.cpp bakes into Gemma's zero-centred norm weights is subtracted, like
    transformers does, so the tensors equal those of
    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``.
    Raises ValueError on a corrupt file or an unknown tensor name.
    """
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    permute = arch == "llama"
    gemma = arch == "gemma3"
    n_heads = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name, arch)
        if name is None:
            continue
        w = dequantize_tensor(t.data, t.tensor_type)
        if gemma and name.endswith("norm.weight"):
            w = w - 1
        if name.endswith(".shared_expert_gate.weight") and w.dim() == 1:
            w = w.unsqueeze(0)  # llama.cpp stores Qwen2-MoE's [1, H] gate as [H]
        if permute and ".self_attn.q_proj." in name:
            w = reverse_permute(w, n_heads)
        elif permute and ".self_attn.k_proj." in name:
            w = reverse_permute(w, n_kv)
        yield name, w
