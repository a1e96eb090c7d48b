"""The ``kvserve`` logger's one-time set-up (level INFO, one stream handler)."""

from __future__ import annotations

import logging


def setup_logging() -> None:
    """Give the ``kvserve`` logger a stream handler once (idempotent)."""
    root = logging.getLogger("kvserve")
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False
