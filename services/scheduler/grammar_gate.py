"""Holds constrained requests until the worker has compiled their grammar (vLLM's WAITING_FOR_FSM).

The worker owns the grammar matchers (it samples, so nothing extra crosses the wire each step, and
under async scheduling it already holds the token a step in flight sampled); the scheduler only
knows which constraints are compiled. A request whose constraint is new waits here; its
constraint is announced once in the next step (`SchedulerOutput.grammars_to_compile`, one entry per
distinct key however many requests share it); the worker compiles on its own thread while other
requests' steps run, and a later step's output reports the key compiled (the requests move to the
waiting queue) or failed (they finish with an error naming the constraint). A request whose
constraint the worker already compiled goes straight to the waiting queue.

The keys known compiled are remembered for this worker connection, the least recently used
forgotten past `MAX_NUM_KNOWN_GRAMMARS` (the worker keeps a bounded cache too; a grammar it
evicted meanwhile is compiled again inline when its request is scheduled).
"""
from __future__ import annotations

from collections import OrderedDict

from services.common.structured_outputs import StructuredOutputsParams
from services.scheduler.request import Request

MAX_NUM_KNOWN_GRAMMARS = 4096


class GrammarGate:
    def __init__(self) -> None:
        self._compiled: OrderedDict[str, None] = OrderedDict()
        self._waiting: dict[str, list[Request]] = {}  # key -> requests waiting for it, arrival order
        self._params: dict[str, StructuredOutputsParams] = {}  # the awaited keys' constraints
        self._to_announce: dict[str, StructuredOutputsParams] = {}

    def __len__(self) -> int:
        return sum(map(len, self._waiting.values()))

    def admit(self, request: Request) -> bool:
        """True if the request's grammar is compiled (or it has none); otherwise holds it."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return True
        key = params.key
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return True
        waiting = self._waiting.get(key)
        if waiting is None:
            self._waiting[key] = waiting = []
            self._params[key] = self._to_announce[key] = params
        waiting.append(request)
        return False

    def take_to_announce(self) -> dict[str, StructuredOutputsParams]:
        """The constraints the next step asks the worker to compile."""
        if not self._to_announce:
            return {}
        announced, self._to_announce = self._to_announce, {}
        return announced

    def on_results(self, compiled_keys: list[str], failed: dict[str, str]
                   ) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests released by compiled keys, and those failed with the worker's reason."""
        released: list[Request] = []
        for key in compiled_keys:
            self._compiled[key] = None
            self._compiled.move_to_end(key)
            released.extend(self._waiting.pop(key, ()))
            self._params.pop(key, None)
        while len(self._compiled) > MAX_NUM_KNOWN_GRAMMARS:
            self._compiled.popitem(last=False)
        rejected = [(r, why) for key, why in failed.items() for r in self._waiting.pop(key, ())]
        for key in failed:
            self._params.pop(key, None)
        return released, rejected

    def on_step_failed(self) -> None:
        """A failed step may not have reached the worker: every awaited constraint is announced again
        (the worker compiles a key once however often it is named)."""
        self._to_announce.update(self._params)

    def remove(self, request: Request) -> None:
        """Takes out a held request (aborted while it waited)."""
        key = request.sampling_params.structured_outputs.key
        waiting = self._waiting.get(key)
        if waiting is not None and request in waiting:
            waiting.remove(request)  # the key stays awaited, even with none left: its result still comes

    def take_all(self) -> list[Request]:
        """Every held request, for failing them all (the worker was lost)."""
        held = [r for waiting in self._waiting.values() for r in waiting]
        self._waiting.clear()
        self._params.clear()
        self._to_announce.clear()
        return held
