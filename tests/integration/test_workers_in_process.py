"""The prefill and decode workers' own logic, in one process (no Ray): a long prompt's KV
ships chunk by chunk as its prefill chunks compute, a transfer lands while the decode engine
is busy stepping (it holds its lock for each whole step), and blocks a transport reads in
place stay held until it is through."""

from __future__ import annotations

import time

import pytest

from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.sequence import Fork
from kv_transfer.nixl_agent import nixl_unavailable
from kv_transfer.options import KVTransferOptions
from prefill_worker.worker import PrefillWorker
from workers.options import WorkerOptions

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def options(kv: dict | None = None, **engine) -> dict:
    return WorkerOptions(
        model="tiny",
        engine=EngineConfig(num_kv_blocks=128, **engine),
        kv=KVTransferOptions(token="in-process", wire_dtype="passthrough", **(kv or {})),
    ).to_dict()


@pytest.fixture
def workers():
    decode = DecodeWorker(options(), "decode-0")
    prefill = PrefillWorker(options(max_num_batched_tokens=32), "prefill-0")
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def collect(decode: DecodeWorker, request_id: str) -> list[int]:
    tokens = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        delta = decode.poll(0.05).get(request_id)
        if delta is not None:
            tokens += delta.token_ids
            if delta.finish_reason:
                return tokens
    raise AssertionError(f"{request_id} did not finish")


def collect_all(decode: DecodeWorker, request_ids: list[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    unfinished = set(request_ids)
    deadline = time.monotonic() + 30
    while unfinished and time.monotonic() < deadline:
        for request_id, delta in decode.poll(0.05).items():
            tokens[request_id] += delta.token_ids
            if delta.finish_reason:
                unfinished.discard(request_id)
    assert not unfinished, f"{unfinished} did not finish"
    return tokens


def test_a_long_prompt_streams_its_kv_chunk_by_chunk(workers):
    prefill, decode = workers
    prompt = [(i * 13) % 250 + 3 for i in range(150)]  # 5 chunks of at most 32 tokens
    sent = []

    def spy(stream_open):
        def open_(*args, **kwargs):
            stream = stream_open(*args, **kwargs)
            original = stream.send_layers  # the worker ships a step's layers in one call

            def send(first_layer, layer_count, block_ids, first_block=0):
                for layer in range(first_layer, first_layer + layer_count):
                    sent.append((layer, first_block, len(block_ids)))
                return original(first_layer, layer_count, block_ids, first_block)

            stream.send_layers = send
            return stream

        return open_

    prefill.kv.open = spy(prefill.kv.open)
    reservation = decode.reserve("long", prompt, GREEDY)
    result = prefill.prefill("long", prompt, GREEDY, reservation)
    tokens = collect(decode, "long")
    assert (
        tokens
        == LLM("tiny", num_kv_blocks=64, progress=False).generate([prompt], GREEDY)[0].token_ids
    )
    assert tokens[0] == result.first_token
    layer0 = [(start, n) for layer, start, n in sent if layer == 0]
    assert len(layer0) >= 4  # one send per chunk, not one at the end
    assert sum(n for _, n in layer0) == -(-len(prompt) // 16)
    assert [start for start, _ in layer0] == sorted(start for start, _ in layer0)


def test_a_transfer_lands_while_decode_steps_continuously(workers):
    prefill, decode = workers
    llm = LLM("tiny", num_kv_blocks=64, progress=False)
    busy = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i in range(8):  # keep the decode engine stepping the whole time
        prompt = [(i * 7 + j) % 250 + 3 for j in range(20)]
        reservation = decode.reserve(f"busy-{i}", prompt, busy)
        prefill.prefill(f"busy-{i}", prompt, busy, reservation)
    prompt = [(j * 5) % 250 + 3 for j in range(90)]
    started = time.monotonic()
    reservation = decode.reserve("probe", prompt, GREEDY)
    prefill.prefill("probe", prompt, GREEDY, reservation)
    assert collect(decode, "probe") == llm.generate([prompt], GREEDY)[0].token_ids
    assert time.monotonic() - started < 10
    for i in range(8):
        decode.cancel(f"busy-{i}")


def test_forks_decode_from_one_transfer_and_a_cancelled_one_is_left_out(workers):
    prefill, decode = workers
    prompt = [(j * 11) % 250 + 3 for j in range(37)]  # a shared partial last block
    seeded = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
        for seed in (1, 2, 3)
    ]
    forks = (Fork("f-1", seeded[1]), Fork("f-2", seeded[2]))
    reservation = decode.reserve("f-0", prompt, seeded[0], forks)
    assert decode.stats().decode.pending_sequences == 3
    assert decode.cancel("f-0")  # the request itself: its forks still decode
    result = prefill.prefill("f-0", prompt, seeded[0], reservation, forks=forks)
    assert len(result.first_tokens) == 3
    llm = LLM("tiny", num_kv_blocks=64, progress=False)
    tokens = collect_all(decode, ["f-0", "f-1", "f-2"])
    assert tokens["f-0"] == []  # cancelled
    for request_id, params in (("f-1", seeded[1]), ("f-2", seeded[2])):
        assert tokens[request_id] == llm.generate([prompt], params)[0].token_ids
    stats = decode.stats()
    assert stats.load.free_blocks == stats.load.num_blocks and stats.decode.pending_sequences == 0

    # Every member cancelled before the KV arrives: the lease goes, the transfer is refused.
    reservation = decode.reserve("g-0", prompt, seeded[0], (Fork("g-1", seeded[1]),))
    assert decode.cancel("g-1") and decode.cancel("g-0")
    assert decode.stats().decode.leases == 0
    with pytest.raises(Exception, match="lease|cancel"):
        prefill.prefill(
            "g-0",
            prompt,
            seeded[0],
            reservation,
            forks=(Fork("g-1", seeded[1]),),
        )
    stats = decode.stats()
    assert stats.load.free_blocks == stats.load.num_blocks


@pytest.mark.parametrize("burst_bytes, sent_as_done", [(0, True), (4 << 20, False)])
def test_layers_ship_as_they_finish_or_in_bursts(burst_bytes, sent_as_done):
    # kv.layer_burst_bytes 0: each layer's KV is handed to the sender as that layer ends;
    # the default (4 MiB, far more than a short prompt's KV here): all at the last layer.
    decode = DecodeWorker(options(), "decode-0")
    prefill = PrefillWorker(options({"layer_burst_bytes": burst_bytes}), "prefill-0")
    try:
        events = []
        real_hook = prefill.loop._layer_hook

        def hook(batch):
            layer_done = real_hook(batch)
            if layer_done is None:
                return None
            return lambda layer: (events.append(("done", layer)), layer_done(layer))

        prefill.loop._layer_hook = hook
        stream_open = prefill.kv.open

        def open_(*args, **kwargs):
            stream = stream_open(*args, **kwargs)
            send = stream.send_layers  # the worker ships each burst's layers in one call

            def send_layers(first_layer, layer_count, *a):
                events.extend(("sent", first_layer + i) for i in range(layer_count))
                return send(first_layer, layer_count, *a)

            stream.send_layers = send_layers
            return stream

        prefill.kv.open = open_
        prompt = [(j * 3) % 250 + 3 for j in range(40)]
        reservation = decode.reserve("burst", prompt, GREEDY)
        prefill.prefill("burst", prompt, GREEDY, reservation)
        layers = prefill.engine.model_config.num_layers
        as_done = [e for layer in range(layers) for e in (("done", layer), ("sent", layer))]
        in_one_burst = [("done", i) for i in range(layers)] + [("sent", i) for i in range(layers)]
        assert events == (as_done if sent_as_done else in_one_burst)
        expected = LLM("tiny", num_kv_blocks=64, progress=False).generate([prompt], GREEDY)
        assert collect(decode, "burst") == expected[0].token_ids
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))
def test_blocks_read_in_place_stay_held_until_their_transfer_is_through():
    # kv.transport nixl: the decode side READs the prefill cache's blocks where they are, so
    # the prefill worker must not reuse a shipped block (its sequence done) before then.
    decode = DecodeWorker(options({"transport": "nixl"}), "decode-0")
    prefill = PrefillWorker(options({"transport": "nixl"}, max_num_batched_tokens=32), "prefill-0")
    blocks = prefill.engine.block_manager
    try:
        shipped, at_finish = [], []
        stream_open = prefill.kv.open

        def open_(*args, **kwargs):
            stream = stream_open(*args, **kwargs)
            send, finish = stream.send_layer, stream.finish

            def send_layer(layer, block_ids, first_block=0):
                shipped.extend(block_ids.tolist())
                return send(layer, block_ids, first_block)

            def finish_(*a, **k):
                with prefill.loop.lock:  # the sequence is done: only the stream's hold is left
                    at_finish.extend(blocks.blocks[b].ref_count for b in set(shipped))
                return finish(*a, **k)

            stream.send_layer, stream.finish = send_layer, finish_
            return stream

        prefill.kv.open = open_
        prompt = [(j * 7) % 250 + 3 for j in range(70)]  # 3 chunks, 5 blocks
        reservation = decode.reserve("held", prompt, GREEDY)
        prefill.prefill("held", prompt, GREEDY, reservation)
        assert at_finish and all(count == 1 for count in at_finish)
        assert blocks.num_used_blocks == 0  # given back once the transfer was through
        expected = LLM("tiny", num_kv_blocks=64, progress=False).generate([prompt], GREEDY)
        assert collect(decode, "held") == expected[0].token_ids

        # A transfer the decode side refuses (its request cancelled): the blocks come back
        # too, once the reads under way ended or the drain passed.
        reservation = decode.reserve("gone", prompt, GREEDY)
        assert decode.cancel("gone")
        with pytest.raises(Exception, match="lease|cancel"):
            prefill.prefill("gone", prompt, GREEDY, reservation)
        deadline = time.monotonic() + 10
        while blocks.num_used_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert blocks.num_used_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()
