"""The scheduler's connection to the worker: start-up handshake, then one stream of steps."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Sequence

import grpc

from services.common import worker_codec
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.service_auth import NO_SERVICE_AUTH, ServiceAuthConfig, open_channel

logger = logging.getLogger(__name__)


class WorkerUnavailable(Exception):
    """The worker cannot be reached or its stream broke: every in-flight request is lost."""


class WorkerStepError(Exception):
    """The worker is alive but this step failed (the message says why)."""


class WorkerClient:
    def __init__(self, address: str, interceptors: Sequence[Any] = (), auth: ServiceAuthConfig = NO_SERVICE_AUTH):
        self.address = address
        self._interceptors = list(interceptors)  # tracing: context in the handshake RPCs' metadata
        # This scheduler's certificate and/or the worker's token; the files are read at each connect,
        # so a reconnect presents a renewed certificate.
        self._auth = auth
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerServiceStub | None = None
        self._stream = None
        self._steps: worker_codec.StepEncoder | None = None  # this end of the stream, one per stream
        # Steps encoded by another rank's client (the sampling rank's), oldest first: this rank
        # answers them with acknowledgements only.
        self._copied_step_ids: deque[int] = deque()

    async def connect(self, timeout_s: float = 5.0) -> KVCacheSpec:
        """Opens the channel and asks the worker how big its KV cache can be."""
        await self.close()
        try:
            self._channel = open_channel(self.address, self._auth, CHANNEL_OPTIONS, self._interceptors)
        except ValueError as exc:  # a certificate file unreadable mid-rotation: retried like a lost worker
            raise WorkerUnavailable(f"worker at {self.address}: {exc}") from exc
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        try:
            response = await self._stub.DescribeKVCache(
                worker_pb2.DescribeKVCacheRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailable(f"worker at {self.address}: {exc.code().name} {exc.details()}") from exc
        return worker_codec.kv_cache_spec_from_pb(response)

    async def initialize(self, num_blocks: int, rendezvous_addr: str = "", generation: int = 0) -> None:
        """Allocates the worker's KV cache and opens the step stream; a tensor-parallel rank first
        forms group `generation` with the other ranks at `rendezvous_addr`."""
        assert self._stub is not None
        request = worker_pb2.InitializeKVCacheRequest(num_blocks=num_blocks, tensor_parallel_rendezvous_addr=rendezvous_addr,
                                                      tensor_parallel_generation=generation)
        try:
            await self._stub.InitializeKVCache(request, timeout=600)
            self._stream = self._stub.ExecuteModel()
            self._steps = worker_codec.StepEncoder()  # a new stream: nothing to refer to at either end
            self._copied_step_ids.clear()
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailable(f"worker at {self.address}: {exc.code().name} {exc.details()}") from exc

    async def submit(self, scheduler_output: SchedulerOutput) -> worker_pb2.ExecuteModelRequest:
        """Sends a step; the worker runs steps in the order they are sent, one output each. Returns the
        message sent, which `submit_copy` sends as is to the other tensor-parallel ranks."""
        if self._stream is None:
            raise WorkerUnavailable("no stream to the worker")
        request = worker_pb2.ExecuteModelRequest(scheduler_output=self._steps.encode(scheduler_output))
        await self._write(request)
        return request

    async def submit_copy(self, request: worker_pb2.ExecuteModelRequest) -> None:
        """Sends a step another rank's client encoded (every rank's stream carries the same messages
        from the same start); this rank's answer to it is an acknowledgement."""
        if self._stream is None:
            raise WorkerUnavailable("no stream to the worker")
        self._copied_step_ids.append(request.scheduler_output.step_id)
        await self._write(request)

    async def _write(self, request: worker_pb2.ExecuteModelRequest) -> None:
        try:
            await self._stream.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._stream = None
            raise WorkerUnavailable(f"worker stream broke: {exc}") from exc

    async def receive(self) -> ModelRunnerOutput:
        """The output of the oldest step sent and not yet received."""
        if self._stream is None:
            raise WorkerUnavailable("no stream to the worker")
        try:
            response = await self._stream.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._stream = None
            raise WorkerUnavailable(f"worker stream broke: {exc}") from exc
        if response is grpc.aio.EOF:
            self._stream = None
            raise WorkerUnavailable("worker closed the stream")
        try:
            if self._copied_step_ids:
                return worker_codec.decode_acknowledgement(response, self._copied_step_ids.popleft())
            return self._steps.decode_output(response)
        except worker_codec.StepFailed as exc:
            raise WorkerStepError(str(exc)) from None
        except ValueError as exc:  # an answer out of step: only a new stream can recover
            self._stream.cancel()
            self._stream = None
            raise WorkerUnavailable(f"worker stream out of step: {exc}") from exc

    def is_stream_open(self) -> bool:
        """False once the step stream has ended (the worker died or closed it)."""
        return self._stream is not None and not self._stream.done()

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
