"""The prefill side of the KV transfer: streams one request's KV cache to a decode worker,
layer by layer, while later layers still compute.

``KVSender`` holds one gRPC channel to one decode worker's receiver and opens a
``TransferStream`` per request. The stream's frames go through a bounded queue that gRPC's
own thread drains into the RPC: ``send_layer`` (called from the model's ``layer_done`` hook)
encodes a layer and enqueues its frames, and blocks once ``max_frames_in_flight`` frames
wait (backpressure: memory held by a slow transfer is bounded by that many frames).

Thread-safety: a ``KVSender`` may be shared by threads (gRPC channels are thread-safe); one
``TransferStream`` is driven by one thread.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import grpc
import torch

from kv_transfer import frames
from kv_transfer.codec import (
    WireSpec,
    dtype_name,
    encode_layer,
    layer_chunks,
    payload_dtype_for,
)
from kv_transfer.errors import KVTransferError
from kv_transfer.receiver import grpc_options
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
_DONE = object()  # ends the request iterator


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    lease_id: str
    payload_bytes: int  # bytes of K/V payload (and scales) sent
    kv_bytes: int  # bytes the same tokens occupy in the sender's cache dtype
    num_frames: int  # all frames, handshake and end included
    seconds: float  # open() to the receiver's answer


class KVSender:
    """Client of one decode worker's KV receiver; reuses one channel for every transfer."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        tls_root_cert: bytes | None = None,
        max_frames_in_flight: int = 8,
        timeout_s: float = 30.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        tls_server_name: str | None = None,
    ) -> None:
        if max_frames_in_flight < 1:
            raise ValueError("max_frames_in_flight must be at least 1")
        self.address = address
        self.max_frames_in_flight = max_frames_in_flight
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._metadata = (("authorization", f"Bearer {token}"),)
        options = grpc_options()
        if tls_root_cert is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=tls_root_cert)
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel)

    def open(
        self,
        request_id: str,
        lease_id: str,
        fingerprint: dict,
        block_size: int,
        num_tokens: int,
        num_layers: int,
        wire_dtype: str,
        cache_dtype: torch.dtype,
    ) -> TransferStream:
        """Start the RPC and send the handshake. ``wire_dtype``: "passthrough" or "fp8";
        ``cache_dtype``: the dtype of the blocks ``send_layer`` will get."""
        payload_dtype = payload_dtype_for(wire_dtype, cache_dtype)
        handshake = frames.Handshake(
            request_id=request_id,
            lease_id=lease_id,
            fingerprint=frames.normalise_fingerprint(fingerprint),
            block_size=block_size,
            num_tokens=num_tokens,
            wire_dtype=wire_dtype,
            payload_dtype=dtype_name(payload_dtype),
        )
        spec = WireSpec(
            block_size,
            int(fingerprint["num_kv_heads"]),
            int(fingerprint["head_dim"]),
            payload_dtype,
        )
        return TransferStream(self, handshake, spec, num_layers, cache_dtype)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TransferStream:
    """One request's transfer: ``send_layer`` for each layer, then ``finish`` (or ``abort``)."""

    def __init__(
        self,
        sender: KVSender,
        handshake: frames.Handshake,
        spec: WireSpec,
        num_layers: int,
        cache_dtype: torch.dtype,
    ) -> None:
        self.handshake = handshake
        self.spec = spec
        self.num_layers = num_layers
        self.cache_dtype = cache_dtype
        self._timeout_s = sender.timeout_s
        self._blocks_per_frame = spec.blocks_per_frame(sender.max_frame_bytes)
        self._queue: queue.Queue = queue.Queue(maxsize=sender.max_frames_in_flight)
        self._start = time.perf_counter()
        self._deadline = time.monotonic() + sender.timeout_s
        self.payload_bytes = 0
        self.num_frames = 0
        self._num_kv_frames = 0
        self._closed = False
        self._future = sender._stub.Push.future(
            self._frames(), metadata=sender._metadata, timeout=sender.timeout_s
        )
        self._put(frames.encode_handshake(handshake))

    # ---- public -----------------------------------------------------------------------
    def send_layer(
        self,
        layer: int,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Ship one layer: blocks ``[n, bs, Hkv, D]`` of this sequence in block-table order
        (any device). Scales ``[n, Hkv]`` are given when the source cache is fp8. Blocks while
        ``max_frames_in_flight`` frames are queued; raises KVTransferError if the receiver has
        already refused the stream."""
        if self._closed:
            raise KVTransferError("the transfer stream is closed", "FAILED_PRECONDITION")
        n = self.handshake.num_blocks
        if k_blocks.shape[0] != n:
            raise ValueError(
                f"expected {n} blocks for {self.handshake.num_tokens} tokens, got "
                f"{k_blocks.shape[0]}"
            )
        layer_payload = encode_layer(
            k_blocks,
            v_blocks,
            wire_dtype=self.handshake.wire_dtype,
            num_tokens=self.handshake.num_tokens,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        for start, count, payload in layer_chunks(layer_payload, self._blocks_per_frame):
            self._put(frames.encode_kv(layer, start, count, payload))
            self.payload_bytes += len(payload)
            self._num_kv_frames += 1

    def finish(self, first_token: int) -> TransferResult:
        """Send the final frame and wait for the receiver's answer. Raises KVTransferError
        with the receiver's status code and message if it refused the transfer."""
        self._put(frames.encode_end(first_token, self._num_kv_frames))
        self._end_iterator()
        try:
            self._future.result(timeout=max(0.0, self._deadline - time.monotonic()) + 1.0)
        except grpc.FutureTimeoutError:
            self.abort("timed out waiting for the receiver")
            raise KVTransferError("KV transfer timed out", "DEADLINE_EXCEEDED") from None
        except grpc.RpcError as err:
            raise _from_rpc_error(err) from None
        element = self.cache_dtype.itemsize
        kv_bytes = (
            2
            * self.num_layers
            * self.handshake.num_tokens
            * self.spec.num_kv_heads
            * self.spec.head_dim
            * element
        )
        return TransferResult(
            request_id=self.handshake.request_id,
            lease_id=self.handshake.lease_id,
            payload_bytes=self.payload_bytes,
            kv_bytes=kv_bytes,
            num_frames=self.num_frames,
            seconds=time.perf_counter() - self._start,
        )

    def abort(self, reason: str) -> None:
        """Cancel the RPC; the receiver releases the lease at once. Idempotent."""
        self._future.cancel()
        self._end_iterator()

    # ---- internals --------------------------------------------------------------------
    def _frames(self):
        # Runs on gRPC's thread: hands queued frames to the RPC until _DONE.
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            meta, payload, crc = item
            yield kv_transfer_pb2.Frame(meta=meta, payload=payload, crc32=crc)

    def _put(self, frame: tuple[bytes, bytes, int]) -> None:
        if self._closed:
            raise KVTransferError("the transfer stream is closed", "FAILED_PRECONDITION")
        while True:
            if self._future.done():
                self._closed = True
                raise self._failure()
            if time.monotonic() > self._deadline:
                self.abort("deadline")
                raise KVTransferError("KV transfer timed out (backpressure)", "DEADLINE_EXCEEDED")
            try:
                self._queue.put(frame, timeout=0.05)
            except queue.Full:
                continue
            self.num_frames += 1
            return

    def _end_iterator(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Drop frames nobody will send, so _DONE fits and gRPC's consumer thread ends.
        while True:
            try:
                self._queue.put_nowait(_DONE)
                return
            except queue.Full:
                if not self._future.done():
                    try:
                        self._queue.put(_DONE, timeout=0.05)
                        return
                    except queue.Full:
                        continue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass

    def _failure(self) -> KVTransferError:
        try:
            self._future.result(timeout=0)
        except grpc.RpcError as err:
            return _from_rpc_error(err)
        except grpc.FutureCancelledError:
            return KVTransferError("KV transfer was aborted", "CANCELLED")
        except Exception as err:
            return KVTransferError(f"KV transfer failed: {err!r}")
        return KVTransferError("the receiver answered before the transfer finished", "INTERNAL")


def _from_rpc_error(err: grpc.RpcError) -> KVTransferError:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return KVTransferError(details or "KV transfer failed", code.name if code else "UNKNOWN")
