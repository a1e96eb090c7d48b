"""Find models on disk and load configs, tokenizers and weights (safetensors, GGUF, dummy).

Nothing here ever contacts the HF hub: every path must exist locally.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from torch import nn

from kvserve.layers import materialize
from kvserve.model_loader.default_model import default_model_path
from kvserve.model_loader.dummy_loader import init_dummy_weights
from kvserve.model_loader.gemma3_package import MODEL_ALIAS as GEMMA3_ALIAS
from kvserve.model_loader.gemma3_package import gemma3_270m_path
from kvserve.model_loader.gguf_loader import iterate_gguf, load_gguf_config
from kvserve.model_loader.hf_loader import iterate_safetensors

__all__ = ["resolve_model", "load_hf_config", "get_model", "get_tokenizer", "export_hf"]

_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# GGUF-derived configs carry no `architectures`; infer it from model_type.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _single_gguf_in(directory: str) -> str | None:
    files = sorted(glob.glob(os.path.join(directory, "*.gguf")))
    return files[0] if len(files) == 1 else None


def resolve_model(model: str | None, load_format: str) -> tuple[str, str]:
    """Resolve a user model argument to ``(path, load_format)``.

    ``model``: None (the embedded SmolLM2-135M-Instruct GGUF), ``gemma3-270m`` (the packaged
    Gemma 3 270M GGUF, assembled once into the cache), a ``.gguf`` file, an HF directory with
    ``config.json`` or, for ``dummy``, a ``config.json`` file (its directory is returned).
    ``load_format``: auto | safetensors | gguf | dummy; the returned one is never ``auto``. A ``.gguf`` path may also be used with ``dummy``.

    Raises FileNotFoundError for a missing path (no hub lookups are made) or a missing
    default package, ValueError for a format that does not fit the path.
    """
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {load_format!r}")
    if model is None:
        path = default_model_path()
        return path, "dummy" if load_format == "dummy" else _check(path, "gguf", load_format)
    path = os.path.abspath(os.path.expanduser(model))
    if model == GEMMA3_ALIAS and not os.path.exists(path):
        path = gemma3_270m_path()
        return path, "dummy" if load_format == "dummy" else _check(path, "gguf", load_format)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {model!r} does not exist; kvserve only loads local HF directories "
            "or .gguf files (it never downloads from the hub)"
        )
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path, "dummy" if load_format == "dummy" else _check(path, "gguf", load_format)
        if os.path.basename(path) == "config.json" and load_format == "dummy":
            return os.path.dirname(path), "dummy"
        raise ValueError(f"{model!r} is a file but not a .gguf (pass an HF model directory instead)")
    if os.path.isfile(os.path.join(path, "config.json")):
        if load_format == "dummy":
            return path, "dummy"
        if load_format == "gguf":
            gguf = _single_gguf_in(path)
            if gguf is None:
                raise ValueError(f"load_format=gguf but {model!r} holds no single .gguf file")
            return gguf, "gguf"
        return path, "safetensors"
    gguf = _single_gguf_in(path)
    if gguf is not None:
        return gguf, "dummy" if load_format == "dummy" else _check(gguf, "gguf", load_format)
    raise FileNotFoundError(f"{model!r} has neither config.json nor a single .gguf file")


def _check(path: str, fmt: str, requested: str) -> str:
    if requested not in ("auto", fmt):
        raise ValueError(f"{path} is a {fmt} model but load_format={requested!r}")
    return fmt


def load_hf_config(path: str, load_format: str) -> Any:
    """The ``transformers.PretrainedConfig`` of a resolved model.

    ``path``/``load_format`` as returned by ``resolve_model``. Reads ``config.json`` or the
    GGUF metadata; ``architectures`` is filled from ``model_type`` when absent.
    Raises ValueError("... is not a valid GGUF file ...: <reason>") on a corrupt GGUF.
    """
    from transformers import AutoConfig

    if path.endswith(".gguf") and os.path.isfile(path):
        config = load_gguf_config(path)
    else:
        config = AutoConfig.from_pretrained(path)
    if not getattr(config, "architectures", None) and config.model_type in _ARCH_BY_MODEL_TYPE:
        config.architectures = [_ARCH_BY_MODEL_TYPE[config.model_type]]
    return config


def _rebuild_buffers(model: nn.Module) -> None:
    from kvserve.layers.rotary import RotaryEmbedding
    from kvserve.models.moe_stats import moe_blocks

    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.build_cache()
    for m in moe_blocks(model):  # routed-token counters start at zero
        m.expert_counts.zero_()


def _fp8_checkpoint(hf_config: Any):
    from kvserve.model_loader.fp8_checkpoint import fp8_checkpoint_config

    return fp8_checkpoint_config(hf_config)


def get_model(model_config: Any, device: str) -> nn.Module:
    """Build the model for ``model_config`` (a ``kvserve.config.ModelConfig``) and load its weights.

    Parameters are allocated directly on ``device`` in ``model_config.dtype`` (no CPU
    init pass), then filled from safetensors, GGUF (dequantized) or random (dummy,
    seeded by ``model_config.seed``), then quantized per ``model_config.quantization`` (decoder
    projections replaced by ``QuantizedLinear``; ``compressed-tensors`` loads a pre-quantized
    checkpoint's projections as stored, ``compressed_tensors_quant``; ``gptq`` / ``awq`` likewise,
    ``gptq_awq``; HF FP8 checkpoints, ``fp8_checkpoint``). Returns the model in eval mode.
    Raises ValueError for an unsupported architecture or a checkpoint that does not match.
    """
    from kvserve.models.registry import get_model_class

    dtype = getattr(torch, model_config.dtype)
    hf_config = model_config.hf_config or load_hf_config(model_config.model, model_config.load_format)
    cls = get_model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, dtype, max_model_len=model_config.max_model_len)
    from kvserve.distributed import get_pp_rank, get_pp_size

    if get_pp_size() > 1:  # a pipeline stage allocates its own layers only
        from kvserve.models.pipeline import apply_pipeline_stage

        apply_pipeline_stage(model, get_pp_rank(), get_pp_size())
    model = materialize(model, device)
    _rebuild_buffers(model)  # meta construction left non-persistent buffers empty
    fmt = model_config.load_format
    method = getattr(model_config, "quantization", None)
    if fmt == "dummy":
        init_dummy_weights(model, model_config.seed)
    elif fmt == "gguf":
        model.load_weights(iterate_gguf(model_config.model, hf_config))
    elif fmt == "safetensors" and method == "compressed-tensors":
        from kvserve.layers.quantization import apply_prequantized
        from kvserve.model_loader.compressed_tensors_quant import CompressedTensorsLoader, CompressedTensorsPlan

        ct = CompressedTensorsLoader(model, CompressedTensorsPlan(hf_config))
        model.load_weights(ct.filter(iterate_safetensors(model_config.model)))
        apply_prequantized(model, ct.weights, dtype)
    elif fmt == "safetensors" and method in ("gptq", "awq"):
        from kvserve.model_loader.gptq_awq import GptqAwqConfig, GptqAwqLoader, quantization_config_of

        qcfg = quantization_config_of(hf_config) or {}
        if qcfg.get("quant_method") != method:
            raise ValueError(f"--quantization {method} needs a {method.upper()} checkpoint (config.json "
                             f"quantization_config.quant_method), got {qcfg.get('quant_method')!r}")
        ga = GptqAwqLoader(model, GptqAwqConfig.from_dict(qcfg))
        model.load_weights(ga.filter(iterate_safetensors(model_config.model)))
        ga.apply(model, dtype)
    elif fmt == "safetensors" and _fp8_checkpoint(hf_config) is not None:
        from kvserve.model_loader.fp8_checkpoint import Fp8CheckpointLoader

        fp8 = Fp8CheckpointLoader(model, _fp8_checkpoint(hf_config), dtype, keep=method == "fp8")
        model.load_weights(fp8.filter(iterate_safetensors(model_config.model)))
        fp8.apply(model)
        method = None  # loaded as stored: nothing left to quantize
    elif fmt == "safetensors":
        model.load_weights(iterate_safetensors(model_config.model))
    else:
        raise ValueError(f"unresolved load_format {fmt!r}; call resolve_model first")
    if method == "compressed-tensors":
        if fmt != "safetensors":
            raise ValueError(f"--quantization compressed-tensors needs an HF safetensors checkpoint, got {fmt!r}")
    elif method in ("gptq", "awq"):
        if fmt == "dummy":
            from kvserve.model_loader.gptq_awq import quantize_dummy

            quantize_dummy(model, method, dtype, hf_config)
        elif fmt != "safetensors":
            raise ValueError(f"--quantization {method} needs an HF safetensors checkpoint, got {fmt!r}")
    elif method == "gguf":
        from kvserve.model_loader.gguf_quant import apply_gguf_quantization, read_gguf_quantized

        if fmt != "gguf":
            raise ValueError(f"--quantization gguf needs a GGUF model, got load_format {fmt!r}")
        apply_gguf_quantization(model, read_gguf_quantized(model_config.model, hf_config), dtype)
    elif method is not None:
        from kvserve.layers.quantization import quantize_model

        quantize_model(model, method, dtype)
    return model.eval()


def get_tokenizer(model_path: str, load_format: str, tokenizer: str | None = None) -> Any:
    """A ``transformers`` tokenizer (with the chat template when the model ships one).

    ``tokenizer`` (a directory or ``.gguf``) overrides ``model_path``. GGUF files are read
    with ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` once, then from the disk
    cache (``tokenizer_cache.py``; ``KVSERVE_TOKENIZER_CACHE=0`` turns it off).
    Raises FileNotFoundError if the path does not exist.
    """
    from transformers import AutoTokenizer

    path = os.path.abspath(os.path.expanduser(tokenizer or model_path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        from kvserve.model_loader.tokenizer_cache import load_gguf_tokenizer

        return load_gguf_tokenizer(path, use_cache=os.environ.get("KVSERVE_TOKENIZER_CACHE", "1") != "0")
    return AutoTokenizer.from_pretrained(path)


def export_hf(model: str | None, out_dir: str, load_format: str = "auto") -> list[str]:
    """Write a Hugging Face tokenizer directory plus ``config.json`` (and
    ``generation_config.json`` when known) for ``model`` (default model, a ``.gguf``, or an HF
    directory) into ``out_dir``, so that tools which need ``AutoTokenizer.from_pretrained(dir)``
    (AIPerf, lm-eval, ...) work offline. Weights are not exported. Returns the files written.

    Raises FileNotFoundError for a missing model, FileExistsError if ``out_dir`` is a
    non-empty directory that holds no ``config.json`` (never clobbers unrelated files).
    """
    path, fmt = resolve_model(model, load_format)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "config.json")):
        raise FileExistsError(f"{out_dir} is not empty; choose a new directory")
    os.makedirs(out_dir, exist_ok=True)
    tok = get_tokenizer(path, "gguf" if path.endswith(".gguf") else fmt)
    tok.save_pretrained(out_dir)
    cfg = load_hf_config(path, "gguf" if path.endswith(".gguf") else fmt)
    cfg.save_pretrained(out_dir)
    return sorted(os.listdir(out_dir))
