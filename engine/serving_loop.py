"""Runs an LLMEngine on a background thread, for the serving workers.

Other threads (Ray actor calls, the KV receiver) change the engine only while holding
``lock``; the loop holds it for each step. ``wake()`` tells an idle loop there is work.
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


class ServingLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_result: Callable[[StepResult], None],
        *,
        on_error: Callable[[Exception], None] | None = None,
        layer_hook: LayerHook | None = None,
        name: str = "engine-loop",
    ) -> None:
        self.engine = engine
        self.lock = threading.RLock()
        self._on_result = on_result
        self._on_error = on_error
        self._layer_hook = layer_hook
        self._work = threading.Condition(self.lock)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self.lock:
            self._stopped = True
            self._work.notify_all()
        self._thread.join(timeout_s)

    def wake(self) -> None:
        with self.lock:
            self._work.notify_all()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self._stopped and not self.engine.has_unfinished():
                    self._work.wait(timeout=1.0)
                if self._stopped:
                    return
                try:
                    result = self.engine.step(self._layer_hook)
                    self.steps += 1
                    self._on_result(result)
                except Exception as err:  # noqa: BLE001 - reported, and the loop goes on
                    logger.exception("engine step failed")
                    if self._on_error is None:
                        raise
                    self._on_error(err)
            time.sleep(0)  # let callers waiting for the lock take it between steps
