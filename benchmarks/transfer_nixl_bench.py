"""The NIXL path of ``pdcluster bench transfer``: the same layer stack through the KV connector
with ``kv.transport: nixl`` (send side → READs into a receive side's cache under a lease), next
to a plain memcpy of the same bytes in the same run.

Modes: ``nixl`` (bf16 pages into a bf16 cache) and ``nixl-fp8`` (fp8 pages with their scales
into an fp8 cache: NIXL moves pages as they are). The receiver runs in a process of
its own, as a decode worker does. The receiver READs the source cache in place, so it holds
every layer in memory of its own, as a prefill worker's does (a view of one layer as every
layer would be read from the CPU's caches and flatter the figure).
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.kv_cache import PagedKVCache
from kv_transfer.codec import FP8
from kv_transfer.connector import transport
from kv_transfer.lease import LeaseTable
from kv_transfer.nixl_agent import NixlAgent
from kv_transfer.options import KVTransferOptions

GB = 1e9
NIXL_MODES = ("nixl", "nixl-fp8")
TOKEN = "bench-token"


def _source_cache(model: ModelConfig, blocks: int, block_size: int, dtype) -> PagedKVCache:
    """A prefill cache of every layer (NIXL reads it in place, so each layer must be memory of
    its own, as in a worker): random blocks in layer 0, copied to the others."""
    cache = PagedKVCache(model, blocks, block_size, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for t in (cache.k, cache.v):
        t[0].copy_(torch.randn(t.shape[1:], generator=gen).to(dtype))
        t[1:].copy_(t[0].expand(t.shape[0] - 1, *t.shape[1:]))
    return cache


def receiver_cache(
    model: ModelConfig, blocks: int, block_size: int, fp8: bool
) -> tuple[PagedKVCache, LeaseTable]:
    """A bench receiver's cache (fp8 or bf16) and the leases over its blocks."""
    cache = PagedKVCache(
        model, blocks, block_size, FP8 if fp8 else torch.bfloat16, torch.device("cpu")
    )
    lock = threading.RLock()
    leases = LeaseTable(BlockManager(blocks, block_size, False), lock, default_timeout_s=600)
    return cache, leases


def serve_leases(conn, leases: LeaseTable, answer) -> None:
    """A receiver process's loop: for each (request_id, tokens) the parent sends, reserve a
    lease and send back ``answer(lease)``; free its blocks when the parent says the transfer
    is done; None ends it."""
    while (message := conn.recv()) is not None:
        lease = leases.reserve(*message)
        conn.send(answer(lease))
        conn.recv()  # the transfer is done
        with leases.engine_lock:
            leases.block_manager.free(list(lease.block_ids))


def _receiver_main(conn, model: ModelConfig, blocks: int, block_size: int, fp8: bool) -> None:
    """The decode side, in a process of its own as in a cluster: a cache, leases and a NIXL
    receive side; reserves a lease per request the parent asks for, frees it after."""
    torch.set_num_threads(1)
    options = KVTransferOptions(transport="nixl", token=TOKEN, lease_timeout_s=600)
    cache, leases = receiver_cache(model, blocks, block_size, fp8)
    recv = transport("nixl").recv_side(model.fingerprint(), options)
    recv.start(cache, leases)
    try:
        serve_leases(conn, leases, recv.handle_for)
    finally:
        recv.stop()


def measure_nixl(model: ModelConfig, tokens: int, mode: str, *, block_size: int, repeats: int):
    """Best of ``repeats`` transfers of ``tokens`` tokens over NIXL into a fresh cache of a
    receiver in another process."""
    fp8 = mode == "nixl-fp8"
    dtype = FP8 if fp8 else torch.bfloat16
    blocks = -(-tokens // block_size)
    options = KVTransferOptions(transport="nixl", token=TOKEN, lease_timeout_s=600)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    receiver = context.Process(
        target=_receiver_main, args=(child, model, blocks, block_size, fp8), daemon=True
    )
    receiver.start()
    source = _source_cache(model, blocks, block_size, dtype)
    send = transport("nixl").send_side(source, model.fingerprint(), options)
    ids = torch.arange(blocks, dtype=torch.int64)
    best = None
    try:
        for i in range(repeats):
            parent.send((f"bench-{i}", tokens))
            handle = parent.recv()
            start = time.perf_counter()
            stream = send.open(handle, f"bench-{i}", tokens)
            for layer in range(model.num_layers):
                stream.send_layer(layer, ids)
            result = stream.finish(first_token=0)
            seconds = time.perf_counter() - start
            parent.send("done")
            if best is None or seconds < best[0]:
                best = (seconds, result.payload_bytes)
    finally:
        send.close()
        parent.send(None)
        receiver.join(30)
    seconds, payload = best
    return {
        "mode": mode,
        "tokens": tokens,
        "seconds": seconds,
        "payload_bytes": payload,
        "payload_gb_s": payload / seconds / GB,
    }


# What one READ of the NIXL path moves at most (kv_ready frames merge layers up to this).
READ_PIECE_BYTES = 64 << 20


def _reader_main(conn, total_bytes: int, repeats: int) -> None:
    """The lone READ's reader, in a process of its own: READs the parent's buffer into one
    of its own, ``READ_PIECE_BYTES`` a READ, ``repeats`` times; sends back the best time."""
    torch.set_num_threads(1)
    metadata, address = conn.recv()
    agent = NixlAgent("decode")
    dest = torch.zeros(total_bytes, dtype=torch.uint8)
    agent.register(dest)
    peer = agent.add_peer(metadata)
    best = float("inf")
    try:
        for i in range(repeats):
            start = time.perf_counter()
            for offset in range(0, total_bytes, READ_PIECE_BYTES):
                size = min(READ_PIECE_BYTES, total_bytes - offset)
                local = [(dest.data_ptr() + offset, size)]
                agent.read(peer, local, [(address + offset, size)], b"read-%d" % i,
                           deadline=time.monotonic() + 60)  # fmt: skip
            best = min(best, time.perf_counter() - start)
        conn.send(best)
    finally:
        agent.close()


def measure_nixl_read(total_bytes: int, repeats: int) -> dict:
    """The NIXL path's ceiling here: the same bytes READ alone between two NIXL agents in two
    processes (one contiguous buffer, pieces of ``READ_PIECE_BYTES``; no handshake, leases,
    checksums or notifications waited for), as the raw socket is the gRPC path's."""
    agent = NixlAgent("prefill")
    source = torch.randint(0, 255, (total_bytes,), dtype=torch.uint8)
    agent.register(source)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    reader = context.Process(target=_reader_main, args=(child, total_bytes, repeats), daemon=True)
    reader.start()
    agent.hold()  # progress our side while the reader READs (UCX over TCP needs it)
    try:
        parent.send((agent.metadata(), source.data_ptr()))
        while not parent.poll(0.5):
            if not reader.is_alive():
                raise RuntimeError(f"the NIXL reader exited ({reader.exitcode}) before its READs")
        seconds = parent.recv()
    finally:
        agent.unhold()
        agent.close()
        reader.join(30)
    return {"seconds": seconds, "gb_s": total_bytes / seconds / GB}


def measure_memcpy(total_bytes: int, repeats: int, chunk_bytes: int = 64 << 20) -> dict:
    """The bound of a host-to-host move: ``total_bytes`` copied in place, one thread."""
    size = min(total_bytes, chunk_bytes)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8).numpy()
    dst = src.copy()
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        left = total_bytes
        while left > 0:
            n = min(left, size)
            dst[:n] = src[:n]
            left -= n
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    return {"seconds": best, "gb_s": total_bytes / best / GB}
