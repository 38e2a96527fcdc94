"""The disaggregated cluster end to end on local Ray (CPU, tiny model): the OpenAI API,
exactness against the offline engine, load, cancellation, and requests that cannot fit."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from cluster.launcher import stop_cluster
from engine import LLM, SamplingParams
from tests.integration.conftest import start

# Token-exact against the offline engine, which runs with other threads: one GEMM library.
ENGINE = {
    "num_kv_blocks": 96,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
    "cpu_gemm": "torch",
}
PROMPTS = [
    "Hello, world",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "a",
    "KV cache " * 12,
]


def wait_idle(cluster, timeout_s: float = 20.0) -> dict:
    """Every actor's stats once all KV blocks are free again (or the last stats on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {name: ray.get(h.stats.remote()).to_dict() for name, h in cluster.workers().items()}
        decode_free = all(
            s["free_blocks"] == s["num_blocks"] and s.get("leases", 0) == 0
            for n, s in stats.items()
            if n.startswith("decode")
        )
        prefill_free = all(
            s["kv_usage"] == 0 and s["running"] == 0
            for n, s in stats.items()
            if n.startswith("prefill")
        )
        if (decode_free and prefill_free) or time.monotonic() > deadline:
            return stats


@pytest.fixture(scope="module")
def cluster(ray_session):
    # Dataflow tests: every request is served however long it queues for the small KV
    # cache (SLO admission would refuse part of a 64-request burst; test_faults tests it).
    running = start(
        {
            "engine": ENGINE,
            "kv": {"wire_dtype": "passthrough"},
            "router": {"limits": {"slo_admission": False}},
        }
    )
    yield running
    stop_cluster(running)


@pytest.fixture(scope="module")
def openai_client(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.urls["http"] + "/v1", api_key="unused", max_retries=0)


def test_openai_completions_and_chat(openai_client):
    done = openai_client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0
    )
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens >= 1
    chunks = list(
        openai_client.completions.create(
            model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    chat = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    streamed = list(
        openai_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content


def test_greedy_and_seeded_outputs_equal_the_offline_engine(cluster):
    llm = LLM("tiny", progress=False, **ENGINE)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3}
    # The first token is sampled on the prefill worker (history: the prompt), the rest on
    # decode (history: prompt + output): processed alike, they equal one engine's.
    processed = SamplingParams(
        max_tokens=20, temperature=0.8, seed=5, ignore_eos=True, logit_bias=((7, 3.0),), **penalties
    )
    url = cluster.urls["http"] + "/v1/completions"
    for params, extra in (
        (greedy, {"temperature": 0}),
        (seeded, {"temperature": 0.8, "top_p": 0.9, "seed": 11}),
        (processed, {"temperature": 0.8, "seed": 5, "logit_bias": {"7": 3.0}, **penalties}),
    ):
        expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
        got = []
        for prompt in PROMPTS:
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 20,
                "ignore_eos": True,
                "return_token_ids": True,
                **extra,
            }
            response = httpx.post(url, json=body, timeout=60)
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["token_ids"])
        assert got == expected


def test_a_list_of_prompts_echo_and_logit_bias_through_the_openai_client(openai_client):
    def complete(prompt, **options):
        options = {"max_tokens": 6, "temperature": 0, **options}
        return openai_client.completions.create(model="tiny", prompt=prompt, **options)

    batch = complete(PROMPTS[:3])
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [complete(p).choices[0].text for p in PROMPTS[:3]]
    assert batch.usage.completion_tokens == 18

    echoed = complete(PROMPTS[0], echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + complete(PROMPTS[0]).choices[0].text

    biased = complete(
        PROMPTS[1],
        temperature=1.0,
        seed=3,
        logit_bias={"42": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert biased.choices[0].model_extra["token_ids"] == [42] * 6

    streamed = list(complete(PROMPTS[:2], stream=True))
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in batch.choices[:2]]


def router_counter(cluster, name: str) -> float:
    text = httpx.get(cluster.urls["http"] + "/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_n_choices_share_one_prefill_and_one_transfer(cluster, openai_client):
    prompt = "Forks of one prompt share its blocks. " * 3  # not seen before: no prefix hits
    prefill = cluster.workers()["prefill-0"]
    before = {
        name: router_counter(cluster, name)
        for name in ("pdcluster_prefills_total", "pdcluster_kv_transfers_total")
    }
    computed = ray.get(prefill.stats.remote()).load.prompt_tokens_computed
    out = openai_client.completions.create(
        model="tiny",
        prompt=prompt,
        n=4,
        max_tokens=10,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for name, value in before.items():
        assert router_counter(cluster, name) == value + 1, name
    llm = LLM("tiny", progress=False, **ENGINE)
    num_prompt = len(llm.tokenizer.encode(prompt))
    assert ray.get(prefill.stats.remote()).load.prompt_tokens_computed == computed + num_prompt
    assert out.usage.prompt_tokens == num_prompt and out.usage.completion_tokens == 40
    # choice i is the prompt sampled with seed 7 + i, as one engine samples it
    expected = [
        llm.generate(
            prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i, ignore_eos=True)
        )[0].token_ids
        for i in range(4)
    ]
    assert [c.model_extra["token_ids"] for c in out.choices] == expected
    assert len({tuple(t) for t in expected}) == 4

    greedy = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8, temperature=0
    )
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    streamed = openai_client.completions.create(
        model="tiny", prompt=prompt, n=2, max_tokens=5, temperature=0, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] and texts[0]
    stats = wait_idle(cluster)
    assert all(
        s["free_blocks"] == s["num_blocks"] for n, s in stats.items() if n.startswith("decode")
    )


def test_echo_returns_the_prompt_with_its_logprobs(openai_client):
    prompt = PROMPTS[1]
    llm = LLM("tiny", progress=False, **ENGINE)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)
    offline = llm.generate(prompt, params)[0]
    for stream in (False, True):
        response = openai_client.completions.create(
            model="tiny",
            prompt=prompt,
            echo=True,
            logprobs=2,
            max_tokens=3,
            temperature=0,
            stream=stream,
        )
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in logprobs for t in lp.tokens]
        values = [v for lp in logprobs for v in lp.token_logprobs]
        num_prompt = len(offline.prompt_token_ids)
        assert text.startswith(prompt) and len(tokens) == num_prompt + 3
        assert values[0] is None
        expected = [lp.logprob for lp in offline.prompt_logprobs[1:]]
        assert values[1:num_prompt] == pytest.approx(expected, abs=1e-4)
        assert logprobs[0].top_logprobs[0] is None and len(logprobs[0].top_logprobs[1]) == 2


def test_64_concurrent_requests_complete_and_free_every_block(cluster):
    async def run():
        async with httpx.AsyncClient(base_url=cluster.urls["http"], timeout=120) as client:

            async def one(i: int):
                body = {
                    "model": "tiny",
                    "prompt": "x" * (1 + (i * 37) % 150),
                    "max_tokens": 1 + (i * 7) % 30,
                    "ignore_eos": True,
                    "temperature": 0.7,
                    "seed": i,
                    "stream": i % 2 == 0,
                }
                response = await client.post("/v1/completions", json=body)
                return i, response

            return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(run())
    for i, response in results:
        assert response.status_code == 200, (i, response.text)
        if i % 2:
            assert response.json()["usage"]["completion_tokens"] == 1 + (i * 7) % 30
        else:
            assert response.text.rstrip().endswith("data: [DONE]")
    stats = wait_idle(cluster)
    for name, s in stats.items():
        if name.startswith("decode"):
            assert s["free_blocks"] == s["num_blocks"], (name, s)
            assert s["leases"] == 0 and s["running"] == 0
        else:
            assert s["kv_usage"] == 0 and s["running"] == 0, (name, s)


def test_cancelled_stream_frees_blocks_on_both_sides(cluster):
    async def run():
        async with httpx.AsyncClient(base_url=cluster.urls["http"], timeout=60) as client:
            body = {
                "model": "tiny",
                "prompt": "cancel me " * 10,
                "max_tokens": 1200,
                "ignore_eos": True,
                "stream": True,
            }
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                received = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        received += 1
                    if received >= 3:
                        break  # leaving the block closes the connection mid-stream
            return received

    assert asyncio.run(run()) >= 3
    stats = wait_idle(cluster)
    decode = stats["decode-0"]
    assert decode["free_blocks"] == decode["num_blocks"] and decode["running"] == 0


def test_request_that_can_never_fit_is_a_400(cluster):
    # 96 blocks x 16 tokens = 1536 tokens of KV: a prompt of 1,200 plus 1,000 new tokens
    # can never fit in one decode actor.
    body = {"model": "tiny", "prompt": list(range(3, 250)) * 5, "max_tokens": 1000}
    response = httpx.post(cluster.urls["http"] + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert "KV cache" in response.json()["error"]["message"]


def test_metrics_and_health(cluster):
    health = httpx.get(cluster.urls["http"] + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["prefill"] == 1 and health["decode"] == 1
    metrics = httpx.get(cluster.urls["http"] + "/metrics", timeout=10).text
    for name in ("ttft", "tpot", "kv_usage", "transfer_bytes"):
        assert name in metrics


def test_fp8_wire_stays_within_tolerance(ray_session, cluster):
    """A second cluster whose KV travels as fp8 (the decode cache is full precision)."""
    stop_cluster(cluster)  # free the actor names; the module fixture's teardown is then a no-op
    running = start({"engine": ENGINE, "kv": {"wire_dtype": "fp8"}})
    try:
        llm = LLM("tiny", progress=False, **ENGINE)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
        agree = total = 0
        for prompt, want in zip(PROMPTS, expected, strict=True):
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            got = httpx.post(running.urls["http"] + "/v1/completions", json=body, timeout=60).json()
            tokens = got["choices"][0]["token_ids"]
            assert tokens[0] == want[0]  # the first token comes from the exact prefill
            agree += sum(a == b for a, b in zip(tokens, want, strict=True))
            total += len(want)
        print(f"fp8 wire greedy token agreement with the offline engine: {agree}/{total}")
        assert agree / total >= 0.5
    finally:
        stop_cluster(running)
