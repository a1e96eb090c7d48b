"""The EAGLE-3 trainer on a tiny random Llama target: the prompt set keeps the held-out chat
out, the TTT mask and unroll shapes, the draft vocabulary, a few steps reduce the loss, and a
head trained here and loaded by the engine drafts what the target says (training and inference
compute the same head), greedy output identical to no speculation."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.eagle3_train_head import Eagle3TrainHead, draft_vocabulary, ttt_loss, ttt_mask


def _cfg():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target, its greedy answers, features, and a head trained to memorize them."""
    from transformers import AutoModelForCausalLM

    from kvserve.spec_decode.eagle import eagle3_layers
    from kvserve.spec_decode.train_eagle3 import extract_features, save_eagle3_head, target_weights, train

    cfg = _cfg()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)  # peaked target distributions: the loss can fall far
    d = tmp_path_factory.mktemp("eagle3_target")
    model.save_pretrained(d)
    common = dict(model=str(d), skip_tokenizer_init=True, dtype="float32", kv_cache_memory="16MiB",
                  disable_log_stats=True, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (6, 9, 12, 7)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(**common)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seqs = [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs]
    runner = llm.llm_engine.engine_core.model_runner
    layers = eagle3_layers(cfg.num_hidden_layers)
    samples = extract_features(runner, seqs, layers, token_budget=40)  # two forwards
    emb, lm, norm = target_weights(runner.model)
    llm.shutdown()
    logs = []
    head, info = train(samples, cfg, emb, lm, norm, 64, steps=2, lr=1e-2, max_steps=60, batch_tokens=256,
                       warmup=5, log=logs.append, eval_samples=samples[:2])
    out = tmp_path_factory.mktemp("eagle3_head")
    save_eagle3_head(head, str(out), "# test head\n", layers)
    return dict(common=common, prompts=prompts, ref=[o.outputs[0].token_ids for o in outs], samples=samples,
                info=info, head_dir=str(out), cfg=cfg, weights=(emb, lm), seqs=seqs)


def test_ttt_mask_and_unroll_shapes():
    m = ttt_mask(3, 3)
    assert m.shape == (3, 9)
    assert m[:, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert m[:, 3:6].tolist() == m[:, 6:].tolist() == torch.eye(3, dtype=torch.bool).tolist()
    cfg = _cfg()
    head = Eagle3TrainHead(cfg, torch.arange(0, 128, 2))
    feats = head.unroll(torch.randn(2, 5, 96), torch.randn(2, 7, 32), steps=3)
    assert len(feats) == 3 and all(f.shape == (2, 5, 32) for f in feats)
    assert head.logits(feats[0]).shape == (2, 5, 64)
    with pytest.raises(ValueError, match="emb"):
        head.unroll(torch.randn(2, 5, 96), torch.randn(2, 6, 32), steps=3)
    # step 0 of chain p sees only positions <= p: a later chain's input does not change it
    aux, emb = torch.randn(1, 5, 96), torch.randn(1, 5, 32)
    f1 = head.unroll(aux, emb, 1)[0]
    aux2 = aux.clone()
    aux2[0, 4] += 1
    assert torch.allclose(head.unroll(aux2, emb, 1)[0][0, :4], f1[0, :4], atol=1e-6)


def test_draft_vocabulary_most_frequent_then_lowest_ids():
    c = torch.tensor([0, 5, 0, 9, 1, 5, 0, 0])
    assert draft_vocabulary(c, 3).tolist() == [1, 3, 5]  # 9, then the tie 5/5 by lower id
    assert draft_vocabulary(c, 6).tolist() == [0, 1, 2, 3, 4, 5]  # unseen: lower ids first
    with pytest.raises(ValueError):
        draft_vocabulary(c, 9)


def test_training_prompts_varied_and_held_out_kept_out():
    from kvserve.spec_decode.chat_topics import _BANNED, HELD_OUT
    from kvserve.spec_decode.train_prompts import training_conversations

    convs = training_conversations(400, seed=1)
    assert len(convs) == 400 and convs == training_conversations(400, seed=1)
    flat = [t for c in convs for t in c]
    assert not set(flat) & set(HELD_OUT) and not [t for t in flat if any(b in t.lower() for b in _BANNED)]
    assert sum(len(c) == 2 for c in convs) >= 40  # multi-turn
    assert any("```python" in t for t in flat) and any("x +" in t or "times" in t for t in flat)
    assert len(set(map(tuple, convs))) > 350
    with pytest.raises(ValueError, match="kinds"):
        training_conversations(10, mix={"poetry": 1.0})


def test_training_reduces_the_loss_and_agrees_on_held_out(trained):
    info = trained["info"]
    assert info["steps"] == 60 and info["last_loss"] < 0.8 * info["first_loss"]
    agree = info["held_out"]["step_agreement"]
    assert len(agree) == 2 and min(agree) > 0.6  # learned its training answers, step 1 (own outputs) too
    s = trained["samples"][0]
    assert s.aux.shape == (len(s.ids), 96) and s.h.shape == (len(s.ids), 32)


def test_features_match_a_one_sequence_prefill(trained):
    """Many sequences per forward give the states of each sequence alone."""
    from kvserve.spec_decode.eagle import eagle3_layers
    from kvserve.spec_decode.train_eagle3 import extract_features

    llm = LLM(**trained["common"])
    runner = llm.llm_engine.engine_core.model_runner
    one = extract_features(runner, trained["seqs"][2:3], eagle3_layers(4))[0]
    llm.shutdown()
    many = trained["samples"][2]
    assert torch.equal(one.ids, many.ids) and torch.equal(one.top, many.top)
    assert torch.allclose(one.aux, many.aux, atol=1e-4) and torch.allclose(one.h, many.h, atol=1e-4)


def test_trained_head_drafts_what_the_target_says_in_the_engine(trained):
    """The engine loads the trained head: on the memorized prompts most drafts are accepted
    (mean acceptance length well above a random head's 1.0), output identical."""
    llm = LLM(**trained["common"], speculative_config={"method": "eagle3", "model": trained["head_dir"],
                                                      "num_speculative_tokens": 3, "dynamic": False})
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(trained["prompts"], sp, use_tqdm=False)]
    st = llm.llm_engine.stats
    llm.shutdown()
    assert outs == trained["ref"]
    assert st.num_drafts > 0 and 1 + st.num_accepted_tokens / st.num_drafts > 2.0


def test_ttt_loss_masks_tokens_outside_the_draft_vocabulary(trained):
    s = trained["samples"][0]
    emb, lm = trained["weights"]
    tok = next(t for t in range(128) if t not in set(s.top.tolist()))  # the target never predicts it
    head = Eagle3TrainHead(trained["cfg"], torch.tensor([tok]))
    t2d = torch.full((128,), -1, dtype=torch.long)
    t2d[tok] = 0
    aux, ids, h, top = s.aux[None], s.ids[None], s.h[None], s.top[None]
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        loss, acc, n = ttt_loss(head, aux, ids, h, top, mask, emb, lm[[tok]], t2d, steps=2)
    assert n == [0, 0] and float(loss) == 0.0


def test_dynamic_policy_on_trained_head_is_lossless(trained):
    """Batched with the goodput policy at a low compute bound (8 tokens per step: k shrinks
    while 4 requests run and grows as they finish): outputs equal no speculation."""
    llm = LLM(**trained["common"], speculative_config={
        "method": "eagle3", "model": trained["head_dir"], "num_speculative_tokens": 3, "dynamic": True,
        "dynamic_max_batched_tokens": 8, "dynamic_draft_cost": 0.1})
    lens = [24, 8, 16, 12]
    outs = llm.generate(trained["prompts"], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                            for n in lens], use_tqdm=False)
    pol = llm.llm_engine.engine_core.scheduler.spec_policy
    ks = [pol.peek(b, measured=False) for b in (1, 4)]  # the rules: step times vary by machine
    st = llm.llm_engine.stats
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [r[:n] for r, n in zip(trained["ref"], lens)]
    assert st.num_drafts > 0 and ks[0] > ks[1] >= 1
