"""Tests look at a step's outputs one request at a time: conversions between `EngineCoreOutputs`
(columns plus sparse extras) and per-request `EngineCoreOutput` objects."""
from __future__ import annotations

from services.common.messages import EngineCoreOutput, EngineCoreOutputs, OutputExtras, SchedulerStats


def per_request(step: EngineCoreOutputs) -> list[EngineCoreOutput]:
    """Each request's output of the step, in the step's order, with its extras."""
    return [EngineCoreOutput.of(r, t, step.extras.get(r)) for r, t in zip(step.req_ids, step.new_token_ids)]


def outputs_from(outputs: list[EngineCoreOutput], scheduler_stats: SchedulerStats | None = None,
                 timestamp: float = 0.0) -> EngineCoreOutputs:
    """A step's outputs from per-request objects: extras only for those carrying more than tokens."""
    step = EngineCoreOutputs(scheduler_stats=scheduler_stats, timestamp=timestamp)
    for o in outputs:
        extras = OutputExtras(o.new_logprobs, o.finish_reason, o.stop_reason, o.num_cached_tokens, o.events,
                              o.error_message, o.error_code)
        has_extras = o.new_logprobs or o.finished or o.events or o.num_cached_tokens or o.error_message
        step.append(o.request_id, o.new_token_ids, extras if has_extras else None)
    return step
