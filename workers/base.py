"""What every worker actor is: an engine on its serving loop, with the Ray-facing calls they
all answer (info, calibrate, stats, kv_events, shutdown).

Subclasses give the loop its callbacks: ``on_result`` for each step's tokens, ``on_error``
when a step fails (end every request it held, with the error), and optionally a layer hook
or an intake (workers/serving_loop.py), then call ``self.loop.start()`` once ready.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch

from engine.kv_events import KVCursor, KVEvents
from engine.llm_engine import LLMEngine, StepResult
from engine.tp_group import TensorParallelError
from engine.tp_worker import FromRank, RankServiceFactory
from workers.messages import WorkerStats
from workers.options import WorkerOptions
from workers.serving_loop import LayerHook, ServingLoop

logger = logging.getLogger(__name__)


class WorkerBase:
    def __init__(
        self,
        options: dict,
        name: str,
        *,
        on_result: Callable[[StepResult], None],
        on_error: Callable[[Exception], None],
        layer_hook: LayerHook | None = None,
        intake: Callable[[], None] | None = None,
    ) -> None:
        options = WorkerOptions.from_dict(options)
        # kv.host auto → this node's IP, once, here where Ray can say it: the ranks 1..t-1
        # (children of this actor) and every handle this worker gives out carry it.
        self.options = dataclasses.replace(options, kv=options.kv.on_this_node())
        if self.options.torch_threads:
            torch.set_num_threads(self.options.torch_threads)
        self.name = name
        self.engine = LLMEngine(
            self.options.model,
            self.options.engine,
            progress=False,
            rank_service=self.rank_service(),
        )
        self._on_step_error = on_error
        self.loop = ServingLoop(
            self.engine,
            on_result,
            on_error=self._step_failed,
            layer_hook=layer_hook,
            intake=intake,
            name=name,
        )
        self.started_at = time.time()
        if self.tensor_parallel_size > 1:
            self.engine.listen_to_ranks(self._from_rank, self._rank_lost)

    @property
    def tensor_parallel_size(self) -> int:
        return self.options.engine.tensor_parallel_size

    def rank_service(self) -> RankServiceFactory | None:
        """What the engine's ranks 1..t-1 run beside the model (a subclass's KV side)."""
        return None

    def _from_rank(self, message: FromRank) -> None:
        """A message of a rank's service (on the engine's listener thread)."""
        logger.warning("%s: unexpected message from rank %d: %r", self.name, message.rank, message)

    def _rank_lost(self, rank: int) -> None:
        """A rank's process went away (on the listener thread): end the replica at once,
        as a failed step would, rather than when its next step or message finds it out."""
        self._step_failed(TensorParallelError(f"tensor-parallel rank {rank} exited"))

    def _step_failed(self, err: Exception) -> None:
        """A failed step ends its requests; a lost tensor-parallel rank ends the replica: its
        actor exits, so the router retries or migrates what it held and the controller
        replaces it whole (a replica with a rank missing cannot compute anything)."""
        if not isinstance(err, TensorParallelError):
            self._on_step_error(err)
            return
        logger.error("%s lost a tensor-parallel rank (%s): the replica exits", self.name, err)
        self.engine.close(force=True)
        os._exit(1)

    def info(self) -> dict:
        return {"name": self.name, "model": self.options.model, **self.engine.describe()}

    def calibrate(self) -> dict:
        """Measure this replica's capacity (briefly holds the engine: call at start-up,
        before traffic)."""
        from workers.calibration import measure_capacity

        with self.loop.lock:
            capacity = measure_capacity(self.engine)
            bm = self.engine.block_manager
            capacity["max_num_seqs"] = self.engine.config.max_num_seqs
            capacity["kv_tokens"] = bm.num_blocks * bm.block_size
        return capacity

    def worker_stats(self, **counters) -> WorkerStats:
        """The engine's load and the loop's counters, with a subclass's ``counters``."""
        with self.loop.lock:
            load = self.engine.load()
        return WorkerStats(
            name=self.name,
            load=load,
            steps=self.loop.steps,
            busy_s=self.loop.busy_s,
            uptime_s=time.time() - self.started_at,
            **counters,
        )

    def stats(self) -> WorkerStats:
        return self.worker_stats()

    def kv_events(self, since: KVCursor | None = None) -> KVEvents:
        """The prefix cache's block hashes stored and removed after ``since`` (the router's
        index polls it with the cursor of its last answer; None or a stale cursor: a
        snapshot). Called by Ray in the actor's thread; reads the log under the loop's lock."""
        with self.loop.lock:
            return self.engine.block_manager.events.since(since)

    def shutdown(self) -> None:
        self.loop.stop()  # under the loop's lock: no step is running after it
        self.engine.close()  # the tensor-parallel ranks, if any (before Ray kills the actor)
