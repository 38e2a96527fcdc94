"""End to end with the real engine: one engine prefills a prompt and streams each layer's
blocks from the model's ``layer_done`` hook while later layers compute; a second engine
receives them under a lease. This is the prefill worker's pattern."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import KVReceiverServer, KVSender, LeaseTable

TOKEN = "e2e-token"


@pytest.fixture(scope="module")
def engines():
    make = lambda kv: LLMEngine(
        "tiny", EngineConfig(num_kv_blocks=64, kv_cache_dtype=kv), progress=False
    )
    return make("auto"), make("auto"), make("fp8")


def _prefill_and_stream(engine: LLMEngine, sender: KVSender, lease, wire: str):
    """Prefill ``lease.request_id``'s prompt on ``engine``, streaming KV layer by layer."""
    seq = engine.add_request(
        list(range(3, 3 + lease.num_tokens)),
        SamplingParams(max_tokens=1, temperature=0),
        request_id=lease.request_id,
    )
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.seqs == [seq]
    ids, pos, meta, rows, _ = engine.runner.prepare(batch)
    cache = engine.cache
    stream = sender.open(
        lease.request_id,
        lease.lease_id,
        engine.model_config.fingerprint(),
        cache.block_size,
        seq.num_prompt_tokens,
        cache.num_layers,
        wire,
        cache.dtype,
    )
    table = torch.tensor(seq.block_table, device=cache.device)
    sent_layers = []

    def layer_done(layer: int) -> None:
        # Gather this sequence's blocks (a copy, so later writes cannot race the send).
        scales = ()
        if cache.is_fp8:
            scales = (cache.k_scale[layer][table], cache.v_scale[layer][table])
        stream.send_layer(layer, cache.k[layer][table], cache.v[layer][table], *scales)
        sent_layers.append(layer)

    hidden = engine.model(ids, pos, meta, cache, layer_done=layer_done)
    first_token = int(engine.model.compute_logits(hidden[rows]).argmax(-1)[0])
    result = stream.finish(first_token)
    assert sent_layers == list(range(cache.num_layers))
    return seq, first_token, result


def _serve(engine: LLMEngine, on_complete):
    lock = threading.RLock()
    leases = LeaseTable(engine.block_manager, lock, default_timeout_s=10, on_complete=on_complete)
    server = KVReceiverServer(engine.cache, leases, engine.model_config.fingerprint(), token=TOKEN)
    server.start()
    return leases, server


def test_engine_to_engine_passthrough_is_bit_identical(engines):
    prefill, decode, _ = engines
    done = []
    leases, server = _serve(decode, done.append)
    try:
        lease = leases.reserve("e2e-1", 37)  # 3 blocks, the last one partial
        with KVSender(server.address, TOKEN) as sender:
            seq, first_token, result = _prefill_and_stream(prefill, sender, lease, "passthrough")
        assert done == [lease] and lease.first_token == first_token
        src = torch.tensor(seq.block_table)
        dst = torch.tensor(lease.block_ids)
        for a, b in ((prefill.cache.k, decode.cache.k), (prefill.cache.v, decode.cache.v)):
            # Every row of every block, stale tail rows included: the pages are copied as-is.
            assert torch.equal(a[:, src].view(torch.uint8), b[:, dst].view(torch.uint8))
        assert result.payload_bytes == server.stats.bytes_received
    finally:
        server.stop(0)
        prefill.abort("e2e-1")


def test_engine_to_fp8_engine(engines):
    prefill, _, decode_fp8 = engines
    leases, server = _serve(decode_fp8, None)
    try:
        lease = leases.reserve("e2e-2", 40)
        with KVSender(server.address, TOKEN) as sender:
            seq, _, result = _prefill_and_stream(prefill, sender, lease, "fp8")
        assert lease.state == "complete"
        assert result.payload_bytes < 0.3 * result.kv_bytes + 1024  # fp32 → fp8 + scales
        src, dst, n = seq.block_table, lease.block_ids, 40
        for a, b, s in (
            (prefill.cache.k, decode_fp8.cache.k, decode_fp8.cache.k_scale),
            (prefill.cache.v, decode_fp8.cache.v, decode_fp8.cache.v_scale),
        ):
            x = a[:, src].flatten(1, 2)[:, :n]  # [L, tokens, H, D]
            y = (b[:, dst].float() * s[:, dst][:, :, None, :, None]).flatten(1, 2)[:, :n]
            amax = x.abs().amax(dim=(1, 3), keepdim=True)
            assert bool(((y - x).abs() <= amax * 2**-4).all())
    finally:
        server.stop(0)
        prefill.abort("e2e-2")
