"""The colocated baseline (Ray actor ``colocated-<i>``): one engine runs both phases, prompt
chunks mixed into decode batches (as vLLM does by default). Disaggregation is judged
against it; it speaks the same poll/cancel/stats API as the decode worker."""

from __future__ import annotations

from decode_worker.worker import EngineWorker
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from kv_transfer.errors import NoCapacityError


class ColocatedWorker(EngineWorker):
    def __init__(self, options: dict, name: str = "colocated-0") -> None:
        super().__init__(options, name)
        self.loop.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; its tokens arrive through ``poll``."""
        engine = self.engine
        with self.loop.lock:
            if engine.has_request(request_id):
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            busy = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            if busy >= engine.config.max_num_seqs:
                raise NoCapacityError(
                    f"{self.name} is at its limit of {engine.config.max_num_seqs} sequences"
                )
            engine.add_request(list(prompt_token_ids), params, request_id=request_id)
        self.loop.wake()

    def stats(self) -> dict:
        return self.engine_stats()
