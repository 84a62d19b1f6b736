"""One step's decision as the `SchedulerOutput` diff the worker applies: new requests in full,
cached ones as columns of what changed."""
from __future__ import annotations

from services.common.messages import CachedRequestData, NewRequestData, SchedulerOutput
from services.scheduler.request import Request, RequestStatus


def build_scheduler_output(new: list[Request], resumed: list[Request], running_ids: list[str],
                           running_num_computed: list[int], running_num_new: list[int],
                           running_block_ids: list[list[int]], admitted_num_new: dict[str, int],
                           admitted_block_ids: dict[str, list[int]], preempted: list[Request],
                           finished_req_ids: set[str], step_id: int) -> SchedulerOutput:
    """The step as a diff for the worker; `num_computed_tokens` are still those before the step."""
    resumed_ids = [r.request_id for r in resumed]
    new_ids = [r.request_id for r in new]
    cached = CachedRequestData(
        req_ids=resumed_ids + running_ids,
        resumed_from_preemption=[True] * len(resumed) + [False] * len(running_ids),
        new_block_ids=[admitted_block_ids[i] for i in resumed_ids] + running_block_ids,
        num_computed_tokens=[r.num_computed_tokens for r in resumed] + running_num_computed,
        # Resumed requests come first, so their token lists line up; running ones need none.
        resumed_token_ids=[list(r.all_token_ids) for r in resumed],
    )
    new_data = [
        NewRequestData(r.request_id, list(r.prompt_token_ids), r.sampling_params,
                       admitted_block_ids[r.request_id], r.num_computed_tokens, r.traceparent)
        for r in new
    ]
    # Batch order: new requests, then cached ones (the codec restores this order on decode).
    num_scheduled_tokens = dict(zip(running_ids, running_num_new))
    if admitted_num_new:
        num_scheduled_tokens = {**{i: admitted_num_new[i] for i in new_ids + resumed_ids}, **num_scheduled_tokens}
    return SchedulerOutput(
        scheduled_new_reqs=new_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=sum(running_num_new) + sum(admitted_num_new.values()),
        finished_req_ids=set(finished_req_ids),
        preempted_req_ids={r.request_id for r in preempted if r.status == RequestStatus.PREEMPTED},
        step_id=step_id,
    )
