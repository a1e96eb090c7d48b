"""Fresh ``ipc://`` socket addresses in the temp directory, and their clean-up (no zmq needed)."""

from __future__ import annotations

import os
import tempfile
import uuid


def make_ipc_paths(n: int = 2) -> list[str]:
    """``n`` fresh ``ipc://`` addresses (unique to this process and call)."""
    base = os.path.join(tempfile.gettempdir(), f"kvserve-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return [f"ipc://{base}-{i}.sock" for i in range(n)]


def cleanup_ipc_paths(*addrs: str) -> None:
    """Remove the socket files of ``ipc://`` addresses (missing files are fine)."""
    for a in addrs:
        if a.startswith("ipc://"):
            try:
                os.unlink(a[len("ipc://"):])
            except OSError:
                pass
