"""A cluster whose KV moves by NIXL (kv.transport: nixl): the same tokens as the offline engine,
and /metrics says NIXL carried the bytes. Skipped where NIXL cannot be installed."""

from __future__ import annotations

import re

import httpx
import pytest
import ray

from cluster.launcher import stop_cluster
from engine import LLM, SamplingParams
from kv_transfer.nixl_agent import nixl_unavailable
from tests.integration.conftest import start
from tests.integration.test_colocated_and_prefix import ENGINE, complete

pytestmark = pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))


def _counter(text: str, name: str, transport: str) -> float:
    match = re.search(rf'^{name}_total\{{transport="{transport}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_cluster_on_nixl_serves_the_offline_engines_tokens(ray_session):
    # every prompt over the transport under test, none prefilled on the decode replica
    local_off = {"routing": {"decode_local_prefill": 0}}
    running = start({"engine": ENGINE, "kv": {"transport": "nixl"}, "router": local_off})
    try:
        llm = LLM("tiny", progress=False, **ENGINE)
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for prompt in ("NIXL moves the pages " * 30, "short"):  # chunked, then one block
            expected = llm.generate([prompt], greedy)[0].token_ids
            assert complete(running.urls["http"], prompt)["choices"][0]["token_ids"] == expected
        metrics = httpx.get(running.urls["http"] + "/metrics", timeout=10).text
        assert _counter(metrics, "pdcluster_kv_transport_transfers", "nixl") == 2
        assert _counter(metrics, "pdcluster_kv_transport_bytes", "nixl") > 0
        assert _counter(metrics, "pdcluster_kv_transport_transfers", "grpc") == 0
        decode = ray.get(running.workers()["decode-0"].stats.remote())
        assert decode.decode.kv.transfers_completed == 2 and decode.decode.leases == 0
    finally:
        stop_cluster(running)
