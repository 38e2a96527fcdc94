"""Colocated mode (the baseline) and prefix reuse on the prefill pool."""

from __future__ import annotations

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
