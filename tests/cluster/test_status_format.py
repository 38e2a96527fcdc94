"""`pdcluster status`'s text: each replica's node, load and prefix cache hit rate; a pending
one's wait and reason."""

from __future__ import annotations

from cluster.status import format_status


def _replica(name: str, **fields) -> dict:
    base = {
        "name": name,
        "state": "ready",
        "node": "10.0.0.2",
        "reason": "",
        "waited_s": 3.0,
        "age_s": 12.5,
        "running": 2,
        "queued_tokens": 64,
        "kv_usage": 0.25,
        "prefix_hit_rate": None,
    }
    return {**base, **fields}


def test_replicas_show_their_node_load_and_prefix_hit_rate():
    status = {
        "mode": "disaggregated",
        "model": "smollm2-135m",
        "urls": {"http": "http://127.0.0.1:8000"},
        "slo": {"percentile": 90, "ttft_ms": 2000, "tpot_ms": 200},
        "slo_attainment_60s": 0.95,
        "targets": {"prefill": 2},
        "pools": {
            "prefill": [
                _replica("prefill-0", prefix_hit_rate=0.734),
                _replica("prefill-1", state="pending", reason="no node has CPU: 1 free"),
            ],
            "decode": [_replica("decode-0")],
        },
        "planner_enabled": False,
    }
    text = format_status(status)
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    assert "node 10.0.0.2" in lines["prefill-0"] and "prefix hits 73%" in lines["prefill-0"]
    assert "prefix hits -" in lines["decode-0"]
    assert "pending" in lines["prefill-1"] and "no node has CPU: 1 free" in lines["prefill-1"]
