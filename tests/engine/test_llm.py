"""Offline API behaviour on the real model: stop strings, seeds, logprobs, bad input."""

from __future__ import annotations


import pytest
import torch

from kvserve import LLM, SamplingParams


PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def test_stop_string_cuts_exactly(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert len(text) > 20
    # A stop string that starts mid-output and may straddle token boundaries.
    k = len(text) // 2
    stop = text[k : k + 5]
    first = text.find(stop)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "@@never@@"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 40


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    toks = base.outputs[0].token_ids
    stop_tok = toks[5]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[: toks.index(stop_tok) + 1]
    assert out.stop_reason == stop_tok and out.finish_reason == "stop"


def test_seeded_sampling_reproduces_and_is_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5
    outs = llm.generate([PROMPT] + ["Hello"] * 5, [sp] + others, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == a
    b = llm.generate(PROMPT, sp.clone(seed=4321), use_tqdm=False)[0].outputs[0].token_ids
    assert a != b


def test_logprobs_equal_log_softmax_of_reference_logits(llm, hf_smollm2):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    full = ids + out.token_ids
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([full])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for step, lp in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + step]
        top = torch.topk(row, 5).indices.tolist()
        assert set(top) <= set(lp)
        for t, (val, rank) in lp.items():
            assert abs(val - row[t].item()) < 1e-3
        assert lp[out.token_ids[step]][1] == 1  # greedy: rank 1
    assert out.cumulative_logprob == pytest.approx(sum(lp[t][0] for lp, t in zip(out.logprobs, out.token_ids)))


def test_bad_input_is_rejected_and_others_finish(llm):
    eng = llm.llm_engine
    good = [eng.add_request(None, "Hello, my name is", SamplingParams(temperature=0, max_tokens=5)) for _ in range(2)]
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(None, "", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(None, [1] * (eng.max_model_len + 1), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request(None, [1, 2, 10**9], SamplingParams())
    for bad in (dict(max_tokens=0), dict(max_tokens=-3), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1),
                dict(n=0), dict(min_p=2.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    # A bad prompt in a list leaves nothing of that call in the engine.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], use_tqdm=False)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert set(done) == set(good)
    assert all(len(done[g].outputs[0].token_ids) == 5 or done[g].outputs[0].finish_reason == "stop" for g in good)
    assert eng.engine_core.kv_cache_manager.usage == 0.0


def test_unknown_model_and_truncated_gguf(tmp_path, smollm2_path):
    with pytest.raises(FileNotFoundError):
        LLM(model=str(tmp_path / "no-such-model"))
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(2_000_000))
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=str(cut))
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(no_such_flag=1)
