"""The worker serves one scheduler at a time: while a step stream runs, a second client's
InitializeKVCache and ExecuteModel are refused with FAILED_PRECONDITION and the running stream goes
on untouched; once the stream ends (closed, or its connection dropped), a new scheduler may start."""
from __future__ import annotations

import queue
import time

import grpc
import pytest

from services.common import worker_codec
from services.common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.scheduler_lease import BUSY, SchedulerLease
from tests.worker.harness import hf_greedy
from tests.worker.test_server import InProcessServer

PROMPT = [11, 22, 33, 44, 55]
NUM_BLOCKS = 32


# --- the rule alone ----------------------------------------------------------------------------------
def test_one_stream_per_initialisation_from_the_same_connection():
    lease = SchedulerLease()
    assert lease.begin_stream("a") == (None, "ExecuteModel needs InitializeKVCache first, on the same connection")
    assert lease.begin_initialize() is None
    assert lease.begin_initialize() == "another scheduler is initialising the worker"
    assert lease.begin_stream("a")[1] is not None  # not while the initialisation runs
    lease.end_initialize("a", is_ok=True)
    assert lease.begin_stream("b")[1] is not None  # b did not initialise
    stream_id, refusal = lease.begin_stream("a")
    assert refusal is None and lease.is_streaming
    assert lease.begin_initialize() == BUSY and lease.begin_stream("a") == (None, BUSY)
    lease.end_stream(stream_id)
    assert not lease.is_streaming
    assert lease.begin_stream("a")[1] is not None  # the initialisation was used up
    assert lease.begin_initialize() is None
    lease.end_initialize("b", is_ok=True)
    second_id, refusal = lease.begin_stream("b")
    assert refusal is None
    lease.end_stream(stream_id)  # a late end of the first stream leaves the second alone
    assert lease.is_streaming
    lease.end_stream(second_id)


def test_a_failed_initialisation_opens_no_stream():
    lease = SchedulerLease()
    assert lease.begin_initialize() is None
    lease.end_initialize("a", is_ok=False)
    assert lease.begin_stream("a")[1] is not None


# --- over gRPC ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = WorkerConfig(worker_addr="127.0.0.1:0", model=str(tiny_llama_dir), served_model_name="tiny",
                          dtype="float32", kv_cache_bytes=2**20, block_size=4, max_num_seqs=8)
    srv = InProcessServer(config)
    yield srv.server
    srv.close()


class Scheduler:
    """One scheduler's connection: InitializeKVCache, then a step stream fed from a queue."""

    def __init__(self, address: str):
        # Its own connection, as a scheduler in another process has (channels in one process share
        # connections by default, and the worker tells schedulers apart by connection).
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.encoder = worker_codec.StepEncoder()
        self._outgoing: queue.Queue = queue.Queue()
        self.responses = None

    def initialize(self) -> None:
        self.stub.InitializeKVCache(worker_pb2.InitializeKVCacheRequest(num_blocks=NUM_BLOCKS), timeout=30)

    def open_stream(self) -> None:
        def requests():
            while (step := self._outgoing.get(timeout=60)) is not None:
                yield worker_pb2.ExecuteModelRequest(scheduler_output=self.encoder.encode(step))

        self.responses = self.stub.ExecuteModel(requests(), timeout=60)

    def step(self, scheduler_output: SchedulerOutput) -> int:
        """Sends a step and returns the one token it sampled for request "a"."""
        self._outgoing.put(scheduler_output)
        output = self.encoder.decode_output(next(self.responses))
        return output.sampled_token_ids[0][0]

    def end_stream(self) -> None:
        self._outgoing.put(None)
        assert list(self.responses) == []

    def close(self) -> None:
        self.channel.close()


def _prefill() -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", PROMPT, SamplingParams(temperature=0.0), [3, 4], 0)],
        num_scheduled_tokens={"a": len(PROMPT)}, total_num_scheduled_tokens=len(PROMPT), step_id=1)


def _decode(step_id: int, num_computed: int) -> SchedulerOutput:
    """The next token of "a" (the worker appends what it sampled; 8 tokens fit in its two blocks)."""
    return SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [num_computed], [[]]),
                           num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, step_id=step_id)


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value.code(), refused.value.details()


def _empty_stream(stub) -> list:
    return list(stub.ExecuteModel(iter([]), timeout=30))


def _wait_until_free(address: str, timeout_s: float = 30) -> "Scheduler":
    """A new scheduler, once the worker lets it initialise (the old stream's end is seen at once
    or shortly after, when the server notices the dropped connection)."""
    deadline = time.monotonic() + timeout_s
    newcomer = Scheduler(address)
    while True:
        try:
            newcomer.initialize()
            return newcomer
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_second_scheduler_is_refused_while_a_stream_runs_and_the_stream_is_untouched(server, tiny_llama_dir):
    expected = hf_greedy(tiny_llama_dir, PROMPT, 4)
    owner, rogue = Scheduler(server.address), Scheduler(server.address)
    try:
        owner.initialize()
        owner.open_stream()
        tokens = [owner.step(_prefill())]
        assert _refusal(rogue.initialize) == (grpc.StatusCode.FAILED_PRECONDITION, BUSY)
        assert _refusal(lambda: _empty_stream(rogue.stub)) == (grpc.StatusCode.FAILED_PRECONDITION, BUSY)
        # Not even the owner may reinitialise under its own running stream.
        assert _refusal(owner.initialize) == (grpc.StatusCode.FAILED_PRECONDITION, BUSY)
        for i in range(3):
            tokens.append(owner.step(_decode(2 + i, len(PROMPT) + i)))
        assert tokens == expected
        owner.end_stream()
        # Closed: the next scheduler initialises and streams.
        newcomer = _wait_until_free(server.address)
        newcomer.open_stream()
        assert newcomer.step(_prefill()) == expected[0]
        newcomer.end_stream()
        newcomer.close()
    finally:
        owner.close()
        rogue.close()


def test_a_stream_needs_its_own_connections_initialisation(server):
    first, second = Scheduler(server.address), Scheduler(server.address)
    try:
        first.initialize()
        code, details = _refusal(lambda: _empty_stream(second.stub))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitializeKVCache first" in details
        assert _empty_stream(first.stub) == []  # the initialiser's stream is accepted (and ends at once)
        code, _ = _refusal(lambda: _empty_stream(first.stub))  # one stream per initialisation
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        first.close()
        second.close()


def test_a_dropped_scheduler_connection_frees_the_worker(server):
    """As when a scheduler process dies mid-stream: its connection closes without ending the stream."""
    owner = Scheduler(server.address)
    owner.initialize()
    owner.open_stream()
    owner.step(_prefill())
    owner.close()  # no end of stream
    newcomer = _wait_until_free(server.address)
    try:
        newcomer.open_stream()
        newcomer.step(_prefill())
        newcomer.end_stream()
    finally:
        newcomer.close()
