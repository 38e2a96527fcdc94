"""Runs the CPU-dependent tests (marker ``cpu_paths``) again as each smaller CPU would:
under every ``PDCLUSTER_MAX_CPU_ISA`` level below this CPU's own (an AMX machine also runs
``avx512``, ``avx2`` and ``none``; an AVX2 machine ``none``), so a change made on one kind
of machine is checked on the others' paths. `.ci/run` runs it after the whole suite.

    python -m tests.cpu_levels            # every level below this CPU's
    python -m tests.cpu_levels avx2 none  # these levels only
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from engine import cpu_isa


def main(argv: list[str]) -> int:
    levels = argv or cpu_isa.levels_below_cpu()
    for level in levels:
        if level not in cpu_isa.LEVELS:
            print(f"unknown level {level!r}: one of {', '.join(cpu_isa.LEVELS)}", file=sys.stderr)
            return 2
    print(f"this CPU's level: {cpu_isa.cpu_level()}; running the cpu_paths tests at: {levels}")
    failed = []
    for level in levels:
        env = {**os.environ, cpu_isa.VARIABLE: level}
        started = time.monotonic()
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "cpu_paths",
            "-p",
            "no:cacheprovider",
        ]
        code = subprocess.call(command, env=env)
        print(f"{cpu_isa.VARIABLE}={level}: exit {code} in {time.monotonic() - started:.0f} s")
        if code != 0:
            failed.append(level)
    if failed:
        print(f"failed at: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
