"""bench host-tier on the tiny model: its ideal, and a run where the tier serves the evicted
documents that the engine without one recomputes."""

from __future__ import annotations

import argparse
import json

from benchmarks.host_tier_bench import add_host_tier_parser, ideal_prefix_tokens, working_set


def test_the_ideal_counts_each_documents_blocks_after_its_first_question():
    prompts = working_set(320, documents=3, doc_tokens=32, questions=2, question_len=5, seed=0)
    assert [len(p) for p in prompts] == [37] * 6
    assert prompts[0][:32] == prompts[3][:32] and prompts[0][32:] != prompts[3][32:]
    assert ideal_prefix_tokens(prompts, 16) == 3 * 32


def test_the_tier_serves_what_the_engine_without_it_recomputes(capsys):
    parser = argparse.ArgumentParser()
    add_host_tier_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(
        [
            "host-tier",
            "--model",
            "tiny",
            "--device-blocks",
            "8",
            "--documents",
            "4",
            "--questions",
            "2",
            "--json",
        ]  # fmt: skip
    )
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out)
    base, tier = summary["runs"]["no tier"], summary["runs"]["host tier"]
    assert summary["ideal_prefix_tokens"] == 4 * 2 * 16
    assert base["host_hit_tokens"] == 0 and tier["host_hit_tokens"] > 0
    assert tier["of_ideal"] > base["of_ideal"] and summary["bar_met"]
    assert tier["computed_tokens"] < base["computed_tokens"]
