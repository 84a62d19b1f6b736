"""The tensor-parallel process group of one worker rank, formed at each scheduler handshake.

No environment variables and no global default group: the scheduler's InitializeKVCache names the
rendezvous (rank 0's host and port) and a group generation, new at every handshake. Rank 0 serves
the rendezvous store (a TCPStore kept for the process's life); every rank opens a client of it and
forms the group under a `PrefixStore` of the generation, so ranks that survived a peer's restart
meet it again under fresh keys. The backend follows the device: NCCL on a GPU, gloo on a CPU.

Every collective is bounded by `timeout_s`: one that fails (a peer died: gloo sees the connection
close) or times out (a peer hangs) raises `CollectiveError` and marks the group broken, so later
steps fail at once, without touching the network, until the next handshake forms a new group.
"""
from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer rank died or hangs); the group is unusable now.
    Not a fault of this rank's device: the worker does not count it towards being broken."""


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address {addr!r}: expected host:port")
    return host.strip("[]"), int(port)


class TensorParallelGroup:
    """One rank's membership; `rendezvous` (re)forms the group, the collectives run on it."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 local_host: str = ""):
        """`local_host`: the address this rank's collective connections bind to and advertise (the
        worker's listen host); a wildcard or empty host lets gloo pick the machine's hostname."""
        if not 0 <= rank < world_size:
            raise ValueError(f"tensor parallel rank {rank} out of range for size {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"tensor parallel timeout must be > 0, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.local_host = local_host
        self.generation = 0  # of the group formed last; 0 before the first
        self._server_store: dist.TCPStore | None = None  # rank 0: the rendezvous store it serves
        self._server_port = 0
        self._group = None  # the backend process group
        self._broken: str | None = None  # why the current group cannot be used
        self._lock = threading.Lock()

    @property
    def is_sampling_rank(self) -> bool:
        return self.rank == 0

    @property
    def backend_name(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def rendezvous(self, addr: str, generation: int) -> None:
        """Drops the old group and forms generation `generation`'s with the other ranks; blocks until
        every rank arrived (or raises CollectiveError after the timeout)."""
        host, port = _split_addr(addr)
        self.close()
        try:
            store = self._store(host, port)
            prefixed = dist.PrefixStore(f"spindle-tp/{generation}", store)
            group = self._new_backend(prefixed)
        except (RuntimeError, dist.DistError) as exc:
            self._broken = f"rendezvous of generation {generation} at {addr} failed: {exc}"
            raise CollectiveError(self._broken) from None
        with self._lock:
            self._group, self._broken, self.generation = group, None, generation
        logger.info("tensor parallel group generation %d formed (%s, rank %d of %d, rendezvous %s)",
                    generation, self.backend_name, self.rank, self.world_size, addr)

    def _store(self, host: str, port: int) -> dist.Store:
        if self.rank == 0:
            if self._server_store is None or self._server_port != port:
                self._server_store = dist.TCPStore(host, port, None, True, self.timeout, wait_for_workers=False)
                self._server_port = port
            return self._server_store
        # A new client each time: rank 0 may have restarted, and with it the store.
        return dist.TCPStore(host, port, None, False, self.timeout)

    def _new_backend(self, store: dist.Store):
        if self.backend_name == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [self._gloo_device()]
        return dist.ProcessGroupGloo(store, self.rank, self.world_size, options)

    def _gloo_device(self):
        host = self.local_host.strip("[]")
        if host in WILDCARD_HOSTS:
            return dist.ProcessGroupGloo.create_default_device()
        return dist.ProcessGroupGloo.create_device(hostname=host)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        self._run(lambda group: group.allreduce([tensor]), "all-reduce")
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s `tensor` on every rank, in place; returns it."""
        self._run(lambda group: group.broadcast(tensor, src), "broadcast")
        return tensor

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (the same shape and dtype on all) on rank `dst`, in rank order; None
        on the other ranks, which only send theirs."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == dst else []
        options = dist.GatherOptions()
        options.rootRank = dst
        self._run(lambda group: group.gather([parts] if parts else [], [tensor], options), "gather")
        return parts or None

    def _run(self, start, what: str) -> None:
        group = self._group
        if group is None or self._broken is not None:
            raise CollectiveError(self._broken or "no tensor parallel group formed yet (no handshake)")
        try:
            start(group).wait()
        except (RuntimeError, dist.DistError) as exc:
            self._broken = f"{what} failed in group generation {self.generation}: {exc}"
            raise CollectiveError(self._broken) from None

    def close(self) -> None:
        """Drops the current group (its connections close); the rendezvous store stays on rank 0."""
        with self._lock:
            self._group, self._broken = None, "the group was closed"
