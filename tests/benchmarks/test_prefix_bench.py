"""bench prefix's accounting: the ideal cached tokens (each prompt's longest prefix shared with
one sent before it, whole blocks, never the last token) and the summary's shares."""

from __future__ import annotations

from benchmarks.prefix_bench import PolicyRun, Turn, ideal_cached, summarize


def _turn(prompt: list[int], sent_at: float, cached: int = 0) -> Turn:
    return Turn(prompt, cached, sent_at, sent_at + 0.1, "")


def test_the_ideal_is_each_prompts_longest_prefix_sent_before_it_in_whole_blocks():
    system = list(range(40))  # 2 full blocks of 16 and 8 tokens
    first = _turn(system + [100] * 10, 0.0)  # nothing before it
    other = _turn(system + [200] * 10, 1.0)  # shares 40 tokens with first: 2 blocks
    follow = _turn(first.prompt_ids + [300] * 30, 2.0)  # its whole previous prompt: 50 → 3 blocks
    same = _turn(list(first.prompt_ids), 3.0)  # all of it but the last token: 49 → 3 blocks
    turns = [follow, other, same, first]  # any order: sent_at decides
    assert ideal_cached(turns, 16) == 0 + 32 + 48 + 48


def test_the_summary_reports_cached_against_ideal_and_the_largest_share():
    run = PolicyRun("kv_aware", computed={"prefill-0": 300, "prefill-1": 100})
    run.turns = [_turn(list(range(40)), 0.0), _turn(list(range(40)) + [1] * 8, 1.0, cached=32)]
    row = summarize(run, 16)
    assert row["ideal_cached_tokens"] == 32 and row["cached_of_ideal"] == 1.0
    assert row["largest_share"] == 0.75 and row["requests"] == 2 and row["errors"] == 0
