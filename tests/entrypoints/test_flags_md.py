"""docs/flags.md is generated from the parsers (config field docs) and must be up to date."""

import os

from kvserve.entrypoints.flags_md import render

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "flags.md")


def test_flags_md_up_to_date():
    text = render()
    for flag in ("--cpu-threads", "--tool-call-parser", "--enable-auto-tool-choice", "--kv-cache-memory",
                 "--dataset-name", "--result-dir"):
        assert f"`{flag}`" in text
    with open(DOC) as f:
        assert f.read() == text, "docs/flags.md is stale: python -m kvserve.entrypoints.flags_md > docs/flags.md"
