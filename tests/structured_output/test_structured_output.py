"""Structured outputs offline: the bitmask on logits, grammar matchers in the scheduler, and
constrained generation on the real default model (every output must validate)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output import apply_grammar_bitmask, bitmask_width

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "word": {"type": "string", "maxLength": 10}},
          "required": ["id", "ok", "word"]}


def test_apply_bitmask_matches_xgrammar():
    V = 70
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    bm = np.zeros((2, bitmask_width(V)), dtype=np.int32)
    allowed = [[0, 5, 31, 32, 69], [33, 40]]
    for r, toks in enumerate(allowed):
        for t in toks:
            bm[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    ref = logits.clone()
    full = np.full((3, bm.shape[1]), -1, dtype=np.int32)  # xgrammar: same index for logits and mask
    full[2], full[0] = bm[0], bm[1]
    xgr.apply_token_bitmask_inplace(ref, torch.from_numpy(full), indices=[2, 0])
    out = logits.clone()
    apply_grammar_bitmask(out, bm, [2, 0])
    assert torch.equal(out, ref)
    assert torch.equal(out[1], logits[1])  # rows not listed are untouched
    assert torch.isfinite(out[2]).sum() == 5 and torch.isfinite(out[0]).sum() == 2


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={})
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    sp = SamplingParams(structured_outputs={"regex": "a+"})
    assert sp.structured_outputs.regex == "a+"
    from kvserve.engine import ipc

    again = ipc.params_from_dict(ipc.params_to_dict(SamplingParams(structured_outputs={"json": SCHEMA})))
    assert again.structured_outputs.key() == StructuredOutputsParams(json=json.dumps(SCHEMA)).key()


def test_invalid_constraints_raise_value_error(llm):
    for so in ({"json": {"type": "nope"}}, {"regex": "(ab"}, {"grammar": "root ::= undefined_rule"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=so))
    # The engine is still fine afterwards.
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


def test_json_schema_batch_with_plain_requests(llm):
    """Constrained and plain requests in one batch: constrained outputs validate for every
    seed; plain greedy outputs equal the same requests run alone."""
    chat = [{"role": "user", "content": "Give me a JSON record."}]
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.chat(chat, plain)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs={"json": SCHEMA})
              for s in range(6)] + [plain]
    outs = llm.chat([chat] * len(params), params)
    for o in outs[:-1]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert outs[-1].outputs[0].token_ids == alone


def test_regex_choice_grammar(llm):
    outs = llm.generate(["Date:"] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=16,
                                                       structured_outputs={"regex": r"20\d\d-[01]\d-[0-3]\d"})
                                        for s in range(3)])
    for o in outs:
        assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", o.outputs[0].text), o.outputs[0].text
    o = llm.generate(["Answer:"], SamplingParams(temperature=1.0, seed=0, max_tokens=8,
                                                 structured_outputs={"choice": ["alpha", "beta gamma"]}))
    assert o[0].outputs[0].text in ("alpha", "beta gamma")
    o = llm.generate(["Count:"], SamplingParams(temperature=0, max_tokens=12,
                                                structured_outputs={"grammar": 'root ::= ("a" | "b")+ "."'}))
    assert re.fullmatch(r"[ab]+\.", o[0].outputs[0].text)


def test_plain_requests_carry_no_bitmask(llm):
    """Requests without a constraint pay nothing: no bitmask in their steps."""
    core = llm.llm_engine.engine_core
    seen = []
    orig = core.scheduler.schedule

    def spy():
        out = orig()
        seen.append((out.grammar_bitmask, dict(out.structured_output_request_ids)))
        return out

    core.scheduler.schedule = spy
    try:
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3))
        assert seen and all(bm is None and not ids for bm, ids in seen)
        seen.clear()
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, structured_outputs={"regex": "[0-9]+"}))
        rows = [ids for bm, ids in seen if bm is not None]
        assert rows and all(len(ids) == 1 for ids in rows)
    finally:
        core.scheduler.schedule = orig
