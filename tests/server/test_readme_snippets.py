"""The README's OpenAI SDK snippet, run as written against the shared server (its URL and key
swapped in): `openai` is installed by setup.sh and the snippet prints the answer."""

from __future__ import annotations

import contextlib
import io
import os
import re

API_KEY = "test-key"  # conftest.API_KEY (conftest is not importable as a module)

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_openai_snippet(server):
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)
    snippet = next(b for b in blocks if "from openai import OpenAI" in b)
    assert 'base_url="http://127.0.0.1:8000/v1"' in snippet and 'api_key="unused"' in snippet
    code = snippet.replace("http://127.0.0.1:8000/v1", server.url + "/v1").replace('"unused"', repr(API_KEY))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in out.getvalue()
