"""The one helper for tests that talk to a live ``kvserve`` process (``serve``, ``router``,
``launch``) over HTTP, in the shape of vLLM's ``RemoteOpenAIServer``: start it on a free
loopback port, wait for its health route, hand out a URL / clients, stop it.

    with RemoteServer.serve(["--load-format", "dummy"], log_path) as srv:
        srv.client().completions.create(...)

Each process leads its own process group (``kill()`` reaches the API server and its engine
core, never pytest); ``stop()`` sends SIGTERM to the leader only, which shuts its children down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

# Quiet uvicorn: the logs are read back by tests that look for one line.
QUIET = ["--disable-access-log", "--uvicorn-log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """A ``python -m kvserve.entrypoints.cli ARGS --port PORT`` subprocess logging to a file.

    ``args`` starts with the subcommand (``serve``, ``router``, ``launch``). ``api_key`` is
    passed as ``--api-key`` and used by ``client()`` / ``http()``; ``env`` is added to the
    environment (``HF_HUB_OFFLINE=1`` always). ``new_session=False`` keeps the process in
    pytest's process group (then ``kill()`` reaches the leader only).
    """

    def __init__(self, args: list[str], log_path, *, api_key: str | None = None, port: int | None = None,
                 env: dict | None = None, new_session: bool = True) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_args = list(args)
        self.log_path = str(log_path)
        self.api_key = api_key
        self.env = env
        self.new_session = new_session
        self.proc: subprocess.Popen | None = None

    @classmethod
    def serve(cls, extra_args: list[str], log_path, api_key: str | None = None, start: bool = True,
              **kw) -> "RemoteServer":
        """``kvserve serve EXTRA_ARGS`` with quiet uvicorn logs, started unless ``start=False``."""
        srv = cls(["serve", *extra_args, *QUIET], log_path, api_key=api_key, **kw)
        return srv.start() if start else srv

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "RemoteServer":
        args = [sys.executable, "-m", "kvserve.entrypoints.cli", *self.base_args, "--port", str(self.port)]
        if self.api_key:
            args += ["--api-key", self.api_key]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(self.env or {}))
        with open(self.log_path, "a") as log:  # "a": a restarted process appends to the same log
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=self.new_session)
        return self

    def wait_ready(self, timeout: float = 300.0, path: str = "/health") -> "RemoteServer":
        """Poll ``path`` until it answers 200; RuntimeError (with the log's tail) when the
        process exits first or ``timeout`` seconds pass."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log:\n{self.read_log()[-5000:]}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready in {timeout} s; log:\n{self.read_log()[-5000:]}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the leader and wait (SIGKILL the group after ``timeout`` s); its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the process group (API server and engine core) or, without a session of its
        own, the leader."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            if self.new_session:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> "RemoteServer":
        if self.proc is None:
            self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ access

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        """An ``openai.OpenAI`` client for ``/v1`` (no retries, 120 s timeout)."""
        import openai

        kw = {"max_retries": 0, "timeout": 120, **kw}
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "EMPTY", **kw)

    def http(self, **kw):
        """An ``httpx.Client`` on the server's URL with its API key (close it, or use ``with``)."""
        import httpx

        return httpx.Client(base_url=self.url, headers=self.headers, **{"timeout": 120, **kw})

    def read_log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def engine_pid(self) -> int:
        """Pid of the engine-core child (the spawned process that is not the resource tracker)."""
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmd:
                return int(d)
        raise RuntimeError("engine core process not found")


# A tiny Llama (random weights under ``--load-format dummy``, token ids only: no tokenizer), for
# server mechanics that need no real text.
TINY_LLAMA = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
                  architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def tiny_dummy_server(remote_server, tmp_path_factory, name: str, flags: list[str]):
    """Yield a ready ``kvserve serve`` of the tiny dummy-weight Llama (``TINY_LLAMA``, no tokenizer,
    served as ``tiny``; ``.model_dir`` is its config directory) with ``flags`` added; stopped
    afterwards. For module- or session-scoped fixtures."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp(name)
    LlamaConfig(**TINY_LLAMA).save_pretrained(str(d))
    args = [str(d), "--load-format", "dummy", "--skip-tokenizer-init", "--served-model-name", "tiny", *flags]
    h = remote_server.serve(args, str(d / "server.log"))
    h.model_dir = str(d)
    try:
        h.wait_ready()
        yield h
    finally:
        h.stop()


def load_benchmark(name: str):
    """``benchmarks/load/NAME.py`` as a module: the suite runs each load script at smoke size."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "load" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kvserve_load_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_only(*values):
    """A ``pytest.param`` marked ``gpu``: a parametrization the Triton interpreter skips on the CPU
    because another case there covers the same code path (CUDA runs every case)."""
    import pytest

    return pytest.param(*values, marks=pytest.mark.gpu)


def cpu_subset(cases, keep):
    """``cases`` (tuples of parameter values) with every one not in ``keep`` made ``gpu_only``."""
    keep = set(keep)
    return [c if c in keep else gpu_only(*c) for c in cases]


def save_random_causal_lm(path, cfg, std: float, seed: int = 0) -> str:
    """A transformers model from ``cfg`` (float32) with every matrix redrawn from N(0, ``std``)
    (so greedy choices are not near-ties), saved to ``path``; returns ``str(path)``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(path)
    return str(path)


@contextlib.contextmanager
def gguf_metadata_parsed_once():
    """While inside, ``gguf.GGUFReader(path)`` and ``gguf.get_tensor_name_map(arch, n)`` are memoized.

    transformers' GGUF loading parses a file's metadata (the whole vocabulary: 262k entries for Gemma 3)
    once for the config and again for the weights or the tokenizer, and rebuilds the tensor-name map once
    per submodule (~400 times for a 30-layer model). A reader only reads its file and the map depends only
    on its arguments, so sharing them changes nothing loaded (checked: every state-dict tensor equal) and
    halves a load on 2 cores. For the tests' transformers references and fixtures, not the engine under test.
    """
    import functools

    import gguf

    orig_map, orig_reader = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(orig_map)
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(orig_reader)
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = orig_map, orig_reader


def hf_from_gguf(path: str, dtype=None):
    """transformers' own loading of a GGUF file (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``),
    in eval mode: the reference the real-model tests compare against (``gguf_metadata_parsed_once``)."""
    import torch
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(path)
    with gguf_metadata_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype or torch.float32)
    return model.eval()
