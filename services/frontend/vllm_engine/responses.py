"""One Generate call's responses: the serving path's `(choice index, TextDelta)` stream as the
protocol's `chunk` and `complete` messages.

Streamed (`stream=true`): one `chunk` per engine delta that carries tokens (its new token ids and
their logprobs, the prompt's length, the choice's token count so far, the cached prompt tokens,
the choice's `index`), then one `complete` per choice when it finishes. Not streamed: only the
`complete`s. A `complete` always describes its whole choice, streamed or not: every output token id
and, when asked for, every logprob; `finish_reason` "stop" or "length" ("abort" when an Abort call
ended it); `matched_token_id` when a token ended it (EOS or a stop token: the engine stops on the
last token it sampled) or `matched_stop_str` when a stop string did.
"""
from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from services.common.messages import TokenLogprobs
from services.frontend.serving_engine import Choice, TextDelta
from services.frontend.vllm_engine.codec import chunk_to_pb, complete_to_pb, output_logprobs_to_pb

ABORTED = "abort"


class GenerateResponses:
    """Builds the messages of one request's choices as their deltas arrive."""

    def __init__(self, choices: list[Choice], is_stream: bool, num_top_logprobs: int | None):
        self.choices = choices
        self.is_stream = is_stream
        self.num_top_logprobs = num_top_logprobs  # None: no logprobs asked for
        self.num_prompt_tokens = len(choices[0].engine_request.prompt_token_ids)
        self._logprobs: list[list[TokenLogprobs]] = [[] for _ in choices]

    def on_delta(self, index: int, delta: TextDelta) -> list[pb.GenerateResponse]:
        """The messages for a delta of choice `index` (already recorded on the choice)."""
        choice = self.choices[index]
        self._logprobs[index] += delta.logprobs
        responses = []
        if self.is_stream and delta.token_ids:
            responses.append(chunk_to_pb(index, delta.token_ids, self.num_prompt_tokens, choice.num_output_tokens,
                                         delta.num_cached_tokens, self._logprobs_pb(delta.token_ids, delta.logprobs)))
        if delta.finish_reason is not None:
            responses.append(self._complete(index, delta.finish_reason, _matched_stop(choice, delta.finish_reason)))
        return responses

    def on_abort(self) -> list[pb.GenerateResponse]:
        """A `complete` with reason "abort" for each choice still running when an Abort call came."""
        return [self._complete(i, ABORTED, None) for i, choice in enumerate(self.choices)
                if choice.finish_reason is None]

    def _complete(self, index: int, finish_reason: str, matched_stop: int | str | None) -> pb.GenerateResponse:
        choice = self.choices[index]
        output_ids = list(choice.detokenizer.output_token_ids)
        return complete_to_pb(index, output_ids, finish_reason, self.num_prompt_tokens, choice.num_cached_tokens,
                              self._logprobs_pb(output_ids, self._logprobs[index]), matched_stop)

    def _logprobs_pb(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> pb.OutputLogProbs | None:
        if self.num_top_logprobs is None:
            return None
        return output_logprobs_to_pb(token_ids, logprobs, self.num_top_logprobs)


def _matched_stop(choice: Choice, finish_reason: str) -> int | str | None:
    """What ended a "stop" choice: the stop string the detokenizer found, else the last token."""
    if finish_reason != "stop":
        return None
    if choice.detokenizer.stop_str is not None:
        return choice.detokenizer.stop_str
    output_ids = choice.detokenizer.output_token_ids
    return output_ids[-1] if output_ids else None
