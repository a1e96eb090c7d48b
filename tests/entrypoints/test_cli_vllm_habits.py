"""The command lines a vLLM user types by habit, parsed without starting anything: ``--model``,
no prefix matching, the subcommand's usage with a suggestion for an unknown flag, vLLM's
``bench throughput --dataset-name``, ``launch --replicas K`` alone, and the accepted serve flags."""

from __future__ import annotations

import argparse

import pytest

from kvserve.entrypoints import cli


def _parse(argv):
    return cli.build_parser().parse_args(argv)


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_model_flag_or_positional(capsys):
    assert _parse(["serve", "--model", "/m"]).model == "/m"
    assert _parse(["serve", "/m"]).model == "/m"
    assert _parse(["serve", "/m", "--model", "/m"]).model == "/m"
    assert _parse(["generate", "--prompt", "x", "--model", "/m"]).model == "/m"
    assert _parse(["serve"]).model is None
    err = _error(["serve", "/a", "--model", "/b"], capsys)
    assert "given twice" in err and "'/a'" in err and "'/b'" in err


def test_unknown_flag_gets_the_subcommands_usage_and_a_suggestion(capsys):
    err = _error(["serve", "--max-num-seq", "4"], capsys)  # no prefix matching
    assert err.startswith("usage: kvserve serve") and "unrecognized arguments: --max-num-seq" in err
    assert "did you mean --max-num-seqs" in err
    err = _error(["bench", "serve", "--dataset-nme", "random"], capsys)
    assert err.startswith("usage: kvserve bench serve") and "did you mean --dataset-name" in err


def test_bench_throughput_takes_dataset_name():
    assert _parse(["bench", "throughput", "--dataset-name", "humaneval"]).dataset == "humaneval"
    assert _parse(["bench", "throughput", "--dataset", "random"]).dataset == "random"


def test_launch_replicas_alone():
    from kvserve.router.launch import resolve_worker_counts

    ns = _parse(["launch", "--replicas", "2"])
    assert resolve_worker_counts(ns) is False and (ns.prefill, ns.decode) == (0, 0)
    ns = _parse(["launch"])
    assert resolve_worker_counts(ns) is True and (ns.prefill, ns.decode) == (1, 1)
    assert resolve_worker_counts(_parse(["launch", "--prefill", "0", "--decode", "0", "--replicas", "3"])) is False
    with pytest.raises(ValueError, match="colocated"):
        resolve_worker_counts(_parse(["launch", "--prefill", "1", "--replicas", "2"]))


def test_help_describes_bench_and_serve_takes_vllm_flags(capsys):
    with pytest.raises(SystemExit):
        _parse(["--help"])
    out = capsys.readouterr().out
    assert "Benchmarks (throughput)." not in out and "bench serve" in out
    ns = _parse(["serve", "--trust-remote-code", "--disable-log-requests", "--generation-config", "vllm",
                 "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"])
    assert ns.trust_remote_code and ns.disable_log_requests and ns.generation_config == "vllm"
    assert _parse(["serve"]).generation_config == "auto"
    err = _error(["serve", "--reasoning-parser", "qwen"], capsys)
    assert "deepseek_r1" in err and "openai_gptoss" in err and "qwen3" in err
    err = _error(["serve", "--tool-call-parser", "qwen"], capsys)
    assert "deepseek_v3" in err and "hermes" in err and "openai" in err


def test_bad_generation_config_folder(tmp_path):
    from kvserve.entrypoints.openai.api_server import check_parsers_and_generation_config

    with pytest.raises(ValueError, match="--generation-config"):
        check_parsers_and_generation_config(argparse.Namespace(generation_config=str(tmp_path)))
    with pytest.raises(ValueError, match="choose one of"):
        check_parsers_and_generation_config(argparse.Namespace(reasoning_parser="nope"))


def test_docs_commands_with_model_flag_parse():
    """Every ``kvserve ... --model ...`` command in README.md and docs/ parses as typed."""
    import glob
    import os
    import re
    import shlex

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    commands = []
    for path in [os.path.join(root, "README.md"), *glob.glob(os.path.join(root, "docs", "*.md"))]:
        with open(path) as f:
            text = f.read().replace("\\\n", " ")
        for line in text.splitlines():
            m = re.search(r"\bkvserve (\w.*)$", line)
            if m and " --model " in line and "`" not in m.group(1):
                commands.append((path, m.group(1).split(" #")[0]))
    assert len(commands) >= 3
    for path, cmd in commands:
        argv = ["model-dir" if a == "..." else a for a in shlex.split(cmd)]
        ns = _parse(argv)
        assert ns.model, (path, cmd)
