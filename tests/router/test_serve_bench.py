from __future__ import annotations

import argparse
import json
import random

import pytest

from benchmarks.serve_bench import add_serve_bench_parser, parse_distribution


def test_distributions():
    rng = random.Random(0)
    assert parse_distribution("128")(rng) == 128
    assert all(64 <= parse_distribution("uniform:64:256")(rng) <= 256 for _ in range(100))
    assert all(parse_distribution("normal:4:10")(rng) >= 1 for _ in range(100))
    for bad in ("0", "x", "uniform:5", "uniform:9:3", "gamma:1:2", "normal:0:1"):
        with pytest.raises(ValueError):
            parse_distribution(bad)


def test_bench_against_live_router(router, backend, tmp_path, capsys):
    backend.delay_s = 0.005
    parser = argparse.ArgumentParser()
    add_serve_bench_parser(parser.add_subparsers())
    out, plot = tmp_path / "bench.json", tmp_path / "cdf.png"
    args = parser.parse_args(
        ["serve", "--url", router.url, "--rate", "20", "--duration", "2",
         "--input-len", "uniform:8:64", "--output-len", "normal:24:6",
         "--slo-ttft-ms", "500", "--slo-tpot-ms", "100",
         "--json-out", str(out), "--plot", str(plot)]
    )  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "goodput" in printed
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["failed"] == 0 and 15 <= summary["completed"] <= 70
    assert summary["ttft_ms"]["p99"] is not None and summary["tpot_ms"]["p50"] > 0
    assert summary["goodput"] > 0
    # max_tokens from the output distribution, ignore_eos, prompt ids of the drawn lengths
    assert all(c.params.ignore_eos for c in backend.calls)
    assert all(8 <= len(c.prompt_token_ids) <= 64 for c in backend.calls)
    assert {r["num_tokens"] for r in result["requests"]} == {
        r["output_len"] for r in result["requests"]
    }
    assert plot.stat().st_size > 1000
