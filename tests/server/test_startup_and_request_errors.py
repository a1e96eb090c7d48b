"""On the shared tiny server: the start-up lines (timings with the tokenizer, the URL and
"ready") and the 400s for a body that is not JSON, which say what to fix."""

from __future__ import annotations

import time

import httpx


def test_startup_lines(tiny_server):
    want = f"kvserve ready: serving tiny at http://127.0.0.1:{tiny_server.port}/v1"
    deadline = time.monotonic() + 10
    while want not in tiny_server.read_log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = tiny_server.read_log()
    assert want in log
    assert "start-up: tokenizer skipped (alongside the engine core), engine core" in log
    assert "quantization none" in log
    assert log.index("start-up: tokenizer") < log.index(want)


def test_malformed_json_and_missing_content_type(tiny_server):
    url = tiny_server.url + "/v1/completions"
    r = httpx.post(url, content=b'{"model": "tiny", "prompt": [1, 2],}', headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None
    assert err["message"].startswith("the request body is not valid JSON: ") and "at character 35" in err["message"]
    r = httpx.post(url, content=b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 1}',
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None
    assert "`Content-Type: application/json`" in err["message"] and "x-www-form-urlencoded" in err["message"]
