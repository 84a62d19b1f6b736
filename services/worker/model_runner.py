"""The model runner: applies each step's SchedulerOutput diff to the persistent batch, builds the
flat inputs, runs the model and samples.

Per step (`execute_model`):
1. drop finished requests, take preempted ones out of the batch (their state is kept for a resume);
2. add new requests; for cached ones append new blocks and take the scheduler's num_computed_tokens
   (a resumed request replaces its block table and, if sent, its tokens);
3. for the requests in `num_scheduled_tokens` order, build input ids, positions, slot mapping,
   query start locations, sequence lengths and block tables;
4. forward; logits only for the last scheduled token of requests whose computed tokens reach the
   end of their known tokens (a partial prefill chunk samples nothing); an all-greedy step on a
   head with a greedy screen takes its tokens from the screen instead (layers/greedy_head.py);
5. sample, and append each sampled token to its request: the scheduler never resends them. The
   runner never advances a count itself: every step brings the scheduler's. Rows with an output
   constraint get their grammar's bitmask applied to the logits first, and their grammar advances
   by the token sampled (structured_output/).

A request whose inputs would make the step raise (input_checks.py: token ids, block ids, lengths)
fails alone: it leaves the batch, is reported in `failed_reqs`, and the step runs without it; the
runner skips it in the steps already sent until the scheduler reports it finished. A step that
raises anywhere else fails as a whole (the server answers it with an error).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from services.common.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata
from services.worker.config import RunnerConfig
from services.worker.input_batch import CachedRequestState, InputBatch
from services.common.grammars import GrammarError
from services.worker.input_checks import RequestInputError, check_block_ids, check_new_request, check_tokens
from services.worker.kv_cache import KVCacheLayout, allocate_kv_caches
from services.worker.sampler import Sampler, TorchSampler, argmax_only
from services.worker.sampling_metadata import SamplingMetadata, build_sampling_metadata
from services.worker.structured_output.grammar_compiler import GrammarCompiler
from services.worker.parallel.process_group import CollectiveError
from services.worker.structured_output.grammar_state import GrammarBitmask, GrammarState

if TYPE_CHECKING:
    from services.worker.parallel import TensorParallelGroup

# An idle step with compiles running waits this long for one to finish before it answers.
MAX_GRAMMAR_WAIT_S = 0.005
# Tensor parallelism: what the sampling rank broadcasts for a request that failed at sampling, and
# for a step whose sampling raised.
FAILED_TOKEN = -1
STEP_FAILED_TOKEN = -2


@dataclass(frozen=True)
class ModelInputs:
    req_ids: list[str]  # batch order
    rows: np.ndarray  # persistent-batch row of each request
    num_scheduled_tokens: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: object
    sample_indices: np.ndarray  # which requests (batch indices) sample this step
    logits_indices: torch.Tensor  # their last tokens in the flat batch


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: RunnerConfig,
        device: torch.device,
        attn_backend: AttentionBackend,
        kv_cache_layout: KVCacheLayout,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        sampler: Sampler | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        tp_group: TensorParallelGroup | None = None,
    ):
        """`tp_group`: this rank's tensor-parallel group. Every rank runs the forward on its shard and
        computes the logits of its vocabulary slice, gathered to the sampling rank (0); only that
        rank samples and keeps grammars, and it broadcasts the step's sampled tokens so the other
        ranks append the same tokens to their requests."""
        self.model = model
        self.tp_group = tp_group
        self.is_sampling_rank = tp_group is None or tp_group.is_sampling_rank
        self.config = config
        self.device = device
        self.attn_backend = attn_backend
        self.kv_cache_layout = kv_cache_layout
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = sampler or TorchSampler()
        # Without one (a model with no tokenizer), every constraint fails to compile.
        self.grammar_compiler = grammar_compiler or GrammarCompiler(None, vocab_size, self.eos_token_ids)
        self.grammar_bitmask = GrammarBitmask(config.max_num_seqs, vocab_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, config.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        # Failed here, not yet reported finished by the scheduler: steps sent meanwhile still name them.
        self.failed_req_ids: set[str] = set()

    # --- lifecycle ------------------------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int) -> int:
        """Allocates `num_blocks` blocks per layer, binds them to the attention layers and drops all
        request state (a new scheduler starts from an empty cache). Returns the bytes allocated."""
        self.reset()
        self.kv_caches = []  # free the old cache before allocating the new one
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches = allocate_kv_caches(self.kv_cache_layout, num_blocks, self.attn_backend, self.device)
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.num_blocks = num_blocks
        return num_blocks * self.kv_cache_layout.bytes_per_block

    def reset(self) -> None:
        self.requests.clear()
        self.input_batch.clear()
        self.failed_req_ids.clear()

    # --- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter_ns()
        if not self.kv_caches:
            raise RuntimeError("KV cache not initialised: InitializeKVCache must come first")
        failed: dict[str, str] = {}
        if scheduler_output.grammars_to_compile and self.is_sampling_rank:
            self.grammar_compiler.submit(scheduler_output.grammars_to_compile)
        self._update_states(scheduler_output, failed)
        inputs = self._prepare_inputs(scheduler_output, failed)
        if inputs is None:
            compiled, failed_grammars = self.grammar_compiler.take_results(wait_s=MAX_GRAMMAR_WAIT_S)
            return ModelRunnerOutput(step_id=scheduler_output.step_id, prepare_ns=time.perf_counter_ns() - start,
                                     failed_reqs=failed, compiled_grammar_keys=compiled,
                                     failed_grammars=failed_grammars)
        prepared = time.perf_counter_ns()
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        logits = greedy = metadata = None
        if len(inputs.sample_indices):
            hidden_states = hidden_states[inputs.logits_indices]
            if self.tp_group is None and self.model.has_greedy_head_screen and not self.input_batch.num_grammar_rows:
                metadata = self._sampling_metadata(inputs)
                if argmax_only(metadata):  # every row greedy, nothing else reads the logits
                    greedy = self.model.compute_greedy_tokens(hidden_states)  # None: a row not finite
            if greedy is None:
                # Tensor parallel: every rank computes its vocabulary slice; None but on the sampling rank.
                logits = self.model.compute_logits(hidden_states)
        forwarded = time.perf_counter_ns()
        sampled = [[] for _ in inputs.req_ids]
        logprobs = [None] * len(inputs.req_ids)
        if greedy is not None:
            for i, row, token_id in zip(inputs.sample_indices.tolist(), inputs.rows[inputs.sample_indices].tolist(),
                                        greedy.tolist(), strict=True):
                self.input_batch.append_token(row, token_id)
                sampled[i] = [token_id]
        elif self.tp_group is not None and len(inputs.sample_indices):
            self._sample_across_ranks(inputs, logits, sampled, logprobs, failed)
        elif logits is not None:
            self._sample(inputs, logits, sampled, logprobs, failed, metadata)
        done = time.perf_counter_ns()
        compiled, failed_grammars = self.grammar_compiler.take_results()
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prepare_ns=prepared - start,
            forward_ns=forwarded - prepared,
            sample_ns=done - forwarded,
            step_id=scheduler_output.step_id,
            failed_reqs=failed,
            compiled_grammar_keys=compiled,
            failed_grammars=failed_grammars,
        )

    def _update_states(self, scheduler_output: SchedulerOutput, failed: dict[str, str]) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        if self.failed_req_ids:
            self.failed_req_ids.difference_update(scheduler_output.finished_req_ids)
        for req_id in scheduler_output.preempted_req_ids:
            batch.remove_request(req_id)  # state kept: it comes back as a resumed cached request
        for new in scheduler_output.scheduled_new_reqs:
            try:
                self._add_new_request(new)
            except RequestInputError as exc:
                self._fail_request(new.req_id, str(exc), failed)
        cached = scheduler_output.scheduled_cached_reqs
        rows = batch.req_id_to_index
        for i, (req_id, new_block_ids, num_computed, is_resumed) in enumerate(zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.resumed_from_preemption,
                strict=True)):
            row = rows.get(req_id)
            if row is None or is_resumed:
                try:
                    self._add_cached_request(cached, i)
                except RequestInputError as exc:
                    self._fail_request(req_id, str(exc), failed)
                continue
            # The common case, a running request's delta: a block now and then, and its count.
            if new_block_ids:
                try:
                    check_block_ids(new_block_ids, int(batch.block_table.num_blocks_per_row[row]), self.num_blocks,
                                    batch.block_table.max_num_blocks_per_req)
                except RequestInputError as exc:
                    self._fail_request(req_id, str(exc), failed)
                    continue
                batch.append_block_ids(row, new_block_ids)
            batch.set_num_computed_tokens(row, num_computed)
        batch.condense()

    def _add_new_request(self, new: NewRequestData) -> None:
        check_new_request(new, self.vocab_size, self.num_blocks, self.config.max_model_len,
                          self.input_batch.block_table.max_num_blocks_per_req)
        seed = new.sampling_params.seed
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            generator=torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            grammar=self._new_grammar_state(new),
        )
        self.requests[new.req_id] = state
        self.input_batch.add_request(state)

    def _add_cached_request(self, cached: CachedRequestData, i: int) -> None:
        """(Re)builds the row of a held request that is resumed or out of the batch."""
        req_id = cached.req_ids[i]
        state = self.requests.get(req_id)
        if state is None:
            if req_id in self.failed_req_ids:
                return  # failed in an earlier step; the scheduler has not heard yet
            raise ValueError(f"scheduler sent cached request {req_id!r} that this worker does not hold")
        new_block_ids = cached.new_block_ids[i]
        num_computed = cached.num_computed_tokens[i]
        max_num_blocks = self.input_batch.block_table.max_num_blocks_per_req
        if cached.resumed_from_preemption[i]:  # recomputed from scratch in new blocks; resent tokens are the truth
            tokens = cached.resumed_token_ids[i] if i < len(cached.resumed_token_ids) else []
            if tokens:
                check_tokens(tokens, num_computed, self.vocab_size, self.config.max_model_len)
            check_block_ids(new_block_ids, 0, self.num_blocks, max_num_blocks)
            state.block_ids = list(new_block_ids)
            if tokens:
                state.output_token_ids = list(tokens[len(state.prompt_token_ids) :])
            if state.grammar is not None:  # a token sampled in flight may have been dropped
                state.grammar.sync_to(len(state.output_token_ids))
        else:
            check_block_ids(new_block_ids, len(state.block_ids), self.num_blocks, max_num_blocks)
            state.block_ids.extend(new_block_ids)
        state.num_computed_tokens = num_computed
        self.input_batch.add_request(state)  # (re)builds the whole row from the state

    def _new_grammar_state(self, new: NewRequestData) -> GrammarState | None:
        params = new.sampling_params.structured_outputs
        if params is None or not self.is_sampling_rank:
            return None
        try:
            return GrammarState(self.grammar_compiler.get(params))
        except GrammarError as exc:
            raise RequestInputError(f"structured_outputs: {exc}") from None

    def _fail_request(self, req_id: str, reason: str, failed: dict[str, str]) -> None:
        """The request leaves the batch and the runner; the scheduler hears why in this step's output."""
        self.requests.pop(req_id, None)
        self.input_batch.remove_request(req_id)
        self.failed_req_ids.add(req_id)
        failed[req_id] = reason

    def _prepare_inputs(self, scheduler_output: SchedulerOutput, failed: dict[str, str]) -> ModelInputs | None:
        batch = self.input_batch
        scheduled = [(r, n) for r, n in scheduler_output.num_scheduled_tokens.items() if n > 0]
        if self.failed_req_ids:
            scheduled = [(r, n) for r, n in scheduled if r not in self.failed_req_ids]
        if not scheduled:
            return None
        req_ids = [r for r, _ in scheduled]
        try:
            rows = np.array([batch.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        except KeyError as exc:
            raise ValueError(f"request {exc.args[0]!r} scheduled but unknown to this worker") from None
        num_scheduled = np.array([n for _, n in scheduled], dtype=np.int64)
        num_computed = batch.num_computed_tokens_cpu[rows]
        num_tokens = batch.num_tokens[rows]
        seq_lens = num_computed + num_scheduled
        # Every token the step computes must be known, inside max_model_len, and have a block.
        capacity = np.minimum(num_tokens, batch.block_table.num_blocks_per_row[rows] * self.config.block_size)
        is_bad = (seq_lens > capacity) | (seq_lens > self.config.max_model_len) | (num_computed < 0)
        if is_bad.any():
            for i in np.flatnonzero(is_bad).tolist():
                self._fail_request(req_ids[i], (
                    f"{int(num_computed[i])} computed + {int(num_scheduled[i])} scheduled tokens exceed the "
                    f"{int(num_tokens[i])} tokens the worker knows or the "
                    f"{int(batch.block_table.num_blocks_per_row[rows[i]])} blocks it holds"), failed)
            keep = ~is_bad
            if not keep.any():
                return None
            req_ids = [r for r, k in zip(req_ids, keep.tolist()) if k]
            rows, num_scheduled, num_computed, num_tokens, seq_lens = (
                rows[keep], num_scheduled[keep], num_computed[keep], num_tokens[keep], seq_lens[keep])
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_total = int(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = num_computed[req_of_token] + np.arange(num_total) - query_start_loc[req_of_token]
        token_rows = rows[req_of_token]
        input_ids = batch.token_ids_cpu[token_rows, positions]
        slot_mapping = batch.block_table.compute_slot_mapping(token_rows, positions)
        max_num_blocks = -(-int(seq_lens.max()) // self.config.block_size)
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(self.device),
            seq_lens=torch.from_numpy(seq_lens).to(self.device),
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            block_table=batch.block_table.get_tensor(rows, max_num_blocks).to(self.device),
            block_size=self.config.block_size,
            query_lens_cpu=num_scheduled.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        sample_indices = np.flatnonzero(seq_lens == num_tokens)
        return ModelInputs(
            req_ids=req_ids,
            rows=rows,
            num_scheduled_tokens=num_scheduled,
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            attn_metadata=self.attn_backend.build_metadata(common),
            sample_indices=sample_indices,
            logits_indices=torch.from_numpy(query_start_loc[1:][sample_indices] - 1).to(self.device),
        )

    def _sampling_metadata(self, inputs: ModelInputs) -> SamplingMetadata:
        return build_sampling_metadata(self.input_batch, inputs.rows[inputs.sample_indices], self.eos_token_ids,
                                       self.vocab_size, self.device)

    def _sample(self, inputs: ModelInputs, logits: torch.Tensor, sampled: list, logprobs: list,
                failed: dict[str, str], metadata: SamplingMetadata | None = None) -> None:
        rows = inputs.rows[inputs.sample_indices]
        if metadata is None:
            metadata = self._sampling_metadata(inputs)
        grammars = None
        if self.input_batch.num_grammar_rows:
            grammars = [self.input_batch.requests[row].grammar for row in rows.tolist()]
            logits = self._apply_grammars(logits, grammars)
        output = self.sampler(logits, metadata)
        for j, (i, row, token_id, token_logprobs) in enumerate(zip(
                inputs.sample_indices.tolist(), rows.tolist(), output.sampled_token_ids, output.logprobs, strict=True)):
            if grammars is not None and grammars[j] is not None and not grammars[j].accept(token_id):
                # Every token the grammar allows was forbidden (min_tokens or a logit bias of -inf).
                self._fail_request(inputs.req_ids[i], "structured_outputs: the grammar allows no token the "
                                   "request's other settings (min_tokens, logit_bias) permit here", failed)
                continue
            self.input_batch.append_token(row, token_id)
            sampled[i] = [token_id]
            logprobs[i] = token_logprobs

    def _sample_across_ranks(self, inputs: ModelInputs, logits: torch.Tensor | None, sampled: list,
                             logprobs: list, failed: dict[str, str]) -> None:
        """Rank 0 samples and broadcasts one token per sampling request (FAILED_TOKEN where the request
        failed, STEP_FAILED_TOKEN everywhere when sampling raised, so no rank waits for it in vain);
        the other ranks append the same tokens and fail the same requests."""
        tokens = torch.empty(len(inputs.sample_indices), dtype=torch.int64, device=self.device)
        if self.is_sampling_rank:
            try:
                self._sample(inputs, logits, sampled, logprobs, failed)
            except Exception:
                self.tp_group.broadcast(tokens.fill_(STEP_FAILED_TOKEN))
                raise
            tokens.copy_(torch.tensor([sampled[i][0] if sampled[i] else FAILED_TOKEN
                                       for i in inputs.sample_indices.tolist()]))
            self.tp_group.broadcast(tokens)
            return
        received = self.tp_group.broadcast(tokens).tolist()
        if received and received[0] == STEP_FAILED_TOKEN:
            raise CollectiveError("the sampling rank failed this step")
        rows = inputs.rows[inputs.sample_indices].tolist()
        for i, row, token_id in zip(inputs.sample_indices.tolist(), rows, received, strict=True):
            if token_id == FAILED_TOKEN:
                self._fail_request(inputs.req_ids[i], "failed on the sampling rank", failed)
                continue
            self.input_batch.append_token(row, token_id)
            sampled[i] = [token_id]

    def _apply_grammars(self, logits: torch.Tensor, grammars: list[GrammarState | None]) -> torch.Tensor:
        """Masks what each constrained row's grammar forbids (float32 logits, in place)."""
        bitmask, row_indices = self.grammar_bitmask.fill(grammars)
        logits = logits.float()
        if row_indices:
            self.sampler.apply_token_bitmask(logits, bitmask, row_indices)
        return logits
