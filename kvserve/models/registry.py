"""Map HF ``architectures`` names to kvserve model classes."""

from __future__ import annotations

from typing import Any

from torch import nn

from kvserve.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.gpt_oss import GptOssForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.mixtral import MixtralForCausalLM
from kvserve.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    """Names of the HF architectures kvserve can run."""
    return list(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for ``hf_config.architectures``.

    Raises ValueError (naming the supported list) when none of them is supported.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:  # GGUF-derived configs have no architectures; go by model_type
        archs = [_BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None), "")]
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architectures {archs}; supported: {', '.join(_MODELS)}"
    )


def validate_model_config(hf_config: Any, max_model_len: int) -> None:
    """Build the model for ``hf_config`` on the meta device (no memory) so that every config
    error the model raises (unsupported architecture, rope type, window) is a ValueError at
    start-up, before weights load or worker processes start."""
    import torch

    cls = get_model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, torch.float32, max_model_len=max_model_len)
    from kvserve.models.moe_stats import describe_parameters

    line = describe_parameters(model)  # MoE models: total and active parameters per token
    if line:
        import logging

        logging.getLogger("kvserve").info(line)
