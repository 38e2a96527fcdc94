"""How the router hands a request to the workers, per mode: disaggregated (reserve KV on a
decode replica, then a prefill replica computes the prompt and streams its KV there) or
colocated (one replica does both: submitting is the whole hand-off).

Called from the router's event loop; each call is one Ray call, its errors the actor's.
"""

from __future__ import annotations

from typing import Any

from engine.sequence import Fork
from router.backend import GenerateRequest
from workers.messages import Reservation
from workers.pool import Pool


class Disaggregated:
    decode_pool = Pool.DECODE  # where sequences decode (and hold their KV)
    prefill_pool = Pool.PREFILL  # where prompts are computed
    has_prefill_pool = True

    def __init__(self, local_prefill_limit: int | None = 0) -> None:
        self.local_prefill_limit = local_prefill_limit  # None: each decode replica's measure

    async def reserve(
        self, handle: Any, worker_rid: str, request: GenerateRequest, forks: tuple[Fork, ...]
    ) -> Reservation:
        """KV for the prompt on a decode replica, before any prefill: the reservation its
        prefill streams into (the router hands it on unread), or one saying the replica
        prefills it itself (``local``)."""
        return await handle.reserve.remote(
            worker_rid,
            request.prompt_token_ids,
            request.params,
            forks,
            local_prefill_limit=self.local_prefill_limit,
        )


class Colocated:
    decode_pool = prefill_pool = Pool.COLOCATED
    has_prefill_pool = False

    async def reserve(
        self, handle: Any, worker_rid: str, request: GenerateRequest, forks: tuple[Fork, ...]
    ) -> Reservation:
        """The request goes to the replica's engine whole: nothing to prefill elsewhere."""
        await handle.submit.remote(worker_rid, request.prompt_token_ids, request.params, forks)
        return Reservation()
