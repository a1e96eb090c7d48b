"""HF-format checkpoints: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files of ``model_dir``: those named by ``model.safetensors.index.json``
    if present, else every ``*.safetensors``. Raises FileNotFoundError if there are none."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        absent = [p for p in files if not os.path.isfile(p)]
        if absent:
            raise FileNotFoundError(f"shards listed in {index} are missing: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, CPU tensor)`` for every tensor of the checkpoint, one shard at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
