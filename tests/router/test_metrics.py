from __future__ import annotations

import httpx

from router import Overloaded


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")


def test_metrics_after_requests(router, backend):
    before = httpx.get(f"{router.url}/metrics").text
    for _ in range(2):
        httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8})
    httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    backend.error = Overloaded()
    httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"})
    resp = httpx.get(f"{router.url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text

    def delta(series: str) -> float:
        try:
            old = _value(before, series)
        except AssertionError:
            old = 0.0
        return _value(text, series) - old

    assert delta("pdcluster_router_ttft_seconds_count") == 2
    assert delta("pdcluster_router_tpot_seconds_count") == 2
    assert delta("pdcluster_router_e2e_latency_seconds_count") == 2
    assert 'pdcluster_router_ttft_seconds_bucket{le="+Inf"}' in text
    assert delta('pdcluster_router_requests_total{api="completions",status="ok"}') == 2
    assert delta('pdcluster_router_requests_total{api="completions",status="rejected_400"}') == 1
    assert delta('pdcluster_router_requests_total{api="completions",status="overloaded"}') == 1
    assert delta("pdcluster_router_generation_tokens_total") == 16
    assert delta("pdcluster_router_prompt_tokens_total") == 6
    assert _value(text, 'pdcluster_queue_tokens{actor="prefill-0"}') == 12
    assert _value(text, 'pdcluster_running_requests{actor="decode-0"}') == 3
    assert _value(text, 'pdcluster_kv_usage{actor="decode-0"}') == 0.25
    assert _value(text, "pdcluster_kv_transfer_bytes_total") == 1024
    assert _value(text, "pdcluster_kv_transfer_seconds_total") == 0.5
    assert _value(text, "pdcluster_backend_router_waiting") == 2
    assert _value(text, 'pdcluster_prefix_cache_queries_total{actor="prefill-0"}') == 300
    assert _value(text, 'pdcluster_prefix_cache_hits_total{actor="prefill-0"}') == 192
    assert _value(text, 'pdcluster_kv_index_blocks{actor="prefill-0"}') == 40
    assert _value(text, 'pdcluster_router_prefill_routing_total{reason="overlap"}') == 5
    assert _value(text, "pdcluster_router_requests_in_flight") == 0


def test_grpc_requests_count_in_the_same_registry(router):
    from router.client import RouterClient

    with RouterClient(f"127.0.0.1:{router.grpc_port}") as client:
        client.generate("Hi", max_tokens=3)
    text = httpx.get(f"{router.url}/metrics").text
    assert _value(text, 'pdcluster_router_requests_total{api="grpc",status="ok"}') >= 1


def test_cancelled_requests_are_counted(router, backend):
    backend.delay_s = 0.05
    with httpx.stream(
        "POST",
        f"{router.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 99, "stream": True},
    ) as resp:
        next(resp.iter_lines())
    assert backend.cancel_seen.wait(5)
    text = httpx.get(f"{router.url}/metrics").text
    assert (
        _value(text, 'pdcluster_router_requests_total{api="completions",status="cancelled"}') >= 1
    )


def test_a_prompt_with_n_choices_counts_its_tokens_once(router, backend):
    before = httpx.get(f"{router.url}/metrics").text
    body = {"prompt": "hi", "max_tokens": 4, "n": 3}
    response = httpx.post(f"{router.url}/v1/completions", json=body)
    assert response.status_code == 200 and len(response.json()["choices"]) == 3
    text = httpx.get(f"{router.url}/metrics").text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    delta = _value(text, "pdcluster_router_prompt_tokens_total") - _value(
        before, "pdcluster_router_prompt_tokens_total"
    )
    assert delta == prompt_tokens
