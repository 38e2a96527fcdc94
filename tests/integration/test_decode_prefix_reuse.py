"""Reuse across the split, in one process (no Ray): a decode worker leases the blocks its own
prefix cache holds as they are and the prefill sends only the rest; a prompt with a short
enough remainder is prefilled on the decode worker itself. Tokens equal offline greedy."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.integration import test_workers_in_process as in_process
from tests.integration.test_workers_in_process import collect

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FIRST = [(i * 13) % 250 + 3 for i in range(70)]  # 4 full blocks and a partial one
workers = in_process.workers  # the same pair of in-process workers (a fixture)


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny", num_kv_blocks=64, progress=False)


def spy_first_blocks(prefill: PrefillWorker) -> list[int]:
    """The first block of every send the prefill worker makes, for layer 0."""
    starts: list[int] = []
    stream_open = prefill.kv.open

    def open_(*args, **kwargs):
        stream = stream_open(*args, **kwargs)
        original = stream.send_layers

        def send(first_layer, layer_count, block_ids, first_block=0):
            if first_layer == 0:
                starts.append(first_block)
            return original(first_layer, layer_count, block_ids, first_block)

        stream.send_layers = send
        return stream

    prefill.kv.open = open_
    return starts


def first_turn(prefill, decode) -> list[int]:
    reservation = decode.reserve("turn-1", FIRST, GREEDY)
    assert reservation.cached_tokens == 0 and reservation.kv.first_block == 0
    prefill.prefill("turn-1", FIRST, GREEDY, reservation)
    return collect(decode, "turn-1")


def test_the_lease_takes_cached_blocks_and_the_prefill_sends_only_the_rest(workers, offline):
    prefill, decode = workers
    answer = first_turn(prefill, decode)
    second = FIRST + answer + [(i * 7) % 250 + 3 for i in range(30)]
    starts = spy_first_blocks(prefill)
    reservation = decode.reserve("turn-2", second, GREEDY)
    # the first turn's prompt and answer: 82 tokens, 5 whole blocks cached on this replica
    assert reservation.kv.first_block == 5 and reservation.cached_tokens == 80
    prefill.prefill("turn-2", second, GREEDY, reservation)
    assert collect(decode, "turn-2") == offline.generate([second], GREEDY)[0].token_ids
    assert starts and min(starts) == 5  # nothing before the cached blocks went over
    stats = decode.stats()
    assert stats.decode.remote_prefills == 2 and stats.decode.reused_blocks == 5
    assert stats.load.free_blocks == stats.load.num_blocks  # every block back (cached)


def test_a_stream_that_would_resend_cached_blocks_is_refused(workers):
    prefill, decode = workers
    answer = first_turn(prefill, decode)
    second = FIRST + answer + [5, 6, 7]
    reservation = decode.reserve("resend", second, GREEDY)
    assert reservation.kv.first_block > 0
    wrong = dataclasses.replace(reservation, kv=dataclasses.replace(reservation.kv, first_block=0))
    with pytest.raises(Exception, match="starts at block 0"):
        prefill.prefill("resend", second, GREEDY, wrong)
    stats = decode.stats()
    assert stats.decode.leases == 0 and stats.load.free_blocks == stats.load.num_blocks


def test_a_short_remainder_is_prefilled_on_the_decode_replica(workers, offline):
    prefill, decode = workers
    answer = first_turn(prefill, decode)
    second = FIRST + answer + [9, 8, 7, 6]
    params = dataclasses.replace(GREEDY, logprobs=2)
    reservation = decode.reserve("local", second, params, local_prefill_limit=32)
    assert reservation.local and reservation.kv is None and reservation.cached_tokens == 80
    tokens, cached, logprobs = [], None, []
    while True:  # no prefill call: the decode replica computes the 6 tokens left itself
        delta = decode.poll(0.05).get("local")
        if delta is None:
            continue
        tokens += delta.token_ids
        logprobs += delta.logprobs or []
        if delta.finish_reason:
            cached = delta.num_cached_tokens
            break
    assert tokens == offline.generate([second], GREEDY)[0].token_ids
    assert cached == 80 and len(logprobs) == len(tokens)  # computed here: its own logprobs
    stats = decode.stats().decode
    assert (stats.local_prefills, stats.local_prefill_tokens) == (1, len(second) - 80)
    # 0 is never: the same prompt goes to a prefill replica
    assert not decode.reserve("remote", second, GREEDY, local_prefill_limit=0).local
    assert decode.cancel("remote")


def test_the_measured_limit(workers):
    prefill, decode = workers
    with decode.loop.lock:
        assert decode.local_prefill_limit() == 0  # no remote round trip measured yet
    answer = first_turn(prefill, decode)
    block = decode.engine.block_manager.block_size
    with decode.loop.lock:
        # a round trip measured, no prefill of its own yet: one block, to measure the rate
        assert decode.local_prefill_limit() == block
    second = FIRST + answer + [4, 4, 4]
    reservation = decode.reserve("auto", second, GREEDY, local_prefill_limit=None)
    assert reservation.local
    collect(decode, "auto")
    with decode.loop.lock:
        limit = decode.local_prefill_limit()
        cost = decode.engine.step_cost.estimate()
        round_trip = sorted(decode._round_trips)[len(decode._round_trips) // 4]
    expected = min(decode.engine.config.max_num_batched_tokens, int(round_trip / cost.per_token_s))
    assert cost.prompt_tokens > 0 and limit == expected
    assert decode.stats().decode.local_prefill_limit == limit


def test_the_routing_setting_is_validated():
    from router.config import RoutingConfig

    assert RoutingConfig().local_prefill_limit is None  # "auto": each replica's measure
    assert RoutingConfig(decode_local_prefill=0).local_prefill_limit == 0
    for bad in (-1, "sometimes", True, 1.5):
        with pytest.raises(ValueError, match="decode_local_prefill"):
            RoutingConfig(decode_local_prefill=bad)
