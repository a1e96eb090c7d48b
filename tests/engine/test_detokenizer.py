"""Incremental detokenization (kvserve/engine/detokenizer.py): the text equals the full
``tokenizer.decode(ids, skip_special_tokens=...)`` at every step, one token or several at a
time, for the default model's byte-level BPE tokenizer and for SentencePiece-style tokenizers
(byte fallback, Metaspace, leading-space Strip), with special and added tokens, multi-byte
characters split across tokens and invalid byte runs; the fallbacks (no fast backend, decoders
that are not token-local, clean-up of tokenization spaces); and the ``OutputProcessor`` /
engine outputs (texts, stop strings, streamed deltas, ``n > 1``, preemption, abort) equal those
of the full decode step by step."""

from __future__ import annotations

import random

import pytest

from kvserve.engine.detokenizer import DetokenizerSpec

TEXTS = ["東京 🚀 naïve café — Привет мир 👨‍👩‍👧 ", "def f(x):\n    return x**2\n",
         "  spaces\t\ttabs  ", "日本語のテキスト、絵文字😀🎉", "Hello world. The end"]
WORDS = ["▁the", "▁hello", "▁world", "東京", "▁", "▁▁", "e", "a", ".", "▁naïve", "😀", "\n", "ing", "Привет",
         "x", "▁end", "Q", "?"]


def _sentencepiece_like(decoder: str):
    """A BPE tokenizer with byte fallback (``<0xNN>``), specials and an added token; no merges
    (only decoded here). ``decoder``: ``gemma`` (Replace, ByteFallback, Fuse), ``llama``
    (the same and a leading-space Strip), ``metaspace``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in WORDS:
        vocab[w] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    seq = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if decoder == "llama":
        seq.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Metaspace("▁", "always") if decoder == "metaspace" else decoders.Sequence(seq)
    tk.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    tk.add_tokens(["<tool>"])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)


def _byte_ids(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])


def _random_sequences(tok, count: int, seed: int) -> list[list[int]]:
    """Random ids with specials / added tokens, encoded multi-byte text, and byte-token runs
    (whole characters, and cut or invalid ones)."""
    rng = random.Random(seed)
    vocab_size = len(tok)
    specials = sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder))
    has_bytes = tok.convert_tokens_to_ids("<0xE6>") not in (None, tok.unk_token_id)
    pieces = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    if has_bytes:
        pieces += [_byte_ids(tok, t) for t in ("東", "😀", "é", "naïve 東京")]
        pieces += [_byte_ids(tok, "東")[:2], [tok.convert_tokens_to_ids("<0x9D>")]]  # cut / invalid runs
    out = []
    for _ in range(count):
        n, ids = rng.randint(1, 90), []
        while len(ids) < n:
            r = rng.random()
            if r < 0.12:
                ids.append(rng.choice(specials))
            elif r < 0.5:
                ids += rng.choice(pieces)
            else:
                ids.append(rng.randrange(vocab_size))
        out.append(ids[:n])
    return out


def _check_streams(tok, seqs, expect_mode: str, seed: int = 0) -> None:
    """Feed each sequence one token at a time and in random chunks; the text must equal the
    full decode after every update."""
    spec = DetokenizerSpec(tok)
    assert spec.mode == expect_mode, spec.reason
    rng = random.Random(seed)
    for seq in seqs:
        for skip in (False, True):
            for chunked in (False, True):
                ids: list[int] = []
                d = spec.new(ids, skip)
                i = 0
                while i < len(seq):
                    k = rng.choice((1, 2, 3, 7)) if chunked else 1
                    ids += seq[i:i + k]
                    i += k
                    assert d.update() == tok.decode(ids, skip_special_tokens=skip), (skip, ids)
                assert d.update() == d.text  # no new tokens: nothing decoded, same text


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from kvserve.model_loader import get_tokenizer

    return get_tokenizer(smollm2_path, "gguf")


def test_default_model_tokenizer_matches_full_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    seqs = _random_sequences(tok, 30, seed=1)
    seqs.append(tok.encode("".join(TEXTS) * 2, add_special_tokens=False))  # emoji / CJK split across tokens
    _check_streams(tok, seqs, "window")


@pytest.mark.parametrize("decoder", ["gemma", "llama", "metaspace"])
def test_sentencepiece_style_tokenizers_match_full_decode(decoder):
    tok = _sentencepiece_like(decoder)
    seqs = _random_sequences(tok, 40, seed=2)
    seqs.append(_byte_ids(tok, "東京") + [tok.convert_tokens_to_ids("▁world")] + _byte_ids(tok, "😀")[:3]
                + [tok.convert_tokens_to_ids("<0x9D>")] + [tok.convert_tokens_to_ids("e")])  # a run turns invalid
    sp = tok.convert_tokens_to_ids(["<start_of_turn>", "▁hello", "<end_of_turn>", "▁world"])
    seqs.append(sp * 5)  # with skip_special_tokens the window's first token is stripped apart
    _check_streams(tok, seqs, "window")


def test_window_without_a_fast_backend_matches_full_decode():
    fast = _sentencepiece_like("llama")

    class NoBackend:  # what the window path reads from a tokenizer without ``backend_tokenizer``
        clean_up_tokenization_spaces = False
        unk_token_id = fast.unk_token_id
        added_tokens_decoder = fast.added_tokens_decoder
        convert_tokens_to_ids = staticmethod(fast.convert_tokens_to_ids)
        decode = staticmethod(fast.decode)

    spec = DetokenizerSpec(NoBackend())
    assert spec.mode == "window-slow" and _byte_ids(fast, "é")[0] in spec.unsafe_cut
    _check_streams(fast, _random_sequences(fast, 10, seed=3), "window")
    ids: list[int] = []
    d = spec.new(ids, True)
    for t in _random_sequences(fast, 1, seed=4)[0]:
        ids.append(t)
        assert d.update() == fast.decode(ids, skip_special_tokens=True)


def test_not_token_local_tokenizers_use_the_full_decode():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "##ing": 2, ",": 3, "world": 4, "</w>": 5, "a</w>": 6}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.decoder = decoders.BPEDecoder("</w>")  # the last token's suffix is dropped, the others' become spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", clean_up_tokenization_spaces=False)
    seqs = [[1, 6, 4, 6, 3, 6], [6] * 8, [1, 2, 3, 4, 6]]
    _check_streams(tok, seqs, "full")
    tk2 = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk2.decoder = decoders.WordPiece()
    tok2 = PreTrainedTokenizerFast(tokenizer_object=tk2, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    spec = DetokenizerSpec(tok2)
    assert spec.mode == "full" and "clean_up" in spec.reason
    _check_streams(tok2, seqs, "full")
    assert DetokenizerSpec(None).new([1, 2], False).update() == ""


# ---- the output processor and the engine -----------------------------------------------------------------------

def _reference(op):
    """Make ``op`` decode every completion's whole output (the behaviour before incremental
    detokenization)."""
    def full(seq):
        if op.tokenizer is None:
            return ""
        return op.tokenizer.decode(seq.request.output_token_ids,
                                   skip_special_tokens=seq.request.sampling_params.skip_special_tokens)

    op._decode = full
    return op


def _drive(op, tok, detokenize_all: bool, seed: int):
    """Requests with stop strings, n = 2 and both skip settings fed random tokens (one or more
    per step, through ``apply_outputs`` and ``apply_plain``); one is aborted. Returns what a
    caller sees each step."""
    from kvserve import SamplingParams
    from kvserve.engine.core_types import EngineCoreOutput
    from kvserve.engine.input_processor import make_child_requests
    from kvserve.engine.output_processor import ParentState

    rng = random.Random(seed)
    seqs = _random_sequences(tok, 8, seed)
    words = [tok.decode(s[:6], skip_special_tokens=True) for s in seqs]
    params = [
        SamplingParams(max_tokens=60, stop=[w[2:5] for w in words[:2] if len(w) >= 5] or ["e"]),
        SamplingParams(max_tokens=60, n=2, skip_special_tokens=False),
        SamplingParams(max_tokens=60, stop=["e", " the"], skip_special_tokens=False),
        SamplingParams(max_tokens=60, n=3, stop=["Q."]),
        SamplingParams(max_tokens=60),
    ]
    children = {}
    for i, sp in enumerate(params):
        rid = f"r{i}"
        kids = make_child_requests(rid, [5, 6], sp, 0.0, 0, None)
        op.add(ParentState(rid, None, [5, 6]), kids)
        for k, c in enumerate(kids):
            children[c.request_id] = seqs[(i + k) % len(seqs)] * 2
    pos = {cid: 0 for cid in children}
    seen = []
    for step in range(70):
        outs, plain_ids, plain_toks = [], [], []
        for cid, toks in children.items():
            if pos[cid] >= len(toks):
                continue
            k = rng.choice((1, 1, 2, 3))
            new = toks[pos[cid]:pos[cid] + k]
            pos[cid] += len(new)
            fin = "length" if pos[cid] >= len(toks) else None
            if len(new) == 1 and fin is None and rng.random() < 0.5:
                plain_ids.append(cid)
                plain_toks.append(new[0])
            else:
                outs.append(EngineCoreOutput(cid, new, finish_reason=fin, num_preemptions=step // 20))
        updated = [st for st, _ in op.apply_outputs(outs)]
        updated += op.apply_plain(plain_ids, plain_toks, stop_only=not detokenize_all)
        parents, stopped = op.process(updated, detokenize_all=detokenize_all)
        for cid in stopped:
            pos[cid] = len(children[cid])  # the core finishes it: no more tokens
        view = [sorted(stopped)]
        for p in parents:
            o = op.make_output(p)
            view.append((p.request_id, o.finished, [(c.index, c.text, c.finish_reason, c.stop_reason)
                                                     for c in o.outputs],
                         [op.take_delta(p, s.index) for s in p.seqs]))
            if p.finished:
                op.remove(p)
        if step == 9 and "r4" in op.parents:
            op.abort("r4")
            view.append(op.make_output(op.parents["r4"]).outputs[0].text)
            op.remove(op.parents["r4"])
        seen.append(view)
    return seen


@pytest.mark.parametrize("detokenize_all", [True, False])
def test_output_processor_equals_the_full_decode(detokenize_all):
    from kvserve.engine.output_processor import OutputProcessor

    tok = _sentencepiece_like("gemma")
    for seed in range(3):
        got = _drive(OutputProcessor(tok), tok, detokenize_all, seed)
        ref = _drive(_reference(OutputProcessor(tok)), tok, detokenize_all, seed)
        assert got == ref
        flat = repr(got)
        assert "'stop'" in flat and "'length'" in flat and "\ufffd" in flat


def test_engine_streamed_text_equals_the_full_decode(tmp_path):
    """A tiny random Llama over the byte-fallback tokenizer: streamed steps and ``take_delta``
    deltas with preemption, stop strings, ``n = 2`` and an abort equal the full decode's."""
    import torch
    from transformers import LlamaConfig

    from kvserve import LLM, SamplingParams
    from tests.utils import save_random_causal_lm

    tok = _sentencepiece_like("gemma")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"], bos_token_id=2, eos_token_id=1)
    save_random_causal_lm(tmp_path, cfg, 0.1)
    tok.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="64KiB", max_model_len=128,
              max_num_batched_tokens=48, enable_prefix_caching=False, disable_log_stats=True)
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, len(tok), (int(k),), generator=g).tolist()
               for k in torch.randint(2, 20, (6,), generator=g)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True,
                             stop=["e"] if i % 3 == 0 else None, n=2 if i % 3 == 1 else 1,
                             skip_special_tokens=i % 2 == 0) for i in range(6)]
    runs = []
    for reference in (False, True):
        if reference:
            _reference(eng.output_processor)
        ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        steps = []
        while eng.has_unfinished_requests():
            outs = eng.step(stream=True)
            view = [(ids.index(o.request_id), [(c.index, c.text, c.finish_reason, c.stop_reason) for c in o.outputs])
                    for o in outs]
            for rid in ids:
                if rid in eng.output_processor.parents:
                    p = eng.output_processor.parents[rid]
                    view.append([eng.output_processor.take_delta(p, s.index) for s in p.seqs])
            steps.append(view)
            if len(steps) == 5:
                eng.abort_request(ids[-1])
        runs.append(steps)
    del eng.output_processor._decode
    assert runs[0] == runs[1]
    assert eng.stats.num_preemptions > 0, "the batch should preempt (a small KV cache)"
    assert "\ufffd" in repr(runs[0]) and "'stop'" in repr(runs[0])
    eng.shutdown()
