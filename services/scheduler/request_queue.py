"""Waiting queues: FCFS (arrival order, preempted requests back at the front) and priority."""
from __future__ import annotations

import heapq
from collections import deque

from services.scheduler.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        """A preempted request goes to the front: it was admitted before anything still waiting."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityRequestQueue:
    """Lowest (priority, arrival_time) first; a preempted request keeps its place by those keys."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0  # tie-breaker so Request objects are never compared

    def add(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._counter, request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
