"""``pdcluster bench transfer --into-decode-worker``: KV transfers into a real decode worker
(the default model, a Ray actor in a process of its own as in a cluster), idle and while it
decodes a batch of 16 without a pause, in the same run. A transfer's frames land in its
lease's blocks without the engine lock (kv_transfer/lease.py), so a busy decode should cost
the transfer little: the target is >= 80% of the idle throughput.

The control, same run: the worker idle while a CPU-bound process with no engine in it takes
one core. A decode step keeps a core busy too, so on a machine with few cores the control
says how much of the busy figure is the cores the transfer cannot have, not the worker.
The three conditions take turns, a few transfers each, for a few rounds, so the shared
machine's drift falls on all of them; each figure is the median transfer.

The sender runs in this process with one torch thread, as prefill workers do. The source
blocks are random, shaped like the worker's cache; every transfer is one request's whole
prompt, all layers at once (no prefill computes), passthrough on the wire.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time

import torch

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.kv_cache import PagedKVCache
from engine.named_models import DEFAULT_MODEL
from engine.sampling_params import SamplingParams
from kv_transfer.connector import KVSendSide, transport
from kv_transfer.options import KVTransferOptions
from workers.options import WorkerOptions

TOKEN = "bench-busy-token"


class BenchDecodeWorker(DecodeWorker):
    """A decode worker (Ray actor, a process of its own, as in a cluster) that can be kept
    busy with local requests."""

    def keep_busy(self, batch: int) -> None:
        params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
        with self.loop.lock:
            for i in range(batch):
                self.engine.add_request([(i * 7 + j) % 1000 + 100 for j in range(64)], params)
        self.loop.wake()
        while len(self.engine.scheduler.running) < batch:  # their prompts computed
            time.sleep(0.05)

    def stop_busy(self) -> None:
        with self.loop.lock:
            for seq in list(self.engine.scheduler.running):
                self.engine.abort(seq.request_id)

    def shape(self) -> dict:
        cache = self.engine.cache
        return {
            "model_config": self.engine.model_config,
            "block_size": cache.block_size,
            "dtype": cache.dtype,
            "bytes_per_block": cache.bytes_per_block(),
            "steps": self.loop.steps,
        }


def _source_cache(shape: dict, tokens: int) -> PagedKVCache:
    """A prefill-side cache shaped like the worker's, its first blocks random."""
    blocks = -(-tokens // shape["block_size"])
    cache = PagedKVCache(
        shape["model_config"], blocks, shape["block_size"], shape["dtype"], torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(0)
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache


def _transfer_s(worker, send: KVSendSide, cache: PagedKVCache, tokens: int, index: int) -> float:
    import ray

    request_id = f"transfer-{index}"
    prompt = [(i * 31) % 1000 + 100 for i in range(tokens)]
    reservation = ray.get(worker.reserve.remote(request_id, prompt, SamplingParams(max_tokens=1)))
    block_ids = torch.arange(-(-tokens // cache.block_size), dtype=torch.int64)
    start = time.perf_counter()
    stream = send.open(reservation.kv, request_id, tokens)
    for layer in range(cache.num_layers):
        stream.send_layer(layer, block_ids)
    stream.finish(first_token=0)
    seconds = time.perf_counter() - start
    ray.get(worker.cancel.remote(request_id))
    return seconds


def measure_into_decode_worker(
    model: str = DEFAULT_MODEL,
    tokens: int = 2048,
    rounds: int = 3,
    per_round: int = 4,
    batch: int = 16,
    kv_transport: str = "grpc",
) -> dict:
    import ray

    from cluster.ray_env import prepare_ray_environment

    prepare_ray_environment(None)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    kv = KVTransferOptions(
        transport=kv_transport, token=TOKEN, wire_dtype="passthrough", lease_timeout_s=600
    )
    options = WorkerOptions(
        model=model,
        # the batch's prompts and a few hundred tokens each, plus two transfers in flight
        engine=EngineConfig(num_kv_blocks=batch * 24 + 2 * (-(-tokens // 16)) + 8),
        kv=kv,
        torch_threads=1,
    ).to_dict()
    worker = (
        ray.remote(BenchDecodeWorker)
        .options(num_cpus=0, max_concurrency=8)
        .remote(options, "decode-bench")
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the sender as a prefill worker runs it
    seconds: dict[str, list[float]] = {"idle": [], "busy": [], "core_taken": []}
    busy_steps = busy_time = 0.0
    try:
        shape = ray.get(worker.shape.remote())
        kv_bytes = shape["bytes_per_block"] * -(-tokens // shape["block_size"])
        cache = _source_cache(shape, tokens)
        send = transport(kv.transport).send_side(cache, shape["model_config"].fingerprint(), kv)
        index = 0

        def transfers(condition: str) -> None:
            nonlocal index
            for _ in range(per_round):
                seconds[condition].append(_transfer_s(worker, send, cache, tokens, index))
                index += 1

        try:
            _transfer_s(worker, send, cache, 64, -1)  # warm-up: channel, code paths
            for _ in range(rounds):
                transfers("idle")
                ray.get(worker.keep_busy.remote(batch))
                steps_before, start = ray.get(worker.shape.remote())["steps"], time.perf_counter()
                transfers("busy")
                busy_time += time.perf_counter() - start
                busy_steps += ray.get(worker.shape.remote())["steps"] - steps_before
                ray.get(worker.stop_busy.remote())
                with _cpu_bound_process():
                    transfers("core_taken")
        finally:
            send.close()
    finally:
        torch.set_num_threads(threads)
        ray.kill(worker)
        if started_ray:
            ray.shutdown()
    median = {c: statistics.median(s) for c, s in seconds.items()}
    return {
        "model": model,
        "tokens": tokens,
        "kv_bytes": kv_bytes,
        "transfers_per_condition": rounds * per_round,
        "idle_gb_s": kv_bytes / median["idle"] / 1e9,
        "busy_gb_s": kv_bytes / median["busy"] / 1e9,
        "busy_share": median["idle"] / median["busy"],
        "core_taken_gb_s": kv_bytes / median["core_taken"] / 1e9,
        "core_taken_share": median["idle"] / median["core_taken"],
        "seconds": seconds,
        "decode_steps_per_s": busy_steps / busy_time,
        "batch": batch,
        "transport": kv_transport,
        "cpu_count": os.cpu_count(),
    }


@contextlib.contextmanager
def _cpu_bound_process():
    """A process that keeps one core busy (pure Python, no memory traffic) while inside."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        process.kill()
        process.wait()


def format_result(r: dict) -> str:
    return (
        f"into a decode worker ({r['model']}, {r['tokens']} tokens = "
        f"{r['kv_bytes'] / 2**20:.1f} MiB per transfer, {r['transport']}, passthrough, median of "
        f"{r['transfers_per_condition']} each): idle {r['idle_gb_s']:.2f} GB/s; decoding a "
        f"batch of {r['batch']} ({r['decode_steps_per_s']:.1f} steps/s) {r['busy_gb_s']:.2f} "
        f"GB/s = {r['busy_share']:.0%} of idle (target >= 80%); control, idle with one of the "
        f"{r['cpu_count']} cores taken by a CPU-bound process: {r['core_taken_gb_s']:.2f} GB/s "
        f"= {r['core_taken_share']:.0%} of idle"
    )
