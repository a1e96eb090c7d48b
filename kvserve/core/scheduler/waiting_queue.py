"""The scheduler's waiting queue: first come first served, or by (priority, arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from kvserve.request import Request


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._dq: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, req: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))
        elif front:
            self._dq.appendleft(req)
        else:
            self._dq.append(req)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._dq[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._dq.popleft()

    def remove(self, req: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)
        else:
            self._dq.remove(req)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._dq)

    def __iter__(self):
        return iter([e[3] for e in self._heap] if self.policy == "priority" else list(self._dq))
