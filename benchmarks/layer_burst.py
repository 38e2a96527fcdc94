"""A short prompt's KV as a disaggregated prefill step ends with it: every layer's blocks at
once, through the gRPC transport's send side into a live receive side (127.0.0.1), shipped
layer by layer (``send_layer`` x layers) against all layers in one call (``send_layers``),
alternating in one process. Prints the medians of the time on the calling thread (the prefill
engine's, which computes the LM head after it), of ``finish`` and of both.

    python -m benchmarks.layer_burst [--tokens 128] [--wire fp8] [--runs 40]

The cache is smollm2-135m's shape (30 layers, 3 KV heads of 64, blocks of 16), bf16 on both
sides, random values; no model runs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.kv_cache import PagedKVCache
from kv_transfer.connector import transport
from kv_transfer.lease import LeaseTable
from kv_transfer.options import KVTransferOptions

BLOCK_SIZE = 16
NUM_BLOCKS = 512
TOKEN = "layer-burst-bench"
SMOLLM2_KV = ModelConfig(  # the KV cache's shape is all that matters here
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--wire", default="fp8", choices=["fp8", "passthrough"])
    parser.add_argument("--runs", type=int, default=40, help="of each way, alternating")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a serving actor
    fingerprint = SMOLLM2_KV.fingerprint()
    options = KVTransferOptions(transport="grpc", token=TOKEN, wire_dtype=args.wire)
    lock = threading.RLock()
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    leases = LeaseTable(blocks, lock, default_timeout_s=60)
    cpu = torch.device("cpu")
    decode_cache = PagedKVCache(SMOLLM2_KV, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, cpu)
    prefill_cache = PagedKVCache(SMOLLM2_KV, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, cpu)
    for t in (prefill_cache.k, prefill_cache.v):
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    entry = transport("grpc")
    recv = entry.recv_side(fingerprint, options)
    recv.start(decode_cache, leases)
    send = entry.send_side(prefill_cache, fingerprint, options)
    layers = SMOLLM2_KV.num_layers
    ids = torch.arange(7, 7 + -(-args.tokens // BLOCK_SIZE))
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    try:
        for i in range(2 * args.runs + 4):
            together = bool(i % 2)
            lease = leases.reserve(f"burst-{i}", args.tokens)
            stream = send.open(recv.handle_for(lease), f"burst-{i}", args.tokens)
            start = time.perf_counter()
            if together:
                stream.send_layers(0, layers, ids)
            else:
                for layer in range(layers):
                    stream.send_layer(layer, ids)
            sent = time.perf_counter()
            stream.finish(first_token=1)
            done = time.perf_counter()
            with lock:
                blocks.free(leases.get(lease.lease_id).block_ids)
            if i >= 4:  # the first two of each way warm up
                times[together].append((sent - start, done - sent))
    finally:
        send.close()
        recv.stop()
    print(f"{args.tokens} tokens, {layers} layers, wire {args.wire}; medians of {args.runs}:")
    for together, label in ((False, "send_layer x layers"), (True, "send_layers")):
        calls = statistics.median(t[0] for t in times[together]) * 1e3
        finish = statistics.median(t[1] for t in times[together]) * 1e3
        total = statistics.median(sum(t) for t in times[together]) * 1e3
        print(
            f"  {label:<20} calling thread {calls:6.1f} ms   finish {finish:6.1f} ms   "
            f"total {total:6.1f} ms"
        )


if __name__ == "__main__":
    main()
