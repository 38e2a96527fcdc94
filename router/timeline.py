"""Where one request's time to first token goes: the points it passed on its way, as the
router saw them, and the prefill worker's own account of its part.

Stages, in order (seconds; each is 0 when it did not happen, e.g. in colocated mode):

- ``queue``: arrival at the router → its reservation call starts (admission, the line for
  decode capacity).
- ``reserve``: the reservation call (KV blocks on a decode replica; colocated: the submit).
- ``prefill_queue``: the prefill worker had the prompt but had not started it (other prompts
  ahead in its batch budget).
- ``prefill``: the prefill worker's compute of the prompt, every chunk, each layer's KV
  handed to the sender as it finished.
- ``kv_transfer``: the last frames reaching the decode replica and its acknowledgement,
  after the prefill's compute ended.
- ``prefill_rpc``: the rest of the prefill call (Ray dispatch and return).
- ``first_delivery``: from the prefill call's return (colocated: the submit's) to the first
  token reaching the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = (
    "queue",
    "reserve",
    "prefill_queue",
    "prefill",
    "kv_transfer",
    "prefill_rpc",
    "first_delivery",
)


@dataclass
class RequestTimeline:
    """``time.monotonic()`` instants of one attempt; set by the backend as they happen."""

    arrival: float
    reserve_started: float | None = None
    reserved: float | None = None
    prefill_sent: float | None = None
    prefill_returned: float | None = None
    first_token: float | None = None
    worker: dict[str, float] = field(default_factory=dict)  # prefill worker: wait/compute/finish

    def stages(self) -> dict[str, float]:
        """Each stage's seconds (all of STAGES). Sums to the TTFT when the first token came."""

        def span(start: float | None, end: float | None) -> float:
            return max(0.0, end - start) if start is not None and end is not None else 0.0

        wait = self.worker.get("wait_s", 0.0)
        compute = self.worker.get("compute_s", 0.0)
        # The decode replica's stream may bring the first token before the prefill call
        # returns (it waits for the receiver's acknowledgement): then the transfer's tail
        # and the call's return were not on the way, and count up to the first token only.
        returned = self.prefill_returned
        if returned is not None and self.first_token is not None:
            returned = min(returned, self.first_token)
        call = span(self.prefill_sent, returned)
        finish = min(self.worker.get("transfer_finish_s", 0.0), max(0.0, call - wait - compute))
        delivered_from = returned or self.reserved
        return {
            "queue": span(self.arrival, self.reserve_started),
            "reserve": span(self.reserve_started, self.reserved),
            "prefill_queue": wait,
            "prefill": compute,
            "kv_transfer": finish,
            "prefill_rpc": max(0.0, call - wait - compute - finish)
            + span(self.reserved, self.prefill_sent),
            "first_delivery": span(delivered_from, self.first_token),
        }
