"""Shared helpers of the KV transfer tests: a small model shape, caches, a live receiver, and
raw frame streams for feeding the receiver what a well-behaved sender never would."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.kv_cache import PagedKVCache
from kv_transfer import frames
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiverServer, grpc_options
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc

TOKEN = "test-token"
BLOCK_SIZE = 16
MODEL = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
FINGERPRINT = MODEL.fingerprint()


def make_cache(dtype: torch.dtype, num_blocks: int = 16, *, fill: bool = True) -> PagedKVCache:
    """A small cache; ``fill`` puts recognisable random values everywhere, so a write into the
    wrong blocks shows."""
    cache = PagedKVCache(MODEL, num_blocks, BLOCK_SIZE, dtype, torch.device("cpu"))
    if fill:
        gen = torch.Generator().manual_seed(1234)
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
        if cache.is_fp8:
            cache.k_scale.uniform_(0.5, 2.0, generator=gen)
            cache.v_scale.uniform_(0.5, 2.0, generator=gen)
    return cache


def random_blocks(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, BLOCK_SIZE, MODEL.num_kv_heads, MODEL.head_dim)
    k = (torch.randn(shape, generator=gen) * 3).to(dtype)
    v = (torch.randn(shape, generator=gen) * 0.01).to(dtype)
    return k, v


def snapshot(cache: PagedKVCache) -> list[torch.Tensor]:
    parts = [cache.k.clone(), cache.v.clone()]
    if cache.is_fp8:
        parts += [cache.k_scale.clone(), cache.v_scale.clone()]
    return parts


def equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@dataclass
class Receiver:
    cache: PagedKVCache
    blocks: BlockManager
    leases: LeaseTable
    server: KVReceiverServer
    lock: threading.RLock

    @property
    def address(self) -> str:
        return self.server.address

    def free_blocks(self) -> int:
        with self.lock:
            return self.blocks.num_free_blocks


def start_receiver(
    dtype: torch.dtype = torch.bfloat16,
    *,
    num_blocks: int = 16,
    lease_timeout_s: float = 10.0,
    tls: tuple[bytes, bytes] | None = None,
    sweep_interval_s: float = 0.05,
    data_channel: bool = False,
) -> Receiver:
    cache = make_cache(dtype, num_blocks)
    blocks = BlockManager(num_blocks, BLOCK_SIZE)
    lock = threading.RLock()
    leases = LeaseTable(blocks, lock, default_timeout_s=lease_timeout_s)
    server = KVReceiverServer(
        cache,
        leases,
        FINGERPRINT,
        token=TOKEN,
        tls_cert=tls[0] if tls else None,
        tls_key=tls[1] if tls else None,
        sweep_interval_s=sweep_interval_s,
        data_channel=data_channel,
    )
    server.start()
    return Receiver(cache, blocks, leases, server, lock)


def handshake(lease, **overrides) -> frames.Handshake:
    fields = dict(
        request_id=lease.request_id,
        lease_id=lease.lease_id,
        fingerprint=frames.normalise_fingerprint(FINGERPRINT),
        block_size=BLOCK_SIZE,
        num_tokens=lease.num_tokens,
        wire_dtype="passthrough",
        payload_dtype="bfloat16",
    )
    fields.update(overrides)
    return frames.Handshake(**fields)


def pb(frame: tuple[bytes, bytes, int]) -> kv_transfer_pb2.Frame:
    meta, payload, crc = frame
    return kv_transfer_pb2.Frame(meta=meta, payload=payload, crc32=crc)


def push_raw(address: str, messages, *, token: str | None = TOKEN, timeout: float = 10.0):
    """Send raw Frame messages; returns (status code, details)."""
    with grpc.insecure_channel(address, options=grpc_options()) as channel:
        stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
        try:
            stub.Push(iter(list(messages)), metadata=metadata, timeout=timeout)
        except grpc.RpcError as err:
            return err.code(), err.details()
        return grpc.StatusCode.OK, ""


def layer_frames(layer: int, k: torch.Tensor, v: torch.Tensor, blocks_per_frame: int = 1000):
    """Passthrough kv frames of one layer."""
    from kv_transfer.codec import encode_layer, layer_chunks

    encoded = encode_layer(k, v, wire_dtype="passthrough", num_tokens=k.shape[0] * BLOCK_SIZE)
    return [
        pb(frames.encode_kv(layer, start, count, payload))
        for start, count, payload in layer_chunks(encoded, blocks_per_frame)
    ]
