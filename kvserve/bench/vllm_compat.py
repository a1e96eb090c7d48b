"""vLLM's ``vllm bench serve`` flags for ``kvserve bench serve``: a vLLM user's command line
runs unchanged (kvserve's own flags stay as extras).

Mapped flags: ``--backend`` (vllm | openai -> /v1/completions, openai-chat ->
/v1/chat/completions), ``--host`` / ``--port`` (when ``--base-url`` is not given),
``--dataset-name`` (random | sharegpt | kvserve's datasets) with ``--dataset-path``,
``--random-input-len`` / ``--random-output-len`` / ``--random-range-ratio`` (lengths drawn from
``[L * (1 - r), L * (1 + r)]``), ``--sharegpt-output-len``, ``--tokenizer`` (token counts of
ShareGPT, decoding random prompts for chat), ``--ignore-eos``, ``--percentile-metrics`` /
``--metric-percentiles`` (extra ``p<P>_<metric>_ms`` keys), ``--save-result`` as a switch with
``--result-dir`` / ``--result-filename`` (vLLM's default file name), ``--num-prompts``
(default 1000 with ``--dataset-name``, as vLLM). With ``--dataset-name`` the defaults are
vLLM's: outputs stop at EOS unless ``--ignore-eos``; with kvserve's ``--dataset`` outputs
stay fixed-length.
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any, Optional

BACKENDS = ("vllm", "openai", "openai-chat", "kvserve")
VLLM_DATASETS = ("random", "sharegpt", "humaneval", "shared-prefix", "multi-turn", "jsonl")
METRICS = ("ttft", "tpot", "itl", "e2el")


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM-compatible flags (vllm bench serve)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="vllm / openai: /v1/completions; openai-chat: /v1/chat/completions.")
    g.add_argument("--host", default=None, help="Server host when --base-url is not given (default: 127.0.0.1).")
    g.add_argument("--port", type=int, default=None, help="Server port when --base-url is not given (default: 8000).")
    g.add_argument("--dataset-name", choices=VLLM_DATASETS, default=None,
                   help="vLLM's dataset flag (sharegpt needs --dataset-path); implies vLLM's defaults.")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens (default: %(default)s).")
    g.add_argument("--random-output-len", type=int, default=128, help="random: output tokens (default: %(default)s).")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [L*(1-r), L*(1+r)] (default: %(default)s).")
    g.add_argument("--random-prefix-len", type=int, default=0, help="Accepted for vLLM; must be 0.")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: fixed output length.")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer directory (e.g. from `kvserve export`) for token counts / random text.")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="Generate past EOS (fixed lengths).")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="Metrics to report percentiles of (default: %(default)s).")
    g.add_argument("--metric-percentiles", default="99", help="Percentiles, e.g. 25,50,99 (default: %(default)s).")
    g.add_argument("--result-dir", default=None, help="With --save-result: directory of the result file.")
    g.add_argument("--result-filename", default=None,
                   help="With --save-result: file name (default: vLLM's "
                        "{backend}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json).")


def apply_vllm_args(ns: argparse.Namespace) -> None:
    """Fold the vLLM flags into kvserve's (in place). Raises ValueError for bad values."""
    if ns.base_url is None:
        ns.base_url = f"http://{ns.host or '127.0.0.1'}:{ns.port or 8000}"
    if ns.backend == "openai-chat" and ns.endpoint == "/v1/completions":
        ns.endpoint = "/v1/chat/completions"
    ns.vllm_style = ns.dataset_name is not None
    if ns.vllm_style:
        ns.dataset = ns.dataset_name
        if ns.dataset == "random":
            r = ns.random_range_ratio
            if not 0.0 <= r < 1.0:
                raise ValueError(f"--random-range-ratio must be in [0, 1), got {r}")
            ns.input_len = _range(ns.random_input_len, r, "--random-input-len")
            ns.output_len = _range(ns.random_output_len, r, "--random-output-len")
        if ns.num_prompts is None:
            ns.num_prompts = 1000
    if ns.random_prefix_len:
        raise ValueError("--random-prefix-len is not supported (use --dataset shared-prefix)")
    if ns.ignore_eos is None:
        ns.ignore_eos = not ns.vllm_style
    ns.percentiles = [float(x) for x in str(ns.metric_percentiles).split(",") if x.strip()]
    ns.percentile_metric_names = [m.strip() for m in str(ns.percentile_metrics).split(",") if m.strip()]
    bad = [m for m in ns.percentile_metric_names if m not in METRICS]
    if bad or any(not 0 < p <= 100 for p in ns.percentiles):
        raise ValueError(f"--percentile-metrics takes {','.join(METRICS)} and --metric-percentiles values in "
                         f"(0, 100]; got {ns.percentile_metrics!r} / {ns.metric_percentiles!r}")


def _range(length: int, ratio: float, flag: str) -> str:
    if length < 1:
        raise ValueError(f"{flag} must be >= 1, got {length}")
    return f"{max(1, int(length * (1 - ratio)))}:{max(1, int(length * (1 + ratio)))}"


def load_tokenizer(path: Optional[str]) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def result_path(ns: argparse.Namespace, model: str, rate: float) -> Optional[str]:
    """Where the result goes: ``--save-result PATH`` (kvserve), or with the ``--save-result``
    switch, ``--result-dir`` / ``--result-filename`` or vLLM's default name; None: not saved."""
    if ns.save_result is None or ns.save_result is False:
        return None
    if isinstance(ns.save_result, str):
        return ns.save_result
    name = ns.result_filename
    if not name:
        conc = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{ns.backend or 'vllm'}-{rate:g}qps{conc}-{model.split('/')[-1]}-{stamp}.json"
    return os.path.join(ns.result_dir, name) if ns.result_dir else name


def percentile_keys(results: list, metrics: list[str], percentiles: list[float]) -> dict[str, float]:
    """vLLM's ``p<P>_<metric>_ms`` keys for the asked metrics and percentiles."""
    from kvserve.bench.report import percentile

    ok = [r for r in results if r.success]
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    out = {}
    for m in metrics:
        xs = [v * 1000.0 for v in series[m]]
        for p in percentiles:
            out[f"p{p:g}_{m}_ms"] = percentile(xs, p)
    return out
