"""The scheduler: one rule, no prefill or decode phases.

Each step every request is given tokens so that its `num_computed_tokens` catches up with its
`num_tokens`, under one token budget (`max_num_batched_tokens`) and at most `max_num_seqs` running
requests. Chunked prefill, decode and prefix-cache hits all fall out of that rule.

`schedule()` may run again before the last step's output is back (async scheduling): a token that
a step in flight samples counts as a placeholder (`num_output_placeholders`) that the next step
already computes, as the worker appends what it samples. `update_from_output()` replaces it with
the real token; a request the step in flight finishes is not scheduled past its length limit,
and a step's output for a request that finished or was preempted meanwhile is dropped.

A prompt chunk's full blocks join the prefix cache when it is scheduled (`cache_scheduled_blocks`),
so requests admitted later in the step, or in the next while it runs, reuse them; its output
confirms them (`confirm_step`), and blocks whose request or step did not run leave the cache with
every request holding one preempted, to recompute from its first token.
"""
from __future__ import annotations

from itertools import repeat

from services.common.messages import (
    EngineCoreOutputs,
    FinishReason,
    ModelRunnerOutput,
    OutputExtras,
    RequestEventType,
    SchedulerOutput,
)
from services.scheduler.request import Request, RequestStatus
from services.scheduler.request_states import RequestStates
from services.scheduler.step_output import build_scheduler_output
from services.scheduler.stop_checker import may_stop


class Scheduler(RequestStates):
    """The step on top of the request states (request_states.py): what runs next, and what its
    output changes."""

    # --- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        # The step's decision, keyed by request id: tokens, new block ids and starting computed counts.
        num_scheduled_tokens: dict[str, int] = {}
        req_to_new_block_ids: dict[str, list[int]] = {}
        req_to_num_computed: dict[str, int] = {}  # what the step starts from
        scheduled_running: list[Request] = []
        preempted: list[Request] = []

        # Running requests first, in order.
        running = self.running
        num_slots_held, block_size = kv.num_slots_held, self.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + num_placeholders
            num_new = num_tokens - num_computed
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or (num_placeholders and num_tokens >= request.max_num_tokens):
                i += 1  # caught up, or the step in flight samples its last token
                continue
            # The usual decode step: the held blocks have room, and no call is needed.
            block_ids = [] if num_computed + num_new <= num_slots_held.get(request.request_id, 0) else None
            while block_ids is None:
                block_ids = kv.allocate_slots(request, num_new)
                if block_ids is not None:
                    break
                victim = self._pick_victim()
                if running.index(victim) < i:  # only under the priority policy
                    i -= 1
                running.remove(victim)
                if victim.request_id in num_scheduled_tokens:  # scheduled earlier in this step: undone
                    budget += num_scheduled_tokens.pop(victim.request_id)
                    del req_to_new_block_ids[victim.request_id], req_to_num_computed[victim.request_id]
                    scheduled_running.remove(victim)
                    kv.forget_scheduled_blocks(victim, self.num_steps)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if block_ids is None:
                break  # the request preempted itself: nothing after it can fit either
            scheduled_running.append(request)
            req_id = request.request_id
            num_scheduled_tokens[req_id] = num_new
            req_to_new_block_ids[req_id] = block_ids
            req_to_num_computed[req_id] = num_computed
            budget -= num_new
            i += 1
            # Counted as computed now, so the next step can be scheduled before this one's output is
            # back (`_preempt` resets a request preempted later in this loop); the step builder reads
            # the starting counts from `req_to_num_computed`.
            request.num_computed_tokens = num_computed + num_new
            if (num_computed + num_new) % block_size < num_new:  # the step fills a block
                kv.cache_scheduled_blocks(request, num_computed + num_new, self.num_steps)
            if num_new == num_tokens - num_computed:
                request.num_output_placeholders = num_placeholders + 1  # this step samples a token

        # Then waiting requests, only if nobody was preempted this step or since the last (a step in
        # flight may still carry an output for them, which must find them preempted, not resumed).
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        while (not preempted and not self.preempted_req_ids and len(self.waiting) and budget > 0
               and len(running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            computed_blocks, num_cached = [], 0
            if request.status == RequestStatus.WAITING:
                computed_blocks, num_cached = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            # Admitted only if the whole remaining prompt fits, so admission rarely causes preemption.
            block_ids = kv.allocate_slots(request, num_new, computed_blocks, num_tokens_to_fit=request.num_tokens)
            if block_ids is None:
                break
            self.waiting.pop()
            if request.status == RequestStatus.PREEMPTED:
                resumed_reqs.append(request)
            else:
                request.num_computed_tokens = num_cached
                request.num_cached_tokens = num_cached
                kv.record_prefix_cache_lookup(request.num_tokens, num_cached)
                new_reqs.append(request)
            request.status = RequestStatus.RUNNING
            request.record_event(RequestEventType.SCHEDULED)
            running.append(request)
            num_scheduled_tokens[request.request_id] = num_new
            req_to_new_block_ids[request.request_id] = block_ids
            req_to_num_computed[request.request_id] = request.num_computed_tokens
            request.num_computed_tokens += num_new
            kv.cache_scheduled_blocks(request, request.num_computed_tokens, self.num_steps)
            if request.num_computed_tokens == len(request.all_token_ids):
                request.num_output_placeholders = 1  # this step samples a token
            budget -= num_new

        output = build_scheduler_output(new_reqs, resumed_reqs, scheduled_running, num_scheduled_tokens,
                                        req_to_new_block_ids, req_to_num_computed,
                                        {r.request_id for r in preempted} | self.preempted_req_ids,
                                        self.finished_req_ids, self.num_steps)
        output.grammars_to_compile = self.grammar_gate.take_to_announce()
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        self.num_steps += 1
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
                           ) -> EngineCoreOutputs:
        """Appends sampled tokens, applies the finishing rules, frees finished requests' blocks.

        Runs once per step for every scheduled request, so the usual case (one token, no block
        filled, no finish, no events) touches no helper and builds no object per request: it only
        joins the outputs' two columns.
        """
        req_ids: list[str] = []
        new_token_ids_column: list[list[int]] = []
        extras: dict[str, OutputExtras] = {}
        # Blocks registered ahead for this step are computed now, or (a request or the step did not
        # run) leave the cache with every request that may have read them starting over.
        self._confirm_step(scheduler_output.step_id, runner_output.req_ids, runner_output.failed_reqs)
        step_requests = list(map(self.requests.get, runner_output.req_ids))
        # Before any finishes frees its blocks: the blocks this step filled join the prefix cache.
        self.kv_cache_manager.cache_computed_blocks(step_requests)
        running, finished = RequestStatus.RUNNING, RequestStatus.FINISHED
        logprobs = runner_output.logprobs
        if not logprobs or logprobs.count(None) == len(logprobs):
            logprobs = repeat(None)
        for request, token_ids, lp in zip(step_requests, runner_output.sampled_token_ids, logprobs):
            if request is None or request.status != running:
                continue  # aborted or preempted while the step ran
            req_id = request.request_id
            new_token_ids = token_ids
            if len(token_ids) == 1:  # the usual decode step
                request.num_output_placeholders -= 1
                all_token_ids = request.all_token_ids
                all_token_ids.append(token_ids[0])
                # `may_stop`, inlined as it runs for every token; the full check runs only then.
                if token_ids[0] in request.stop_check_token_ids or len(all_token_ids) >= request.max_num_tokens:
                    self._finish_if_stopped(request)
                elif lp is None and not request.events:
                    req_ids.append(req_id)
                    new_token_ids_column.append(token_ids)
                    continue
            elif token_ids:
                request.num_output_placeholders -= 1
                all_token_ids = request.all_token_ids
                for i, token_id in enumerate(token_ids):
                    all_token_ids.append(token_id)
                    if may_stop(request, token_id) and self._finish_if_stopped(request):
                        new_token_ids = token_ids[: i + 1]
                        break
            if request.events or request.status == finished or (lp is not None and new_token_ids):
                extras[req_id] = OutputExtras(
                    [lp] if (lp is not None and new_token_ids) else [], request.finish_reason,
                    request.stop_reason, max(request.num_cached_tokens, 0), request.take_events())
            elif not new_token_ids:
                continue
            req_ids.append(req_id)
            new_token_ids_column.append(new_token_ids)
        outputs = EngineCoreOutputs(req_ids, new_token_ids_column, extras)
        if runner_output.failed_reqs:
            self._fail_refused(runner_output.failed_reqs, outputs)
        if runner_output.compiled_grammar_keys or runner_output.failed_grammars:
            self._on_grammars(runner_output, outputs)
        return outputs

    def on_step_failed(self, scheduler_output: SchedulerOutput) -> None:
        """A step failed as a whole (the engine core has failed its requests)."""
        self.grammar_gate.on_step_failed()
        self._confirm_step(scheduler_output.step_id, [], {})

    # --- helpers ---------------------------------------------------------------------------------
    def _fail_refused(self, failed: dict[str, str], outputs: EngineCoreOutputs) -> None:
        """Requests the worker refused to run (their inputs, not the step, were at fault): each ends
        with an error of its own, and the step's other requests go on."""
        for req_id, reason in failed.items():
            request = self.requests.get(req_id)
            if request is None:
                continue  # finished or aborted meanwhile, or refused again by a step that was in flight
            self._dequeue(request)
            self._finish(request, FinishReason.ERROR)
            outputs.append(req_id, [], OutputExtras(
                finish_reason=FinishReason.ERROR, num_cached_tokens=max(request.num_cached_tokens, 0),
                events=request.take_events(), error_message=f"the worker could not run the request: {reason}",
                error_code="internal"))

    def _on_grammars(self, runner_output: ModelRunnerOutput, outputs: EngineCoreOutputs) -> None:
        """Compiled grammars release their requests to the waiting queue; a grammar that failed to
        compile fails its requests alone."""
        released, rejected = self.grammar_gate.on_results(runner_output.compiled_grammar_keys,
                                                          runner_output.failed_grammars)
        for request in released:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        for request, reason in rejected:
            self._finish(request, FinishReason.ERROR)
            outputs.append(request.request_id, [], OutputExtras(
                finish_reason=FinishReason.ERROR, events=request.take_events(),
                error_message=f"structured_outputs: {reason}", error_code="invalid_argument"))

    def _confirm_step(self, step_id: int, req_ids: list[str], failed_reqs: dict[str, str]) -> None:
        """The step's blocks registered ahead are computed, or they leave the cache and the running
        requests holding any (all but those failing anyway) are preempted, to recompute from their
        first token."""
        to_restart = self.kv_cache_manager.confirm_step(step_id, req_ids, failed_reqs)
        if not to_restart:
            return  # the usual step
        for req_id in to_restart.difference(failed_reqs):
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)
                self.preempted_req_ids.add(req_id)
