"""The colocated baseline (Ray actor ``colocated-<i>``): one engine runs both phases, prompt
chunks mixed into decode batches (as vLLM does by default). Disaggregation is judged
against it; it speaks the same poll/cancel/stats API as the decode worker."""

from __future__ import annotations

from decode_worker.worker import EngineWorker
from engine.sampling_params import SamplingParams
from engine.sequence import Fork
from kv_transfer.errors import NoCapacityError


class ColocatedWorker(EngineWorker):
    computes_prompts = True  # its finished batches say what its prefix cache served

    def __init__(self, options: dict, name: str = "colocated-0") -> None:
        super().__init__(options, name)
        self.loop.start()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        forks: tuple[Fork, ...] = (),
    ) -> None:
        """Queue a request (and ``forks``, sequences of the same prompt, prefilled with it);
        their tokens arrive through ``poll``."""
        engine = self.engine
        with self.loop.lock:
            engine.validate_request(prompt_token_ids, params, forks)
            busy = len(engine.request_ids())
            if busy + 1 + len(forks) > engine.config.max_num_seqs:
                raise NoCapacityError(
                    f"{self.name} is at its limit of {engine.config.max_num_seqs} sequences"
                )
            engine.add_request(list(prompt_token_ids), params, request_id, forks)
        self.loop.wake()
