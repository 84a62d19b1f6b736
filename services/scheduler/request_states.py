"""The scheduler's requests and the moves between their states: the waiting queue (and the
grammar gate before it), the running list, and the KV cache manager that holds their blocks.
Admission checks, aborts, preemption and finishing live here; `Scheduler` (scheduler.py) adds the
step itself, `schedule()` and `update_from_output()`, on top of them.
"""
from __future__ import annotations

from services.common.messages import FinishReason, RequestEventType, SchedulerStats
from services.scheduler.config import SchedulerConfig
from services.scheduler.grammar_gate import GrammarGate
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus
from services.scheduler.request_queue import create_request_queue
from services.scheduler.request_validation import RequestRejected, validate_request
from services.scheduler.stop_checker import check_stop, init_stop_triggers


class RequestStates:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int,
                 vocab_size: int | None = None):
        """`vocab_size`: the worker's, which every token id a request carries must be below (None
        checks only that ids are non-negative: a scheduler built without a worker)."""
        self.config = config
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
        # A request may never need more blocks than exist, or preemption would loop forever.
        self.max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last step: the worker drops their state.
        self.finished_req_ids: set[str] = set()
        # Constrained requests whose grammar the worker is still compiling.
        self.grammar_gate = GrammarGate()
        self.num_preemptions = 0
        self.num_steps = 0
        # Preempted between steps (their prefix turned out unwritten): the next step tells the worker.
        self.preempted_req_ids: set[str] = set()

    # --- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request; raises RequestRejected if it can never be served (request_validation.py
        lists the rules) or the waiting queue is full."""
        if request.request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request.request_id!r}")
        self.check_request(request)
        limit = self.config.max_num_waiting_requests
        if limit and len(self.waiting) + len(self.grammar_gate) >= limit:
            raise RequestRejected(f"the waiting queue is full ({limit} requests)", code="resource_exhausted")
        init_stop_triggers(request, self.max_model_len)
        self.requests[request.request_id] = request
        if self.grammar_gate.admit(request):
            self.waiting.add(request)
        else:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def check_request(self, request: Request) -> None:
        """Raises RequestRejected (invalid_argument) if the request breaks a rule of request_validation.py."""
        validate_request(request, self.max_model_len, self.vocab_size)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finishes the requests at once and frees their blocks; returns those that existed."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._dequeue(request)
            self._finish(request, FinishReason.ABORT)
            aborted.append(request)
        return aborted

    def fail_all(self) -> list[Request]:
        """Finishes every request (the worker was lost); returns them so callers can report errors."""
        failed = list(self.requests.values())
        self.waiting = create_request_queue(self.config.policy)
        self.running = []
        self.grammar_gate.take_all()
        for request in failed:
            self._finish(request, FinishReason.ERROR)
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.grammar_gate),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_cache_stats.num_queries,
            prefix_cache_hits=kv.prefix_cache_stats.num_hits,
            num_preemptions=self.num_preemptions,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.block_pool.num_usable_blocks,
            num_steps=self.num_steps,
        )

    # --- moves between states ------------------------------------------------------------------
    def _dequeue(self, request: Request) -> None:
        if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self.grammar_gate.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        else:
            self.running.remove(request)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # the most recently admitted

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token sampled in flight is dropped, and sampled again
        request.num_preemptions += 1
        request.record_event(RequestEventType.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def _finish_if_stopped(self, request: Request) -> bool:
        """Runs the full stop check after the request's last token; finishes it if that ended it."""
        reason, stop_token = check_stop(request, self.max_model_len)
        if reason == FinishReason.NONE:
            return False
        request.stop_reason = stop_token
        self.running.remove(request)
        self._finish(request, reason)
        return True

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
