"""Plain decode rows (``EngineCoreOutputs.plain_req_ids``: a running request's one new token
and nothing else new, folded by the frontend as a token append) against the general path (an
``EngineCoreOutput`` per request): the same token ids, text, finish and stop reasons, logprobs,
metrics and engine stats on mixed batches (stop strings, logprobs, prompt logprobs, penalties,
min_tokens, n > 1, preemption, streaming with an abort, speculative decoding, one step at a
time), and the rows cross the engine-core process boundary (``StepOutputs``)."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.utils import save_random_causal_lm

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer (one printable character per id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    d = tmp_path_factory.mktemp("plain-rows")
    save_random_causal_lm(d, cfg, 0.1)
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ."
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(chars[:VOCAB - 3])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(d)
    with open(d / "tokenizer_config.json") as f:
        assert json.load(f)["eos_token"] == "</s>"
    return str(d)


def _general_path(llm):
    """Route every request through the general path (no plain rows), on this engine only."""
    sched = llm.llm_engine.engine_core.scheduler
    orig = sched.update_from_output
    sched.update_from_output = lambda sched_out, runner_out, plain=None: orig(sched_out, runner_out)
    return lambda: delattr(sched, "update_from_output")


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(2, 40, (n,), generator=g)]


def _params(n):
    """Greedy, seeded random, stop strings, logprobs, prompt logprobs, penalties, min_tokens, n=2."""
    ps = []
    for i in range(n):
        kind = i % 7
        if kind == 0:
            ps.append(SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True))
        elif kind == 1:
            ps.append(SamplingParams(temperature=0.9, seed=i, max_tokens=16, logprobs=2, ignore_eos=True))
        elif kind == 2:
            ps.append(SamplingParams(temperature=1.0, seed=i, max_tokens=30, stop=["a", "Q"]))
        elif kind == 3:
            ps.append(SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, ignore_eos=True))
        elif kind == 4:
            ps.append(SamplingParams(temperature=1.0, seed=i, max_tokens=25, min_tokens=6, stop_token_ids=[5, 6],
                                     repetition_penalty=1.2))
        elif kind == 5:
            ps.append(SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=14, ignore_eos=True))
        else:
            ps.append(SamplingParams(temperature=1.0, seed=i, max_tokens=40))  # EOS or length
    return ps


def _view(outs, index=None):
    """What a caller sees of outputs, by position in the batch (``index``: request id -> position;
    None: the list's order), timestamps only as present / absent."""
    res = {}
    for j, o in enumerate(outs):
        m = o.metrics
        res[j if index is None else index[o.request_id]] = (
            o.finished, o.num_cached_tokens, o.prompt_logprobs,
            [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in o.outputs],
            (m.first_scheduled_time is not None, m.first_token_time is not None, m.finished_time is not None,
             m.num_preemptions, m.num_draft_tokens, m.num_accepted_tokens) if m is not None else None)
    return res


def _stats(llm):
    s = llm.llm_engine.stats
    return (s.num_prompt_tokens, s.num_generation_tokens, s.num_preemptions, s.num_draft_tokens,
            s.num_accepted_tokens)


def _generate_both(llm, prompts, params):
    """The same batch through the plain rows, then through the general path; stats per run."""
    got = []
    for general in (False, True):
        undo = _general_path(llm) if general else None
        before = _stats(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = _stats(llm)
        if undo:
            undo()
        got.append((_view(outs), tuple(b - a for a, b in zip(before, after))))
    return got


def _engine(path, **kw):
    args = dict(dtype="float32", kv_cache_memory="96KiB", max_model_len=160, max_num_batched_tokens=48,
                enable_prefix_caching=False, disable_log_stats=True)
    args.update(kw)
    return LLM(model=path, **args)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_plain_rows_equal_the_general_path_on_a_mixed_batch(model_dir, async_scheduling):
    llm = _engine(model_dir, async_scheduling=async_scheduling)
    plain_seen = []
    core = llm.llm_engine.engine_core
    step = core.step

    def counted():
        res = step()
        plain_seen.append(len(res.plain_req_ids))
        return res

    core.step = counted
    (plain, plain_stats), (general, general_stats) = _generate_both(llm, _prompts(14), _params(14))
    assert plain == general
    assert plain_stats == general_stats
    assert plain_stats[2] > 0, "the batch should preempt (a small KV cache)"
    assert sum(plain_seen) > 0, "plain rows should carry most decode tokens"
    reasons = {c[3] for v in plain.values() for c in v[3]}
    assert {"stop", "length"} <= reasons
    assert any(c[4] in ("a", "Q") for v in plain.values() for c in v[3])  # a stop string ended one
    assert llm.llm_engine.engine_core.scheduler.num_output_readers == 0
    llm.llm_engine.shutdown()


def test_plain_rows_equal_the_general_path_with_speculation(model_dir):
    llm = _engine(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prompts = [p * 3 for p in _prompts(6, seed=1)]  # repeats: the n-gram proposer finds drafts
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3 + _params(3)
    (plain, plain_stats), (general, general_stats) = _generate_both(llm, prompts, params)
    assert plain == general and plain_stats == general_stats
    assert plain_stats[3] > 0, "drafts should be verified"
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("stream", [True, False])
def test_steps_and_an_abort_equal_the_general_path(model_dir, stream):
    llm = _engine(model_dir, kv_cache_memory="1MiB")
    eng = llm.llm_engine
    prompts, params = _prompts(8, seed=2), _params(8)
    runs = []
    for general in (False, True):
        undo = _general_path(llm) if general else None
        ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        steps, deltas = [], {i: [] for i in ids}
        n = 0
        while eng.has_unfinished_requests():
            outs = eng.step(stream=stream)
            steps.append(_view(outs, {rid: j for j, rid in enumerate(ids)}))
            for rid in ids:
                if rid in eng.output_processor.parents:
                    deltas[rid].append(eng.output_processor.take_delta(eng.output_processor.parents[rid]))
            n += 1
            if n == 4:
                eng.abort_request(ids[0])
        if undo:
            undo()
        runs.append((steps, [deltas[i] for i in ids]))
    assert runs[0] == runs[1]
    assert any(v for step in runs[0][0] for v in step.values())
    llm.llm_engine.shutdown()


def test_step_outputs_carry_plain_rows_across_the_process_boundary():
    msgspec = pytest.importorskip("msgspec")
    from kvserve.engine import ipc
    from kvserve.engine.core_types import EngineCoreOutput

    stats = ipc.SchedulerStatsMsg(1, 0, 0.5, 0, 0, 0, 0, 0, 0, 0, [], 0, None, 0, 0)
    msg = ipc.StepOutputs([EngineCoreOutput("a", [4], finish_reason="stop")], stats, 0, 3, 1.0, ["b", "c"], [7, 9])
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(ipc.OutputMessage)
    back = dec.decode(enc.encode(msg))
    assert back.plain_req_ids == ["b", "c"] and back.plain_token_ids == [7, 9]
    assert back.outputs[0].finish_reason == "stop"
    # A message without rows (an idle step, an older sender) reads as none.
    back = dec.decode(enc.encode(ipc.StepOutputs([], stats)))
    assert back.plain_req_ids == [] and back.plain_token_ids == []
