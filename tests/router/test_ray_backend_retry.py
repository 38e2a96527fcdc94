"""RayBackend against fake actors (no Ray): a decode replica that gives a request up before
decoding it (its KV transfer failed: the stream broke, the lease expired) has the request
retried, whichever of that news and the prefill's own failure reaches the router first; an
error that is not retryable still ends the request."""

from __future__ import annotations

import asyncio

from tests.router.test_ray_backend_admission import FakeDecode, make_backend, request
from workers.messages import TokenBatch


class DecodeLosingTransfers(FakeDecode):
    """Gives up the first attempt of each request named in ``lose`` (as a decode worker does
    when the lease's transfer fails), with ``retryable`` as given."""

    def __init__(self, lose: set[str], retryable: bool = True) -> None:
        super().__init__(capacity=8)
        self.lose = lose
        self.retryable = retryable

    async def _poll(self, timeout_s: float) -> dict:
        out = {}
        for rid in [r for r in self.left if r.split("#")[0] in self.lose and r.endswith("#0")]:
            del self.left[rid]
            out[rid] = TokenBatch(
                finish_reason="error",
                error=f"decode-0: KV transfer for {rid} failed (stream broken)",
                retryable=self.retryable,
            )
        return out | await super()._poll(timeout_s)


def _run(decode: FakeDecode, rid: str, max_tokens: int = 4):
    async def run():
        backend, _ = make_backend(capacity=8)
        backend.replicas.by_name["decode-0"].handle = decode
        backend.replicas.by_name["prefill-0"].handle.decode = decode
        await backend.start()
        deltas = [delta async for delta in backend.generate(request(rid, max_tokens))]
        await backend.stop()
        return deltas, backend

    return asyncio.run(run())


def test_a_transfer_the_decode_replica_gave_up_is_retried_not_failed():
    decode = DecodeLosingTransfers({"lost"})
    deltas, backend = _run(decode, "lost")
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 4 and deltas[-1].finish_reason == "length"
    assert all(d.error is None for d in deltas)
    assert decode.reserved == ["lost#0", "lost#1"]
    assert backend.retries_total + backend.migrations_total == 1


def test_an_error_that_is_not_retryable_still_ends_the_request():
    decode = DecodeLosingTransfers({"bad"}, retryable=False)
    deltas, backend = _run(decode, "bad")
    assert deltas[-1].finish_reason == "error" and "stream broken" in deltas[-1].error
    assert decode.reserved == ["bad#0"]
    assert backend.retries_total == 0
