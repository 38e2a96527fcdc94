"""The transfer benchmark runs end to end on a small layer stack, and its CLI parser works."""

from __future__ import annotations

import argparse

from benchmarks.transfer_bench import (
    add_transfer_parser,
    available_modes,
    format_header,
    format_row,
    run_transfer_benchmark,
)
from benchmarks.transfer_nixl_bench import NIXL_MODES
from tests.kv_transfer.helpers import MODEL


def test_benchmark_rows_on_a_small_stack():
    lines = []
    rows = run_transfer_benchmark([20, 64], repeats=1, model=MODEL, log=lines.append)
    modes = available_modes()
    assert [r["tokens"] for r in rows] == [20, 64] and len(lines) == 3
    for row in rows:
        assert row["raw_gb_s"] > 0
        if set(modes) & set(NIXL_MODES):  # the NIXL path's bounds: a memcpy, a READ alone
            assert row["memcpy_gb_s"] > 0 and row["nixl_read_gb_s"] > 0
        for mode in modes:
            assert row[mode]["payload_gb_s"] > 0 and row[mode]["effective_kv_gb_s"] > 0
        # fp8 moves about half the bytes of bf16 (plus scales and the padded last block)
        assert row["fp8"]["payload_bytes"] < 0.75 * row["passthrough"]["payload_bytes"]
    header_cells = format_header(modes).splitlines()[0].count("|")
    assert format_row(rows[0], modes).count("|") == header_cells


def test_parser_registers_transfer():
    parser = argparse.ArgumentParser()
    bench = parser.add_subparsers(dest="bench")
    add_transfer_parser(bench)
    args = parser.parse_args(["transfer", "--tokens", "16", "--modes", "fp8", "--repeats", "1"])
    assert args.tokens == "16" and args.modes == "fp8" and callable(args.func)
