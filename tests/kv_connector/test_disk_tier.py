"""Disk tier (``--kv-disk-path``): persistence across engines, bad files, faults, sharing."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys

import pytest

from kvserve import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [random.Random(3).randrange(3, 256) for _ in range(200)]  # 12 full blocks of 16 (+8)


def _llm(path, disk, **kw):
    args = dict(model=path, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=24, max_model_len=320,
                dtype="float32",  # the same numerics on a GPU as on the CPU (bf16 there flips near-ties)
                max_num_seqs=16, disable_log_stats=True, kv_offloading_size=0.01, kv_disk_path=disk)
    args.update(kw)
    return LLM(**args)


def _run(llm, prompt=PROMPT):
    out = llm.generate([prompt], SP, use_tqdm=False)[0]
    llm.shutdown()  # writes every queued block file
    return list(out.outputs[0].token_ids), out.num_cached_tokens, llm.llm_engine.engine_core.kv_connector.get_stats()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, dtype="float32", block_size=16,
              num_gpu_blocks_override=24, max_model_len=320, max_num_seqs=16, disable_log_stats=True,
              enable_prefix_caching=False)
    return list(llm.generate([PROMPT], SP, use_tqdm=False)[0].outputs[0].token_ids)


def _files(d):
    return sorted(os.path.join(p, f) for p, _, fs in os.walk(d) for f in fs if f.endswith(".kv"))


def test_persists_across_engines(tiny_llama_dir, tmp_path, reference):
    toks, cached, stats = _run(_llm(tiny_llama_dir, str(tmp_path)))
    assert toks == reference and cached == 0 and stats["disk_blocks_stored"] == 12
    assert len(_files(tmp_path)) == 12
    toks, cached, stats = _run(_llm(tiny_llama_dir, str(tmp_path)))  # a "restart": a new engine
    assert toks == reference
    assert cached == 192 and stats["disk_hit_tokens"] == 192 and stats["disk_blocks_loaded"] == 12
    # Another KV format (block size) never reads these files: its keys differ.
    toks, cached, _ = _run(_llm(tiny_llama_dir, str(tmp_path), block_size=32, num_gpu_blocks_override=12))
    assert toks == reference and cached == 0


@pytest.mark.parametrize("kv_dtype", ["int4", "fp8_e4m3"])
def test_quantized_blocks_persist_with_their_scales(tiny_llama_dir, tmp_path, kv_dtype):
    """Quantized KV pages (codes, then scales) written by one engine and loaded by the next
    give the same greedy tokens as that format computed from scratch."""
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, dtype="float32", block_size=16,
              num_gpu_blocks_override=24, max_model_len=320, max_num_seqs=16, disable_log_stats=True,
              enable_prefix_caching=False, kv_cache_dtype=kv_dtype)
    ref = list(llm.generate([PROMPT], SP, use_tqdm=False)[0].outputs[0].token_ids)
    llm.shutdown()
    toks, cached, stats = _run(_llm(tiny_llama_dir, str(tmp_path), kv_cache_dtype=kv_dtype))
    assert toks == ref and cached == 0 and stats["disk_blocks_stored"] == 12
    toks, cached, stats = _run(_llm(tiny_llama_dir, str(tmp_path), kv_cache_dtype=kv_dtype))
    assert toks == ref and cached == 192 and stats["disk_blocks_loaded"] == 12


def test_bad_files_rejected_and_recomputed(tiny_llama_dir, tmp_path, reference):
    _run(_llm(tiny_llama_dir, str(tmp_path)))
    llm = _llm(tiny_llama_dir, str(tmp_path))
    conn = llm.llm_engine.engine_core.kv_connector
    keys = conn._keys(_req(PROMPT), 12)
    paths = [conn.disk.path(k) for k in keys]
    with open(paths[9], "r+b") as f:  # corrupt one payload byte
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(paths[6], "r+b") as f:  # truncate
        f.truncate(os.path.getsize(paths[6]) - 100)
    data = open(paths[3], "rb").read()  # a foreign format: same name, another model's header
    n = int.from_bytes(data[8:12], "little")
    hdr = json.loads(data[12:12 + n])
    hdr["fingerprint"] = "another-model"
    blob = json.dumps(hdr, sort_keys=True).encode()
    with open(paths[3], "wb") as f:
        f.write(data[:8] + len(blob).to_bytes(4, "little") + blob + data[12 + n:])
    toks, cached, stats = _run(llm)
    assert toks == reference
    assert cached == 3 * 16  # blocks 0-2 only: the walk stops at the first bad file
    assert stats["disk_blocks_rejected"] == 1
    # Each restart gets past one more bad file: rejected, deleted, recomputed and written
    # again (the truncated file at block 6, then the corrupted one at block 9), then all hit.
    for hit_blocks, rejected in ((6, 1), (9, 1), (12, 0)):
        toks, cached, stats = _run(_llm(tiny_llama_dir, str(tmp_path)))
        assert toks == reference and cached == hit_blocks * 16 and stats["disk_blocks_rejected"] == rejected


def _req(tokens):
    from kvserve.request import Request

    return Request("probe", tokens, SamplingParams())


def test_full_disk_falls_back_to_recompute(tiny_llama_dir, tmp_path, reference, monkeypatch):
    import kvserve.kv_connector.disk_tier as dt

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dt.os, "replace", full)
    llm = _llm(tiny_llama_dir, str(tmp_path))
    toks, _, _ = _run(llm)
    assert toks == reference and _files(tmp_path) == []
    assert llm.llm_engine.engine_core.model_runner.kv_connector.worker.disk.num_write_errors == 12
    monkeypatch.undo()
    toks, cached, _ = _run(_llm(tiny_llama_dir, str(tmp_path)))
    assert toks == reference and cached == 0


def test_bad_disk_flags(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="not an existing directory"):
        _llm(tiny_llama_dir, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kv-offloading-size"):
        _llm(tiny_llama_dir, str(tmp_path), kv_offloading_size=None)


_SHARED = r"""
import json, sys
from kvserve import LLM, SamplingParams
path, disk, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", block_size=16, num_gpu_blocks_override=24,
          max_model_len=320, max_num_seqs=16, disable_log_stats=True, kv_offloading_size=0.01, kv_disk_path=disk)
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outs = []
for p in prompts:
    outs.append(list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids))
llm.shutdown()
print(json.dumps([outs, llm.llm_engine.engine_core.kv_connector.get_stats()["disk_blocks_rejected"]]))
"""


def test_two_engines_share_a_directory(tiny_llama_dir, tmp_path):
    """Two engine processes (different hash seeds) on one directory at once: same tokens as
    a tier-less engine, nothing rejected (atomic writes, no torn reads); afterwards each
    one's blocks are hits for a third engine."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 256) for _ in range(100)] for _ in range(4)]
    prompts += [p + [5, 6, 7] for p in prompts]
    procs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-c", _SHARED, tiny_llama_dir, str(tmp_path), json.dumps(prompts)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    ref_llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, dtype="float32", block_size=16,
                  num_gpu_blocks_override=24, max_model_len=320, max_num_seqs=16, disable_log_stats=True,
                  enable_prefix_caching=False)
    ref = [list(o.outputs[0].token_ids) for o in ref_llm.generate(prompts, SP, use_tqdm=False)]
    for outs, rejected in results:
        assert outs == ref and rejected == 0
    llm = _llm(tiny_llama_dir, str(tmp_path))
    outs = llm.generate(prompts[:4], SP, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [96] * 4


def test_root_key_names_the_page_layout():
    """Files written in the per-row quantized layout (key version v1), with unrotated int4 /
    int2 content (v2), or with slot-major scales (v3), are never read as pages of the current
    layout (v4: codes then head-major scales, int4 / int2 in the Hadamard-rotated basis): the
    version is part of every block's key."""
    import hashlib

    from kvserve.kv_connector.block_hash import KEY_VERSION, root_key

    assert KEY_VERSION == b"kvserve-kv-v4"
    old = [hashlib.blake2b(b"kvserve-kv-v%d\0fp\0int4\0" % i + b"16\0\0", digest_size=16).digest() for i in (1, 2, 3)]
    v4 = hashlib.blake2b(KEY_VERSION + b"\0fp\0int4\0" + b"16\0\0", digest_size=16).digest()
    assert root_key("fp", "int4", 16, None) == v4 and v4 not in old
