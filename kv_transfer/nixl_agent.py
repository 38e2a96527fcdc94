"""One NIXL agent (UCX underneath: shared memory or TCP between hosts' processes, RDMA, CUDA
IPC) as the NIXL transport uses it: memory registered once, peers added from their metadata,
READs from a peer's memory into ours, and the notifications a peer's READ leaves here.

NIXL is an optional extra (``pip install 'pdcluster[nixl]'``, the ``nixl-cu12`` wheel, which
also runs without a GPU): :func:`nixl_unavailable` says why it cannot be used, if it cannot.
Progress: NIXL's own progress thread spins on a core for the agent's whole life (on a 2-core
host, a worker's whole share), so the agent runs without it and this module progresses it
instead: a READ's initiator while it waits for the READ, and a thread of its own that polls
only while some of this agent's memory is held for peers to read (``hold``/``unhold``) or for
a while after (``linger``): over UCX's TCP transport a READ moves only while its target
progresses, so a target that stopped early would stall a READ already under way.
Thread-safety: the agent is made with NIXL's strict thread sync, so any thread may call.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from kv_transfer.errors import KVTransferError

# Between looks at peers reading held memory: a look (get_new_notifs) costs ~0.1-0.25 ms of
# CPU here, so looking every 50 us kept 40-66% of a core busy during READs of us; every
# 200 us, 26%, and a 4 MiB READ from another process went as fast (3.1 against 2.4-2.9 GB/s).
_POLL_S = 0.0002
# A READ's first look comes after about its time at this rate, the next ones ever less often:
# each look takes the GIL, which a busy engine thread holds for up to 5 ms at a time.
_EXPECTED_BYTES_PER_S = 3e9
_MAX_WAIT_S = 0.002
_CANCEL_TIMEOUT_S = 5.0  # a READ in flight that cannot be cancelled, waited for this long


@functools.cache
def _api():
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nixl_unavailable() -> str | None:
    """Why the NIXL transport cannot run here, or None if it can."""
    if _api() is None:
        return "NIXL is not installed: pip install 'pdcluster[nixl]' (the nixl-cu12 wheel)"
    return None


class NixlAgent:
    def __init__(self, role: str) -> None:
        api = _api()
        if api is None:
            raise KVTransferError(nixl_unavailable() or "NIXL is not installed", "UNAVAILABLE")
        self.name = f"pdcluster-{role}-{uuid.uuid4().hex[:12]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = api.nixl_agent(self.name, config)
        self._peers: dict[bytes, str] = {}  # metadata → peer name
        self._notes: list[bytes] = []  # notifications collected by the progress thread
        self._held = 0  # pieces of our memory peers are still to read
        self._linger_until = 0.0  # time.monotonic() to progress until, held or not
        self._cond = threading.Condition()
        self._closed = False
        self._progress = threading.Thread(target=self._progress_loop, daemon=True)
        self._progress.start()

    def hold(self) -> None:
        """A piece of our memory is waiting for a peer's READ: progress until ``unhold``."""
        with self._cond:
            self._held += 1
            self._cond.notify()

    def unhold(self, count: int = 1) -> None:
        with self._cond:
            self._held = max(0, self._held - count)

    def linger(self, seconds: float) -> None:
        """Progress for ``seconds`` more even if nothing is held: memory a peer may be reading
        was just given up (an aborted transfer's), and its READ must end, not stall."""
        with self._cond:
            self._linger_until = max(self._linger_until, time.monotonic() + seconds)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._progress.join(2.0)

    def _progress_loop(self) -> None:
        while True:
            with self._cond:
                while not self._held and not self._closed:
                    lingering = self._linger_until - time.monotonic()
                    if lingering > 0:
                        break
                    self._cond.wait()
                if self._closed:
                    return
            notes = self._collect()
            if notes:
                with self._cond:
                    self._notes += notes
            time.sleep(_POLL_S)

    def _collect(self) -> list[bytes]:
        # Asking for notifications progresses the agent's UCX workers.
        return [n for notes in self._agent.get_new_notifs().values() for n in notes]

    def register(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``'s memory readable by peers (and a target of our READs). Once per
        tensor: registration pins and maps the memory."""
        self._agent.register_memory(tensor)

    def metadata(self) -> bytes:
        """What a peer needs to READ this agent's registered memory (a few hundred bytes)."""
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        name = self._peers.get(metadata)
        if name is None:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[metadata] = name
        return name

    def read(
        self,
        peer: str,
        local,
        remote,
        notification: bytes,
        deadline: float,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Copy each remote (address, bytes) of ``peer`` into the local one of the same size
        (lists of pairs or [n, 2] arrays), then leave ``notification`` at the peer. Blocks
        until done; KVTransferError if the READ fails, ``deadline`` (time.monotonic) passes or
        ``cancelled()`` turns true first (the transfer it serves was given up), in which case
        the READ is aborted before the error is raised, so nothing of it lands after this
        returns."""
        local = np.asarray(local, dtype=np.uint64).reshape(-1, 2)
        remote = np.asarray(remote, dtype=np.uint64).reshape(-1, 2)

        def to_descs(pairs: np.ndarray):
            descs = np.zeros((len(pairs), 3), dtype=np.uint64)  # address, bytes, device 0
            descs[:, :2] = pairs
            return self._agent.get_xfer_descs(descs, "DRAM")

        handle = self._agent.initialize_xfer(
            "READ", to_descs(local), to_descs(remote), peer, notification
        )
        try:
            state = self._agent.transfer(handle)
            wait = int(local[:, 1].sum()) / _EXPECTED_BYTES_PER_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError("NIXL read timed out", "DEADLINE_EXCEEDED")
                if cancelled():
                    raise KVTransferError("NIXL read cancelled: its transfer ended", "CANCELLED")
                time.sleep(wait)
                wait = min(max(wait / 2, _POLL_S), _MAX_WAIT_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(f"NIXL read from {peer} failed ({state})", "UNAVAILABLE")
        finally:
            self._release(handle)

    def _release(self, handle) -> None:
        """Release a READ's handle, cancelling it if it is in flight. A READ UCX cannot cancel
        yet is waited for (it may still land), up to a bound past which the error is raised."""
        give_up = time.monotonic() + _CANCEL_TIMEOUT_S
        while True:
            try:
                self._agent.release_xfer_handle(handle)
                return
            except Exception:
                if time.monotonic() > give_up:
                    raise
            self._agent.check_xfer_state(handle)  # progresses the READ toward its end
            time.sleep(_POLL_S)

    def notifications(self) -> list[bytes]:
        """Notifications peers left here since the last call."""
        fresh = self._collect()
        with self._cond:
            notes, self._notes = self._notes + fresh, []
        return notes
