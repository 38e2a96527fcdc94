"""Runs an LLMEngine on a background thread, for the serving workers.

Other threads (Ray actor calls, the KV receiver) change the engine only while holding
``lock``; the loop holds it for each step and lets waiting callers in between steps.
``wake()`` tells an idle loop there is work; it never waits for a step (the KV receiver
calls it when a transfer completes, and its reply to the sender must not wait for decode). ``intake``, if given, runs on the loop thread
with the lock held before every step: work handed over by threads that must not wait for a
step themselves (the KV receiver's arrived requests).
Every step's result goes to ``on_result`` (called on the loop thread, with the lock held).
An exception inside a step is handed to ``on_error`` and the loop keeps serving: one bad
batch must not take the worker down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.llm_engine import LLMEngine, StepResult
from engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

LayerHook = Callable[[ScheduledBatch], Callable[[int], None] | None]


class CallerFirstLock:
    """A re-entrant lock that the engine loop hands over between steps whenever another
    thread is waiting for it (a plain RLock is unfair: the loop could re-take it at once,
    step after step, and starve a reservation or a poll)."""

    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self._count = threading.Lock()
        self.waiting = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self._count:
            self.waiting += 1
        try:
            return self.rlock.acquire(blocking, timeout)
        finally:
            with self._count:
                self.waiting -= 1

    def release(self) -> None:
        self.rlock.release()

    def __enter__(self) -> CallerFirstLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ServingLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_result: Callable[[StepResult], None],
        *,
        on_error: Callable[[Exception], None] | None = None,
        layer_hook: LayerHook | None = None,
        intake: Callable[[], None] | None = None,
        name: str = "engine-loop",
    ) -> None:
        self.engine = engine
        self.lock = CallerFirstLock()
        self._on_result = on_result
        self._on_error = on_error
        self._layer_hook = layer_hook
        self._intake = intake
        self._wakeup = threading.Event()  # set by wake(): work may be waiting
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        self.busy_s = 0.0  # wall time spent in steps (prompt tokens / busy_s = prefill speed)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self.lock:
            self._stopped = True
            self._wakeup.set()
        self._thread.join(timeout_s)

    def wake(self) -> None:
        self._wakeup.set()

    def _run(self) -> None:
        while True:
            with self.lock.rlock:  # the loop's own hold is not counted as waiting
                if self._stopped:
                    return
                if self._intake is not None:
                    self._intake()
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        started = time.perf_counter()
                        result = self.engine.step(self._layer_hook)
                        self.busy_s += time.perf_counter() - started
                        self.steps += 1
                        self._on_result(result)
                    except Exception as err:  # noqa: BLE001 - reported, and the loop goes on
                        logger.exception("engine step failed")
                        if self._on_error is None:
                            raise
                        self._on_error(err)
            if not busy:
                # Work is handed over before its wake-up, so a wake-up after the check above
                # ends this wait at once; clearing after it drops only wake-ups seen already.
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            # Between steps, callers waiting for the lock go first.
            while self.lock.waiting:
                time.sleep(0.0001)
