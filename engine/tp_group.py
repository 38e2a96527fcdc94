"""The ranks of one tensor-parallel engine and the two ways they talk.

- ``all_reduce``: the row-parallel layers' partial sums, over a torch.distributed process
  group of the replica's ranks alone (NCCL on CUDA, gloo on CPU), built from a TCPStore
  rather than the process-wide default group, so one process may host several engines. On
  CPU the ranks share a host, and the all-reduce goes through shared memory instead
  (engine.shm_allreduce): gloo costs ~1.3 ms per call here, 60 calls a step.
- ``send`` / ``receive``: rank 0 (the driver: it schedules and samples) hands every other
  rank each step's batch as a pickled message over its own socket
  (multiprocessing.connection, authenticated by a per-replica key). A socket rather than a
  collective because a worker waits there for as long as the engine is idle, which no
  collective timeout should bound, and because a dead driver is then an EOF, not a hang.

Who calls: the driver's engine (its model runner) and each worker rank's loop (tp_worker).
Every method is called from one thread per process, except ``listen``'s threads, which
only read the driver's sockets (the sending thread only writes them). Errors: a peer that
is gone raises ``TensorParallelError`` naming the rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
import torch.distributed as dist

from engine.errors import EngineError
from engine.shm_allreduce import ShmAllReduce

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # one all-reduce of one step


class TensorParallelError(EngineError):
    """A rank of a tensor-parallel engine failed or went away."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a replica's ranks meet: the driver's store and message socket (picklable; the
    driver creates it, every worker gets a copy)."""

    host: str
    store_port: int
    channel_port: int
    authkey: bytes
    size: int
    shm_path: str | None = None  # CPU: the shared file of the all-reduce


class TPGroup:
    """One rank's membership. ``TPGroup.single()`` is the tp = 1 group: no peers, no-ops."""

    def __init__(
        self,
        rank: int,
        size: int,
        process_group=None,
        workers: list[Connection] | None = None,
        driver: Connection | None = None,
        listener: Listener | None = None,
        store=None,
        shm: ShmAllReduce | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self._pg = process_group
        self._workers = workers or []  # the driver's connection to ranks 1..size-1
        self._driver = driver  # a worker's connection to rank 0
        self._listener = listener
        self._store = store  # the driver hosts the store the process group met through
        self._shm = shm
        self.stopping = False  # set before the workers are told to stop (their EOF is no loss)

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- set-up ---------------------------------------------------------------------------
    @staticmethod
    def rendezvous(
        size: int, device: torch.device, host: str = "127.0.0.1"
    ) -> tuple[Rendezvous, Any, Listener]:
        """The driver's side, before any worker starts: a store and a listening socket
        (and on CPU the all-reduce's shared file)."""
        store_port = _free_port(host)
        store = dist.TCPStore(
            host, store_port, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip
        authkey = secrets.token_bytes(16)
        listener = Listener((host, 0), authkey=authkey)
        channel_port = listener.address[1]
        shm_path = ShmAllReduce.create(size) if device.type == "cpu" else None
        meeting = Rendezvous(host, store_port, channel_port, authkey, size, shm_path)
        return meeting, store, listener

    @classmethod
    def join_as_driver(cls, meeting: Rendezvous, store, listener: Listener, device) -> TPGroup:
        """Rank 0: form the process group with every worker, then accept their sockets."""
        pg = _process_group(store, 0, meeting.size, device)
        workers: list[Connection | None] = [None] * (meeting.size - 1)
        for _ in range(meeting.size - 1):
            conn = listener.accept()
            _no_delay(conn)
            rank = conn.recv()
            workers[rank - 1] = conn
        shm = _shm(meeting, 0)
        if meeting.shm_path is not None:  # every rank has it mapped: nothing to leak on a crash
            os.unlink(meeting.shm_path)
        return cls(0, meeting.size, pg, workers, listener=listener, store=store, shm=shm)  # type: ignore[arg-type]

    @classmethod
    def join_as_worker(cls, meeting: Rendezvous, rank: int, device) -> TPGroup:
        store = dist.TCPStore(
            meeting.host, meeting.store_port, meeting.size, is_master=False,
            timeout=COLLECTIVE_TIMEOUT,
        )  # fmt: skip
        pg = _process_group(store, rank, meeting.size, device)
        shm = _shm(meeting, rank)  # mapped before the driver hears from us (it unlinks)
        driver = Client((meeting.host, meeting.channel_port), authkey=meeting.authkey)
        _no_delay(driver)
        driver.send(rank)
        return cls(rank, meeting.size, pg, driver=driver, shm=shm)

    def watch(self, peers_alive: Callable[[], bool]) -> None:
        """How this rank tells that a peer's process is gone (a collective waiting for it
        then fails at once instead of at its timeout)."""
        if self._shm is not None:
            self._shm.peers_alive = peers_alive

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it. Every rank calls it in the
        same order (the same layers of the same step)."""
        if self.size == 1:
            return tensor
        try:
            if self._shm is not None:
                self._shm.all_reduce(tensor)
            else:
                self._pg.allreduce([tensor]).wait()
        except (RuntimeError, EngineError) as err:
            raise TensorParallelError(f"tensor-parallel all-reduce failed: {err}") from None
        return tensor

    # ---- driver → workers -----------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Driver only: the same message to every worker rank."""
        for rank, conn in enumerate(self._workers, start=1):
            try:
                conn.send(message)
            except (OSError, EOFError) as err:
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone: {err}") from None

    def receive_from_workers(self) -> list[Any]:
        """Driver only: one message from each worker rank, in rank order."""
        replies = []
        for rank, conn in enumerate(self._workers, start=1):
            try:
                replies.append(conn.recv())
            except (OSError, EOFError):
                raise TensorParallelError(f"tensor-parallel rank {rank} exited") from None
        return replies

    def receive(self) -> Any:
        """Worker only: the driver's next message (waits as long as the engine is idle)."""
        try:
            return self._driver.recv()
        except (OSError, EOFError):
            raise TensorParallelError("the tensor-parallel driver (rank 0) is gone") from None

    def reply(self, message: Any) -> None:
        """Worker only: a message to the driver."""
        self._driver.send(message)

    def listen(self, deliver: Callable[[Any], None], on_lost: Callable[[int], None]) -> None:
        """Driver only, once the workers are ready: hand every later message from a worker
        to ``deliver`` (on one daemon thread per worker) until it goes away; a worker gone
        while the group is not ``stopping`` is ``on_lost(rank)`` (an idle engine would
        otherwise learn of it only at its next step)."""

        def read(rank: int, conn: Connection) -> None:
            while True:
                try:
                    message = conn.recv()
                except (OSError, EOFError):
                    if not self.stopping:
                        on_lost(rank)
                    return
                try:
                    deliver(message)
                except Exception:  # one bad message must not deafen the driver
                    logger.exception("message from tensor-parallel rank %d failed", rank)

        for rank, conn in enumerate(self._workers, start=1):
            name = f"tp-listen-rank{rank}"
            threading.Thread(target=read, args=(rank, conn), name=name, daemon=True).start()

    def close(self) -> None:
        for conn in [*self._workers, self._driver]:
            if conn is not None:
                conn.close()
        if self._listener is not None:
            self._listener.close()
        if self._shm is not None:
            self._shm.close()
        self._workers, self._driver, self._listener, self._pg, self._store = (
            [],
            None,
            None,
            None,
            None,
        )


def _no_delay(conn: Connection) -> None:
    """Each step's plan goes out at once: without this, Nagle holds it until the previous
    one's (delayed) ACK, ~20 ms a step here."""
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _shm(meeting: Rendezvous, rank: int) -> ShmAllReduce | None:
    if meeting.shm_path is None:
        return None
    timeout = COLLECTIVE_TIMEOUT.total_seconds()
    return ShmAllReduce(meeting.shm_path, rank, meeting.size, timeout)


def _process_group(store, rank: int, size: int, device: torch.device):
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, COLLECTIVE_TIMEOUT)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
