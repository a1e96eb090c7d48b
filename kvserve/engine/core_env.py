"""The environment of one engine-core process: which GPUs a data-parallel core sees, and how the
frontend hands it over (``spawn`` copies ``os.environ`` when it starts the child)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional


@contextlib.contextmanager
def environ_set(env: dict) -> Iterator[None]:
    """Set the variables of ``env`` in ``os.environ`` for the block, then restore them."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def core_devices(index: int, world_size: int, visible: Optional[str], device_count: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value of data-parallel core ``index``: ``world_size`` GPUs
    from position ``index * world_size`` of the server's visible GPUs (``visible``: its own
    ``CUDA_VISIBLE_DEVICES``, or None: ``0 .. device_count - 1``).

    Raises:
        ValueError: fewer visible GPUs than the cores need.
    """
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else [str(i) for i in range(device_count)]
    lo, hi = index * world_size, (index + 1) * world_size
    if hi > len(ids):
        raise ValueError(f"data-parallel core {index} needs GPUs {lo}..{hi - 1} ({world_size} per core) but "
                         f"{len(ids)} are visible: data_parallel_size x GPUs per core must be <= the visible GPUs")
    return ",".join(ids[lo:hi])
