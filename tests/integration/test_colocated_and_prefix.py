"""Colocated mode (the baseline) and prefix reuse on the prefill pool."""

from __future__ import annotations

import time

import httpx
import ray

from cluster.launcher import stop_cluster
from engine import LLM, SamplingParams
from tests.integration.conftest import start

# Token-exact against the offline engine, which runs with other threads: one GEMM library.
ENGINE = {
    "num_kv_blocks": 96,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 256,
    "cpu_gemm": "torch",
}


def complete(url: str, prompt, max_tokens: int = 12, **options) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **options,
    }
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_colocated_mode_serves_the_same_tokens(ray_session):
    running = start({"mode": "colocated", "engine": ENGINE})
    try:
        assert set(running.workers()) == {"colocated-0"}
        assert ray.get_actor("router", namespace="pdcluster") is not None
        llm = LLM("tiny", progress=False, **ENGINE)
        prompt = (
            "colocated baseline " * 20
        )  # longer than one step's budget: chunked, mixed with decodes
        expected = llm.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )[0]
        got = complete(running.urls["http"], prompt)
        assert got["choices"][0]["token_ids"] == expected.token_ids
        again = complete(running.urls["http"], prompt)  # from the replica's prefix cache
        assert again["choices"][0]["token_ids"] == expected.token_ids
        prompt_len = again["usage"]["prompt_tokens"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt_len - 1) // 16 * 16 > 0
        # n: one prefill, choice i sampled with seed + i; echo with the prompt's logprobs
        forked = complete(
            running.urls["http"], prompt, n=2, seed=3, temperature=1.0, echo=True, logprobs=1
        )
        sampled = [
            llm.generate(
                [prompt],
                SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True),
            )[0].token_ids
            for seed in (3, 4)
        ]
        assert [c["token_ids"] for c in forked["choices"]] == sampled
        logprobs = forked["choices"][1]["logprobs"]
        assert logprobs["token_logprobs"][0] is None
        assert len(logprobs["tokens"]) == len(expected.prompt_token_ids) + 12
        health = httpx.get(running.urls["http"] + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["mode"] == "colocated"
    finally:
        stop_cluster(running)


def test_repeated_system_prompt_is_not_recomputed_on_prefill(ray_session):
    running = start({"engine": ENGINE})
    try:
        prefill = running.workers()["prefill-0"]
        system = "You are a helpful assistant. Answer briefly and precisely. " * 2  # > 100 tokens
        complete(running.urls["http"], system + "Question one?")
        before = ray.get(prefill.stats.remote()).to_dict()
        complete(running.urls["http"], system + "Another question?")
        after = ray.get(prefill.stats.remote()).to_dict()
        hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        prompt_len = len(system.encode()) + len("Another question?") + 1  # bytes + BOS
        assert hit >= 96  # the system prompt's full blocks
        assert computed == prompt_len - hit
    finally:
        stop_cluster(running)


def _metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_conversation_follows_its_cached_prefix_across_two_prefill_replicas(ray_session):
    """KV-aware routing on a real cluster: each chat's next turn goes to the prefill replica
    that caches its previous prompt (the other holds at most the shared system prompt), is
    served from that cache (usage's cached_tokens, the replicas' hit counters) and gives the
    offline engine's greedy tokens."""
    # fp32: a prompt partly served from cache is computed in other chunks than offline,
    # which in bf16 may round a near-tie another way (README, "CPU dtype"); in fp32 it must not
    engine = {**ENGINE, "dtype": "float32"}
    running = start(
        {
            "engine": engine,
            "pools": {"prefill": {"replicas": 2}},
            "kv": {"wire_dtype": "passthrough"},
        }
    )
    try:
        url = running.urls["http"]
        llm = LLM("tiny", progress=False, **engine)
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        system = "You are a terse assistant who answers in one line. " * 2
        chats = [system + "Chat A: what is a block? ", system + "Chat B: name a prime. "]
        previous: dict[int, int] = {}  # each chat's last prompt length
        for _ in range(3):
            for index, chat in enumerate(chats):
                got = complete(url, chat, max_tokens=8)
                assert got["choices"][0]["token_ids"] == llm.generate([chat], greedy)[0].token_ids
                cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                if index in previous:  # at least its previous prompt's full blocks
                    assert cached >= (previous[index] - 1) // 16 * 16 > len(system)
                previous[index] = got["usage"]["prompt_tokens"]
                chats[index] = chat + got["choices"][0]["text"] + " And then? "
        time.sleep(1.0)  # the router's next read of the replicas' stats
        metrics = httpx.get(url + "/metrics", timeout=10).text
        hits = queries = 0.0
        for name in ("prefill-0", "prefill-1"):
            hits += _metric(metrics, "pdcluster_prefix_cache_hits_total", actor=name)
            queries += _metric(metrics, "pdcluster_prefix_cache_queries_total", actor=name)
        assert 0 < hits < queries
        assert _metric(metrics, "pdcluster_router_prefill_routing_total", reason="overlap") >= 4
    finally:
        stop_cluster(running)
