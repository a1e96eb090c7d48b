"""GGUF checkpoints (llama.cpp): config, tokenizer and dequantized weights under HF names."""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

import torch

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
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs.weight"}  # llama3 rope factors; we recompute them from the config
_BLK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str) -> Any:
    """Parse ``path`` with ``gguf.GGUFReader`` (memory-mapped).

    Raises ValueError("<path> is not a valid GGUF file ...: <reason>") when the header or the
    metadata cannot be parsed or tensor data runs past the end of the file (truncation).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on bad bytes
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated?): {e}") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(
                f"{path} is not a valid GGUF file (truncated?): tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes} but the file has {size} bytes"
            )
    return reader


def gguf_architecture(reader: Any) -> str:
    """The ``general.architecture`` string of an open reader (e.g. ``llama``, ``qwen2``)."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("GGUF file has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


def load_gguf_config(path: str) -> Any:
    """``transformers`` config built from the GGUF metadata. Raises ValueError on a bad file."""
    from transformers import AutoConfig

    open_gguf(path)  # validate first so corrupt files give a clear ValueError
    d, name = os.path.split(os.path.abspath(path))
    return AutoConfig.from_pretrained(d, gguf_file=name)


def gguf_to_hf_name(name: str) -> str | None:
    """Map a llama.cpp tensor name to the HF checkpoint name; None for tensors we skip.

    Raises ValueError on names we do not know.
    """
    if name in _IGNORED:
        return None
    m = _BLK_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
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

    For ``llama``-architecture files Q and K are un-permuted like transformers does, so
    the tensors equal those of ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``.
    Raises ValueError on a corrupt file or an unknown tensor name.
    """
    from gguf.quants import dequantize

    reader = open_gguf(path)
    permute = gguf_architecture(reader) == "llama"
    n_heads = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if permute and ".self_attn.q_proj." in name:
            w = reverse_permute(w, n_heads)
        elif permute and ".self_attn.k_proj." in name:
            w = reverse_permute(w, n_kv)
        yield name, w
