"""GGUF tokenizer disk cache and ``kvserve export``: the cached / exported tokenizer encodes,
decodes and templates exactly as the one built from the GGUF."""

from __future__ import annotations

import os

import pytest

SAMPLES = ["Hello world", "  spaces\tand\ttabs\n", "naïve café — 東京 🚀", "def f(x):\n    return x**2"]


def test_cache_and_export_match_gguf(tmp_path, monkeypatch, smollm2_path):
    from transformers import AutoTokenizer

    from kvserve.entrypoints.cli import main
    from kvserve.model_loader import get_tokenizer
    from kvserve.model_loader.tokenizer_cache import gguf_fingerprint

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    d, name = os.path.split(smollm2_path)
    ref = AutoTokenizer.from_pretrained(d, gguf_file=name)
    built = get_tokenizer(smollm2_path, "gguf")  # builds and stores
    entry = tmp_path / "cache" / "tokenizers" / gguf_fingerprint(smollm2_path)
    assert (entry / "tokenizer.json").is_file()
    cached = get_tokenizer(smollm2_path, "gguf")  # from the cache
    assert main(["export", str(tmp_path / "out")]) == 0
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (tmp_path / "out" / "config.json").is_file()
    conv = [{"role": "user", "content": "Hi there"}]
    for tok in (built, cached, exported):
        for s in SAMPLES:
            assert tok.encode(s) == ref.encode(s)
            assert tok.decode(ref.encode(s)) == ref.decode(ref.encode(s))
        assert tok.eos_token_id == ref.eos_token_id
        assert tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False) == \
            ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    # Refuses to write into an unrelated non-empty directory.
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert main(["export", str(other)]) == 2


def test_cpu_threads_resolution(monkeypatch):
    from kvserve.config import resolve_cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_cpu_threads(0) == 3 and resolve_cpu_threads(1) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert resolve_cpu_threads(0) == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="cpu_threads"):
        resolve_cpu_threads(-1)
