"""The EAGLE trainer's pieces that need no real model: the synthetic chat prompts (held-out
benchmark questions kept out), prompt files, and training / held-out evaluation of a head on
a tiny target (the cross-entropy over a reduced draft vocabulary included)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kvserve.spec_decode.chat_topics import HELD_OUT, _BANNED, all_chat_prompts, synthetic_chat_prompts
from kvserve.spec_decode.train_eagle import chat_prompts, evaluate, load_prompts, save_head, train


def test_synthetic_prompts_keep_benchmark_questions_out():
    pool = all_chat_prompts()
    assert len(pool) > 1000 and len(set(pool)) == len(pool)
    assert not set(pool) & set(HELD_OUT)
    assert not [p for p in pool if any(b in p.lower() for b in _BANNED)]
    a, b = synthetic_chat_prompts(300, seed=1), synthetic_chat_prompts(300, seed=1)
    assert a == b and len(set(a)) == 300 and a != synthetic_chat_prompts(300, seed=2)
    with pytest.raises(ValueError):
        synthetic_chat_prompts(len(pool) + 1)


def test_benchmark_questions_are_the_held_out_ones():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "spec_decode_cpu.py")
    spec = importlib.util.spec_from_file_location("spec_decode_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert tuple(mod.CHAT) == HELD_OUT


def test_load_prompts(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(json.dumps("line one\nline two") + "\nplain prompt\n\n")
    assert load_prompts(str(f), 2) == ["line one\nline two", "plain prompt"]
    with pytest.raises(ValueError):
        load_prompts(str(f), 3)
    with pytest.raises(ValueError):
        load_prompts("no-such-source", 1)
    assert load_prompts("chat", 5, seed=3) == synthetic_chat_prompts(5, 3)
    assert load_prompts("corpus", 4) == chat_prompts(4, 0)


def _tiny():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    g = torch.Generator().manual_seed(0)
    emb = nn.Embedding(96, 32)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(96, 32, generator=g))
    target = SimpleNamespace(model=SimpleNamespace(embed_tokens=emb), lm_head=None)
    samples = []
    for _ in range(4):  # (token ids, answer start, target features [T, H])
        ids = torch.randint(0, 96, (24,), generator=g).tolist()
        samples.append((ids, 6, torch.randn(24, 32, generator=g)))
    return cfg, target, samples


@pytest.mark.parametrize("vocab", [None, 48])
def test_train_fits_its_samples_and_evaluates_held_out(tmp_path, vocab):
    cfg, target, samples = _tiny()
    logs = []
    head0 = train(samples, target, cfg, epochs=1, lr=1e-3, seed=0, log=logs.append, vocab=vocab)
    head = train(samples, target, cfg, epochs=60, lr=3e-3, seed=0, log=logs.append, vocab=vocab,
                 eval_samples=samples[:1])
    before, after = evaluate(head0, samples, target, vocab), evaluate(head, samples, target, vocab)
    assert 0.0 <= before < 0.5 < after <= 1.0  # it memorizes its training answers
    assert "held-out" in logs[-1] and "held-out" not in logs[0]
    assert evaluate(head, [], target) == 0.0
    save_head(head, cfg, str(tmp_path / "h"), draft_vocab_size=vocab)
    conf = json.loads((tmp_path / "h" / "config.json").read_text())
    assert conf["num_hidden_layers"] == 1 and conf.get("draft_vocab_size") == vocab


def test_train_continues_a_saved_head(tmp_path):
    cfg, target, samples = _tiny()
    head = train(samples, target, cfg, epochs=3, lr=3e-3, seed=0, log=lambda m: None)
    save_head(head, cfg, str(tmp_path / "h"))
    again = train(samples, target, cfg, epochs=1, lr=0.0, seed=1, log=lambda m: None, init=str(tmp_path / "h"))
    for (n, a), b in zip(head.published().items(), again.published().values()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=n)  # saved in bf16
    with pytest.raises(ValueError):
        from transformers import LlamaConfig

        wide = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
        train(samples, target, wide, epochs=1, lr=0.0, seed=0, log=lambda m: None, init=str(tmp_path / "h"))
