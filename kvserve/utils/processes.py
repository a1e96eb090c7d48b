"""Child processes: a free port to give one, its death with the parent, a process-group stop.

Shared by ``kvserve launch`` (its ``kvserve serve`` workers) and ``kvserve bench serve --peer``
(llama-server); standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Optional


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, even by SIGKILL, so that
    no child outlives it. Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_process_group(p: Optional[subprocess.Popen], grace: float) -> None:
    """SIGTERM ``p``'s process group (started with ``start_new_session``), SIGKILL after
    ``grace`` seconds; no-op when it already exited."""
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
