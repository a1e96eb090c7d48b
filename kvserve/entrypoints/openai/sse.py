"""Server-sent events: one ``data:`` line per JSON chunk, and async streams merged into one."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Union


def sse(obj: Union[dict, str]) -> str:
    """One SSE event: ``data: <obj as JSON, or the string as is>`` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge(iters: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators, yielding ``(index, item)``; closing it closes them all."""
    if len(iters) == 1:
        try:
            async for item in iters[0]:
                yield 0, item
        finally:
            await iters[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, None, exc))
            return
        await queue.put((i, done, None))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iters)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iters:
            await it.aclose()
