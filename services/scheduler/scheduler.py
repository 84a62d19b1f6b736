"""The scheduler: one rule, no prefill or decode phases.

Each step every request is given tokens so that its `num_computed_tokens` catches up with its
`num_tokens`, under one token budget (`max_num_batched_tokens`) and at most `max_num_seqs` running
requests. Chunked prefill, decode and prefix-cache hits all fall out of that rule.
"""
from __future__ import annotations

from itertools import chain

from services.common.messages import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    RequestEventType,
    SchedulerOutput,
    SchedulerStats,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus
from services.scheduler.request_queue import create_request_queue
from services.scheduler.stop_checker import check_stop


class RequestRejected(Exception):
    """A request the engine can never serve; `code` is the error class sent to the frontend."""

    def __init__(self, message: str, code: str = "invalid_argument"):
        super().__init__(message)
        self.code = code


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int):
        self.config = config
        self.block_size = block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
        # A request may never need more blocks than exist, or preemption would loop forever.
        self.max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last step: the worker drops their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0

    # --- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request; raises RequestRejected if it can never be served."""
        if request.request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty")
        if request.num_prompt_tokens > self.max_model_len:
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens, more than the maximum of {self.max_model_len}"
            )
        limit = self.config.max_num_waiting_requests
        if limit and len(self.waiting) >= limit:
            raise RequestRejected(f"the waiting queue is full ({limit} requests)", code="resource_exhausted")
        request.max_num_tokens = min(request.max_num_tokens, self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finishes the requests at once and frees their blocks; returns those that existed."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            self._finish(request, FinishReason.ABORT)
            aborted.append(request)
        return aborted

    def fail_all(self) -> list[Request]:
        """Finishes every request (the worker was lost); returns them so callers can report errors."""
        failed = list(self.requests.values())
        self.waiting = create_request_queue(self.config.policy)
        self.running = []
        for request in failed:
            self._finish(request, FinishReason.ERROR)
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []

        # Running requests first, in order.
        allocate_slots = self.kv_cache_manager.allocate_slots
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(len(request.all_token_ids) - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                block_ids = allocate_slots(request, num_new)
                if block_ids is not None:
                    break
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # only under the priority policy
                    i -= 1
                self.running.remove(victim)
                if victim in scheduled_running:
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if block_ids is None:
                break  # the request preempted itself: nothing after it can fit either
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = block_ids
            budget -= num_new
            i += 1

        # Then waiting requests, only if nobody was preempted this step.
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        while not preempted and len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed_blocks, num_cached = [], 0
            if request.status == RequestStatus.WAITING:
                computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            # Admit only if the whole remaining prompt fits, so admission rarely causes preemption.
            if not self.kv_cache_manager.can_fit(request, computed_blocks, request.num_tokens):
                break
            num_new = min(request.num_tokens - num_cached, budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                break
            self.waiting.pop()
            if request.status == RequestStatus.PREEMPTED:
                scheduled_resumed.append(request)
            else:
                request.num_computed_tokens = num_cached
                request.num_cached_tokens = num_cached
                self.kv_cache_manager.record_prefix_cache_lookup(request.num_tokens, num_cached)
                scheduled_new.append(request)
            request.status = RequestStatus.RUNNING
            request.record_event(RequestEventType.SCHEDULED)
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = block_ids
            budget -= num_new

        output = self._build_output(scheduled_new, scheduled_resumed, scheduled_running, num_scheduled,
                                    new_block_ids, preempted)
        for request in chain(scheduled_running, scheduled_new, scheduled_resumed):
            request.num_computed_tokens += num_scheduled[request.request_id]
        self.finished_req_ids = set()
        self.num_steps += 1
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
                           ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies the finishing rules, frees finished requests' blocks."""
        outputs = []
        requests = self.requests
        cache_blocks = self.kv_cache_manager.cache_blocks
        running, finished = RequestStatus.RUNNING, RequestStatus.FINISHED
        logprobs = runner_output.logprobs or [None] * len(runner_output.req_ids)
        for req_id, token_ids, lp in zip(runner_output.req_ids, runner_output.sampled_token_ids, logprobs):
            request = requests.get(req_id)
            if request is None or request.status != running:
                continue  # aborted or preempted while the step ran
            cache_blocks(request, request.num_computed_tokens)
            all_token_ids = request.all_token_ids
            new_token_ids = token_ids
            for i, token_id in enumerate(token_ids):
                all_token_ids.append(token_id)
                # Only a stop token or a length limit can end a request; the full check runs only then.
                if token_id not in request.stop_check_token_ids and len(all_token_ids) < request.max_num_tokens:
                    continue
                reason, stop_token = check_stop(request, self.max_model_len)
                if reason != FinishReason.NONE:
                    new_token_ids = token_ids[: i + 1]
                    request.stop_reason = stop_token
                    self.running.remove(request)
                    self._finish(request, reason)
                    break
            events = request.take_events()
            if new_token_ids or events or request.status == finished:
                outputs.append(EngineCoreOutput(
                    req_id, new_token_ids, [lp] if (lp is not None and new_token_ids) else [],
                    request.finish_reason, request.stop_reason, max(request.num_cached_tokens, 0), events))
        return outputs

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_cache_stats.num_queries,
            prefix_cache_hits=kv.prefix_cache_stats.num_hits,
            num_preemptions=self.num_preemptions,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.block_pool.num_usable_blocks,
            num_steps=self.num_steps,
        )

    # --- helpers ---------------------------------------------------------------------------------
    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # the most recently admitted

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.record_event(RequestEventType.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def _build_output(self, new: list[Request], resumed: list[Request], running: list[Request],
                      num_scheduled: dict[str, int], new_block_ids: dict[str, list[int]],
                      preempted: list[Request]) -> SchedulerOutput:
        cached_reqs = resumed + running
        cached = CachedRequestData(
            req_ids=[r.request_id for r in cached_reqs],
            resumed_from_preemption=[True] * len(resumed) + [False] * len(running),
            new_block_ids=[new_block_ids[r.request_id] for r in cached_reqs],
            num_computed_tokens=[r.num_computed_tokens for r in cached_reqs],
            resumed_token_ids=[list(r.all_token_ids) for r in resumed] + [[] for _ in running],
        )
        new_data = [
            NewRequestData(r.request_id, list(r.prompt_token_ids), r.sampling_params,
                           new_block_ids[r.request_id], r.num_computed_tokens, r.traceparent)
            for r in new
        ]
        # Batch order: new requests, then cached ones (the codec restores this order on decode).
        order = [r.request_id for r in new] + cached.req_ids
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={req_id: num_scheduled[req_id] for req_id in order},
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=set(self.finished_req_ids),
            preempted_req_ids={r.request_id for r in preempted if r.status == RequestStatus.PREEMPTED},
            step_id=self.num_steps,
        )
