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
bf16 cache, delivered per second), and the raw-socket GB/s for the passthrough byte count.
The gRPC transport runs as the workers run it by default: the kv frames of a transfer of
at least ``kv.data_channel_min_bytes`` over its raw TCP data channel, smaller ones over the
gRPC stream (hand-serialised frames); ``--no-data-channel`` sends every frame over the gRPC
stream. The source tensors are never modified, so they are sent with ``copy=False`` (no
defensive copy of the caller's CPU tensors).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import torch

from benchmarks.transfer_nixl_bench import NIXL_MODES, measure_memcpy, measure_nixl
from engine.block_manager import BlockManager
from engine.config import ModelConfig, RopeConfig
from engine.kv_cache import PagedKVCache
from kv_transfer import KVReceiverServer, KVSender, LeaseTable
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


def measure_grpc(
    model: ModelConfig,
    tokens: int,
    mode: str,
    *,
    block_size: int,
    repeats: int,
    max_frame_bytes: int,
    frames_in_flight: int,
    data_channel: bool = KV_DEFAULTS.data_channel,
) -> dict:
    """Best of ``repeats`` transfers of ``tokens`` tokens in ``mode``, into a fresh cache."""
    blocks = -(-tokens // block_size)
    cache_dtype = FP8 if mode == "fp8" else torch.bfloat16
    cache = PagedKVCache(model, blocks, block_size, cache_dtype, torch.device("cpu"))
    lock = threading.RLock()
    leases = LeaseTable(BlockManager(blocks, block_size, False), lock, default_timeout_s=600)
    server = KVReceiverServer(
        cache, leases, model.fingerprint(), token=TOKEN, data_channel=data_channel
    )
    server.start()
    source_dtype = FP8 if mode == "fp8" else torch.bfloat16
    k, v, ks, vs = _source(model, blocks, block_size, source_dtype)
    scales = () if ks is None else (ks, vs)
    wire = "passthrough" if mode == "passthrough" else "fp8"
    best = None
    try:
        with KVSender(
            server.address,
            TOKEN,
            max_frames_in_flight=frames_in_flight,
            timeout_s=600,
            max_frame_bytes=max_frame_bytes,
            data_channel=data_channel,
            data_channel_min_bytes=KV_DEFAULTS.data_channel_min_bytes,
        ) as sender:
            for i in range(repeats):
                lease = leases.reserve(f"bench-{i}", tokens)
                start = time.perf_counter()
                stream = sender.open(
                    lease.request_id,
                    lease.lease_id,
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
                with lock:
                    leases.block_manager.free(list(lease.block_ids))
                if best is None or seconds < best[0]:
                    best = (seconds, result.payload_bytes)
    finally:
        server.stop(0)
    seconds, payload = best
    return {
        "mode": mode,
        "tokens": tokens,
        "seconds": seconds,
        "payload_bytes": payload,
        "payload_gb_s": payload / seconds / GB,
        "effective_kv_gb_s": kv_bytes(model, tokens) / seconds / GB,
    }


def measure_raw_socket(total_bytes: int, chunk_bytes: int, repeats: int) -> dict:
    """The bound: ``total_bytes`` over one loopback TCP connection, ``sendall`` of
    ``chunk_bytes`` pieces into ``recv_into`` a reused buffer, no framing, no copy into a cache."""
    chunk = memoryview(bytearray(chunk_bytes))
    best = None
    for _ in range(repeats):
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        received = [0]

        def receive(listener=listener, received=received):
            conn, _ = listener.accept()
            buf = memoryview(bytearray(4 * 1024 * 1024))
            with conn:
                while received[0] < total_bytes:
                    n = conn.recv_into(buf)
                    if n == 0:
                        break
                    received[0] += n

        thread = threading.Thread(target=receive)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            start = time.perf_counter()
            left = total_bytes
            while left > 0:
                piece = chunk[: min(left, chunk_bytes)]
                conn.sendall(piece)
                left -= len(piece)
            thread.join()
            seconds = time.perf_counter() - start
        listener.close()
        assert received[0] == total_bytes
        best = seconds if best is None else min(best, seconds)
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
    # Warm-up: gRPC channel setup, codec paths.
    for mode in modes:
        if mode in NIXL_MODES:
            measure_nixl(model, 64, mode, block_size=block_size, repeats=1)
            continue
        measure_grpc(
            model,
            64,
            mode,
            block_size=block_size,
            repeats=1,
            max_frame_bytes=max_frame_bytes,
            frames_in_flight=frames_in_flight,
            data_channel=data_channel,
        )
    rows = []
    for tokens in token_counts:
        blocks = -(-tokens // block_size)
        padded = kv_bytes(model, blocks * block_size)
        raw = measure_raw_socket(padded, max_frame_bytes, repeats)
        row = {"tokens": tokens, "kv_mib": kv_bytes(model, tokens) / 2**20, "raw_gb_s": raw["gb_s"]}
        if set(modes) & set(NIXL_MODES):
            row["memcpy_gb_s"] = measure_memcpy(padded, repeats)["gb_s"]
        for mode in modes:
            if mode in NIXL_MODES:
                row[mode] = measure_nixl(
                    model, tokens, mode, block_size=block_size, repeats=repeats
                )
                row[mode]["effective_kv_gb_s"] = kv_bytes(model, tokens) / row[mode]["seconds"] / GB
                continue
            row[mode] = measure_grpc(
                model,
                tokens,
                mode,
                block_size=block_size,
                repeats=repeats,
                max_frame_bytes=max_frame_bytes,
                frames_in_flight=frames_in_flight,
                data_channel=data_channel,
            )
        rows.append(row)
        log(format_row(row, modes))
    return rows


def format_header(modes: tuple[str, ...]) -> str:
    cols = ["tokens", "KV MiB (bf16)", "raw socket GB/s"]
    if set(modes) & set(NIXL_MODES):
        cols.append("memcpy GB/s")
    for mode in modes:
        cols += [f"{mode} payload GB/s", f"{mode} effective KV GB/s"]
    return "| " + " | ".join(cols) + " |\n|" + "---:|" * len(cols)


def format_row(row: dict, modes: tuple[str, ...]) -> str:
    cells = [str(row["tokens"]), f"{row['kv_mib']:.0f}", f"{row['raw_gb_s']:.2f}"]
    if "memcpy_gb_s" in row:
        cells.append(f"{row['memcpy_gb_s']:.2f}")
    grpc = row["passthrough"]["payload_gb_s"] if "passthrough" in row else None
    for mode in modes:
        m = row[mode]
        payload = f"{m['payload_gb_s']:.2f}"
        if mode == "passthrough":
            payload += f" ({m['payload_gb_s'] / row['raw_gb_s']:.0%} of raw)"
        if mode == "nixl":
            payload += f" ({m['payload_gb_s'] / row['memcpy_gb_s']:.0%} of memcpy"
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
