"""One step's decision as the `SchedulerOutput` diff the worker applies: new requests in full,
cached ones as columns of what changed."""
from __future__ import annotations

from services.common.messages import CachedRequestData, NewRequestData, SchedulerOutput
from services.scheduler.request import Request


def build_scheduler_output(new: list[Request], resumed: list[Request], running: list[Request],
                           num_scheduled_tokens: dict[str, int], req_to_new_block_ids: dict[str, list[int]],
                           req_to_num_computed: dict[str, int], preempted_req_ids: set[str],
                           finished_req_ids: set[str], step_id: int) -> SchedulerOutput:
    """The step as a diff for the worker: `new`, `resumed` and `running` are the scheduled requests;
    the step's tokens, new block ids and the computed counts it starts from are keyed by request id
    (in the scheduler's order: running requests, then admitted ones)."""
    cached_reqs = resumed + running
    if new or resumed:
        req_ids = [r.request_id for r in cached_reqs]
        new_block_ids = [req_to_new_block_ids[r] for r in req_ids]
        num_computed_tokens = [req_to_num_computed[r] for r in req_ids]
    else:  # the steady step: the dicts hold exactly the running requests, in order
        req_ids = list(num_scheduled_tokens)
        new_block_ids, num_computed_tokens = list(req_to_new_block_ids.values()), list(req_to_num_computed.values())
    cached = CachedRequestData(
        req_ids=req_ids,
        resumed_from_preemption=[True] * len(resumed) + [False] * len(running),
        new_block_ids=new_block_ids,
        num_computed_tokens=num_computed_tokens,
        # Resumed requests come first, so their token lists line up; running ones need none.
        resumed_token_ids=[list(r.all_token_ids) for r in resumed],
    )
    new_data = [
        NewRequestData(r.request_id, list(r.prompt_token_ids), r.sampling_params,
                       req_to_new_block_ids[r.request_id], req_to_num_computed[r.request_id], r.traceparent)
        for r in new
    ]
    # Batch order: new requests, then cached ones (the codec restores this order on decode). Running
    # requests were scheduled first, so the dict is reordered only when some were admitted.
    if new or resumed:
        num_scheduled_tokens = {r.request_id: num_scheduled_tokens[r.request_id] for r in new + cached_reqs}
    return SchedulerOutput(
        scheduled_new_reqs=new_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
        finished_req_ids=set(finished_req_ids),
        preempted_req_ids=preempted_req_ids,
        step_id=step_id,
    )
