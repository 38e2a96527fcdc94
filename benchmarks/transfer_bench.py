"""``pdcluster bench transfer``: KV transfer throughput on loopback, next to a raw TCP socket
sending the same bytes in the same run.

A Llama-3-8B-shaped layer stack (32 layers, 8 kv heads, head_dim 128, bf16 cache, blocks of
16) is streamed for several prompt lengths, one request at a time, from a ``KVSender`` to a
``KVReceiverServer`` that writes into a real paged cache under a lease. Every layer is ready
at once (no model runs), so the numbers are the transport's own ceiling. Modes:

- ``passthrough``: bf16 pages → bf16 cache (payload = KV bytes);
- ``fp8``: fp8 pages with their scales (a prefill worker whose cache is fp8) → fp8 cache;
- ``fp8-codec``: bf16 pages quantised on the sender, dequantised into a bf16 cache on the
  receiver (on a CPU-only host the codec runs as torch references, which bounds this mode).

Reported: payload GB/s (bytes on the wire), effective KV GB/s (bytes those tokens occupy in a
bf16 cache, delivered per second), and the raw-socket GB/s for the passthrough byte count;
with a NIXL mode, also a memcpy of those bytes and a lone NIXL READ of them between two
processes (the NIXL path's own ceiling here, as the raw socket is the gRPC path's).
Each receiver (the KV server, the raw socket's reader, NIXL's) runs in a process of its own,
as a decode worker does: in one process the two sides would share one GIL, which no
deployment does.
The gRPC transport runs as the workers run it by default: the kv frames of a transfer of
at least ``kv.data_channel_min_bytes`` over its raw TCP data channel, smaller ones over the
gRPC stream (hand-serialised frames); ``--no-data-channel`` sends every frame over the gRPC
stream. The source tensors are never modified, so they are sent with ``copy=False`` (no
defensive copy of the caller's CPU tensors).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import struct
import time
from pathlib import Path

import torch

from benchmarks.transfer_nixl_bench import (
    NIXL_MODES,
    measure_memcpy,
    measure_nixl,
    measure_nixl_read,
    receiver_cache,
    serve_leases,
)
from engine.config import ModelConfig, RopeConfig
from kv_transfer import KVReceiverServer, KVSender
from kv_transfer.codec import FP8
from kv_transfer.options import KVTransferOptions
from kv_transfer.sender import DEFAULT_MAX_FRAME_BYTES

KV_DEFAULTS = KVTransferOptions()  # how the workers run the gRPC transport

LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope=RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0),
)
TOKEN = "bench-token"
GRPC_MODES = ("passthrough", "fp8", "fp8-codec")
MODES = GRPC_MODES + NIXL_MODES


def available_modes() -> tuple[str, ...]:
    """Every mode, less the NIXL ones where NIXL is not installed."""
    from kv_transfer.nixl_agent import nixl_unavailable

    return MODES if nixl_unavailable() is None else GRPC_MODES


GB = 1e9


def kv_bytes(model: ModelConfig, tokens: int, element_size: int = 2) -> int:
    return 2 * model.num_layers * tokens * model.num_kv_heads * model.head_dim * element_size


def _source(model: ModelConfig, blocks: int, block_size: int, dtype: torch.dtype):
    """One layer's K and V blocks, reused for every layer (memory stays one layer's worth)."""
    gen = torch.Generator().manual_seed(0)
    shape = (blocks, block_size, model.num_kv_heads, model.head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    if dtype != FP8:
        return k, v, None, None
    scales = torch.full((blocks, model.num_kv_heads), 0.01)
    return k, v, scales, scales.clone()


def _grpc_receiver_main(conn, model, blocks, block_size, fp8_cache, data_channel) -> None:
    """The decode side, in a process of its own: a cache of ``blocks``, leases and a KV
    receiver server; reserves a lease per (request_id, tokens) the parent sends, frees it
    when the parent says the transfer is done; None ends it."""
    torch.set_num_threads(1)
    cache, leases = receiver_cache(model, blocks, block_size, fp8_cache)
    server = KVReceiverServer(
        cache, leases, model.fingerprint(), token=TOKEN, data_channel=data_channel
    )
    server.start()
    conn.send(server.address)
    try:
        serve_leases(conn, leases, lambda lease: (lease.request_id, lease.lease_id))
    finally:
        server.stop(0)


class GrpcReceiver:
    """A KV receiver server in a process of its own, with a cache for ``max_tokens``."""

    def __init__(
        self,
        model: ModelConfig,
        max_tokens: int,
        block_size: int,
        fp8_cache: bool,
        data_channel: bool,
    ) -> None:
        blocks = -(-max_tokens // block_size)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_grpc_receiver_main,
            args=(child, model, blocks, block_size, fp8_cache, data_channel),
            daemon=True,
        )
        self._process.start()
        self.address = self._conn.recv()

    def lease(self, request_id: str, tokens: int) -> tuple[str, str]:
        self._conn.send((request_id, tokens))
        return self._conn.recv()

    def done(self) -> None:
        self._conn.send("done")

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(30)


def measure_grpc(
    model: ModelConfig,
    tokens: int,
    mode: str,
    receiver: GrpcReceiver,
    *,
    block_size: int,
    repeats: int,
    max_frame_bytes: int,
    frames_in_flight: int,
    data_channel: bool = KV_DEFAULTS.data_channel,
) -> dict:
    """Best of ``repeats`` transfers of ``tokens`` tokens in ``mode`` into ``receiver`` (its
    cache fp8 for the fp8 mode, bf16 otherwise)."""
    blocks = -(-tokens // block_size)
    source_dtype = FP8 if mode == "fp8" else torch.bfloat16
    k, v, ks, vs = _source(model, blocks, block_size, source_dtype)
    scales = () if ks is None else (ks, vs)
    wire = "passthrough" if mode == "passthrough" else "fp8"
    best = None
    with KVSender(
        receiver.address,
        TOKEN,
        max_frames_in_flight=frames_in_flight,
        timeout_s=600,
        max_frame_bytes=max_frame_bytes,
        data_channel=data_channel,
        data_channel_min_bytes=KV_DEFAULTS.data_channel_min_bytes,
    ) as sender:
        for i in range(repeats):
            request_id, lease_id = receiver.lease(f"bench-{tokens}-{i}", tokens)
            start = time.perf_counter()
            stream = sender.open(
                request_id,
                lease_id,
                model.fingerprint(),
                block_size,
                tokens,
                model.num_layers,
                wire,
                source_dtype,
            )
            for layer in range(model.num_layers):
                stream.send_layer(layer, k, v, *scales, copy=False)
            result = stream.finish(first_token=0)
            seconds = time.perf_counter() - start
            receiver.done()
            if best is None or seconds < best[0]:
                best = (seconds, result.payload_bytes)
    seconds, payload = best
    return {
        "mode": mode,
        "tokens": tokens,
        "seconds": seconds,
        "payload_bytes": payload,
        "payload_gb_s": payload / seconds / GB,
        "effective_kv_gb_s": kv_bytes(model, tokens) / seconds / GB,
    }


def _raw_receiver_main(conn) -> None:
    """The raw socket's reader, in a process of its own: per connection, a byte count, then
    that many bytes into a reused buffer, then a one-byte ack."""
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    buf = memoryview(bytearray(4 * 1024 * 1024))
    while True:
        peer, _ = listener.accept()
        with peer:
            header = peer.recv(8, socket.MSG_WAITALL)
            if len(header) < 8:
                return  # the parent closed without a transfer: done
            left = struct.unpack("<Q", header)[0]
            while left > 0:
                n = peer.recv_into(buf[: min(left, buf.nbytes)])
                if n == 0:
                    break
                left -= n
            peer.sendall(b"k")


def measure_raw_socket(total_bytes: int, chunk_bytes: int, repeats: int) -> dict:
    """The bound: ``total_bytes`` over one loopback TCP connection to a reader in another
    process, ``sendall`` of ``chunk_bytes`` pieces into its ``recv_into`` of a reused buffer,
    no framing, no copy into a cache; timed until the reader's ack of the last byte."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    reader = context.Process(target=_raw_receiver_main, args=(child,), daemon=True)
    reader.start()
    port = parent.recv()
    chunk = memoryview(bytearray(chunk_bytes))
    best = None
    try:
        for _ in range(repeats):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                start = time.perf_counter()
                conn.sendall(struct.pack("<Q", total_bytes))
                left = total_bytes
                while left > 0:
                    piece = chunk[: min(left, chunk_bytes)]
                    conn.sendall(piece)
                    left -= len(piece)
                if conn.recv(1) != b"k":
                    raise RuntimeError("the raw socket's reader did not acknowledge the bytes")
                seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
    finally:
        socket.create_connection(("127.0.0.1", port)).close()  # ends the reader
        reader.join(30)
    return {"seconds": best, "gb_s": total_bytes / best / GB}


def run_transfer_benchmark(
    token_counts: list[int],
    *,
    modes: tuple[str, ...] | None = None,
    block_size: int = 16,
    repeats: int = 2,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    frames_in_flight: int = 8,
    model: ModelConfig = LLAMA3_8B,
    log=print,
    data_channel: bool = KV_DEFAULTS.data_channel,
) -> list[dict]:
    """One row per token count: raw socket (and memcpy), then each mode (by default
    ``available_modes()``). Returns the rows (also printed)."""
    modes = available_modes() if modes is None else modes
    log(
        f"layer stack: {model.num_layers} layers x {model.num_kv_heads} kv heads x head_dim "
        f"{model.head_dim}, bf16 cache, block {block_size}; frames <= {max_frame_bytes >> 20} "
        f"MiB, {frames_in_flight} in flight; best of {repeats}; torch threads "
        f"{torch.get_num_threads()}; kv frames over "
        + (
            f"the TCP data channel from {KV_DEFAULTS.data_channel_min_bytes >> 20} MiB a transfer"
            if data_channel
            else "gRPC"
        )
    )
    # One receiver process per gRPC mode for the whole run, its cache sized for the longest.
    longest = max([64, *token_counts])
    receivers = {
        mode: GrpcReceiver(model, longest, block_size, mode == "fp8", data_channel)
        for mode in modes
        if mode not in NIXL_MODES
    }
    grpc_options = dict(
        block_size=block_size,
        max_frame_bytes=max_frame_bytes,
        frames_in_flight=frames_in_flight,
        data_channel=data_channel,
    )
    rows = []
    try:
        # Warm-up: gRPC channel setup, codec paths.
        for mode in modes:
            if mode in NIXL_MODES:
                measure_nixl(model, 64, mode, block_size=block_size, repeats=1)
                continue
            measure_grpc(model, 64, mode, receivers[mode], repeats=1, **grpc_options)
        for tokens in token_counts:
            blocks = -(-tokens // block_size)
            padded = kv_bytes(model, blocks * block_size)
            raw = measure_raw_socket(padded, max_frame_bytes, repeats)
            row = {
                "tokens": tokens,
                "kv_mib": kv_bytes(model, tokens) / 2**20,
                "raw_gb_s": raw["gb_s"],
            }
            if set(modes) & set(NIXL_MODES):
                row["memcpy_gb_s"] = measure_memcpy(padded, repeats)["gb_s"]
                row["nixl_read_gb_s"] = measure_nixl_read(padded, repeats)["gb_s"]
            for mode in modes:
                if mode in NIXL_MODES:
                    row[mode] = measure_nixl(
                        model, tokens, mode, block_size=block_size, repeats=repeats
                    )
                    seconds = row[mode]["seconds"]
                    row[mode]["effective_kv_gb_s"] = kv_bytes(model, tokens) / seconds / GB
                    continue
                row[mode] = measure_grpc(
                    model, tokens, mode, receivers[mode], repeats=repeats, **grpc_options
                )
            rows.append(row)
            log(format_row(row, modes))
    finally:
        for receiver in receivers.values():
            receiver.close()
    return rows


def format_header(modes: tuple[str, ...]) -> str:
    cols = ["tokens", "KV MiB (bf16)", "raw socket GB/s"]
    if set(modes) & set(NIXL_MODES):
        cols += ["memcpy GB/s", "NIXL READ alone GB/s"]
    for mode in modes:
        cols += [f"{mode} payload GB/s", f"{mode} effective KV GB/s"]
    return "| " + " | ".join(cols) + " |\n|" + "---:|" * len(cols)


def format_row(row: dict, modes: tuple[str, ...]) -> str:
    cells = [str(row["tokens"]), f"{row['kv_mib']:.0f}", f"{row['raw_gb_s']:.2f}"]
    if "memcpy_gb_s" in row:
        read = row["nixl_read_gb_s"]
        cells += [f"{row['memcpy_gb_s']:.2f}", f"{read:.2f} ({read / row['memcpy_gb_s']:.0%})"]
    grpc = row["passthrough"]["payload_gb_s"] if "passthrough" in row else None
    for mode in modes:
        m = row[mode]
        payload = f"{m['payload_gb_s']:.2f}"
        if mode == "passthrough":
            payload += f" ({m['payload_gb_s'] / row['raw_gb_s']:.0%} of raw)"
        if mode == "nixl":
            payload += f" ({m['payload_gb_s'] / row['memcpy_gb_s']:.0%} of memcpy"
            payload += f", {m['payload_gb_s'] / row['nixl_read_gb_s']:.0%} of READ"
            payload += f", {m['payload_gb_s'] / grpc:.1f}x gRPC)" if grpc else ")"
        base_mode = "nixl" if mode in NIXL_MODES else "passthrough"
        base = row[base_mode]["effective_kv_gb_s"] if base_mode in row else None
        eff = f"{m['effective_kv_gb_s']:.2f}"
        if base and mode != base_mode:
            eff += f" ({m['effective_kv_gb_s'] / base:.2f}x)"
        cells += [payload, eff]
    return "| " + " | ".join(cells) + " |"


def add_transfer_parser(bench_subparsers) -> None:
    """Register ``transfer`` under ``pdcluster bench`` (the CLI calls this)."""
    p = bench_subparsers.add_parser(
        "transfer", help="KV transfer GB/s (passthrough, fp8) vs a raw TCP socket, on loopback"
    )
    p.add_argument("--tokens", default="1024,4096,16384,32768", help="comma-separated counts")
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated from {MODES} (default: all; the nixl ones where NIXL is installed)",
    )
    p.add_argument("--repeats", type=int, default=2, help="best of this many transfers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-frame-mib", type=float, default=DEFAULT_MAX_FRAME_BYTES / 2**20)
    p.add_argument("--frames-in-flight", type=int, default=8)
    p.add_argument(
        "--data-channel",
        action=argparse.BooleanOptionalAction,
        default=KV_DEFAULTS.data_channel,
        help="gRPC transport: the kv frames of transfers of at least kv.data_channel_min_bytes "
        "over the TCP data channel, as the workers do by default (--no-data-channel: every "
        "frame over the gRPC stream)",
    )
    p.add_argument(
        "--into-decode-worker",
        action="store_true",
        help="also: transfers into a real decode worker, idle and decoding a batch of 16",
    )
    p.add_argument("--model", default=None, help="its model (default: the default model)")
    p.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    p.set_defaults(func=run_transfer_cli)


def run_transfer_cli(args) -> int:
    if args.modes is None:
        modes = available_modes()
    else:
        modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    rows = run_transfer_benchmark(
        [int(t) for t in args.tokens.split(",")],
        modes=modes,
        block_size=args.block_size,
        repeats=args.repeats,
        max_frame_bytes=int(args.max_frame_mib * 2**20),
        frames_in_flight=args.frames_in_flight,
        log=lambda line: None,
        data_channel=args.data_channel,
    )
    print(format_header(modes))
    for row in rows:
        print(format_row(row, modes))
    busy = None
    if args.into_decode_worker:
        from benchmarks.transfer_busy_bench import format_result, measure_into_decode_worker
        from engine.named_models import DEFAULT_MODEL

        busy = [
            measure_into_decode_worker(args.model or DEFAULT_MODEL, kv_transport=transport)
            for transport in (("grpc", "nixl") if set(modes) & set(NIXL_MODES) else ("grpc",))
        ]
        for result in busy:
            print(format_result(result))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"rows": rows, "into_decode_worker": busy}, indent=2)
        )
    return 0
