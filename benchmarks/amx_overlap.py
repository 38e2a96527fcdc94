"""Whether this CPU overlaps AMX tile products with vector and scalar work on one core.

Builds benchmarks/amx_overlap.c with the compiler the C kernels use, runs it, and prints per
kind of work: its time alone, the 4 tile products' time alone (the baseline), and both in one
loop. "serialised" is how much of the shorter one the pair fails to hide: 0% = it fully
overlaps (time = the longer one), 100% = no overlap (time = the sum).

    python -m benchmarks.amx_overlap [--rounds 2000000]

Measured on the Xeon of 2026-12-06 (a VM; noisy, ranges over runs): the attention's 2^x on
16 lanes 65-95% serialised in rounds longer than the products, on 8 lanes 0-17%; yet the
kernel's softmax in 8 lanes ran 1.2x slower, not faster: in the kernel the products come with
tile loads and stores (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.kernels import cpu_native

SOURCE = Path(__file__).with_name("amx_overlap.c")


def build(directory: str) -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("amx_overlap: no C compiler here (cc or gcc)")
    binary = Path(directory) / "amx_overlap"
    subprocess.run([compiler, "-O3", "-march=native", str(SOURCE), "-o", str(binary)], check=True)
    return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    lib = cpu_native.library()
    if lib is None or not lib.amx_gemm_available():
        print("amx_overlap: this CPU (or its kernel) offers no AMX tiles", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as directory:
        result = subprocess.run(
            [str(build(directory)), str(args.rounds)], check=True, capture_output=True, text=True
        )
    print(f"{'work':>20} {'alone ns':>9} {'products ns':>12} {'both ns':>8} {'serialised':>11}")
    for line in result.stdout.splitlines():
        kind, count, alone, both, products = line.split()
        alone, both, products = float(alone), float(both), float(products)
        hidden = alone + products - both  # of the shorter one's time
        share = 1 - hidden / min(alone, products)
        print(
            f"{kind + ' ' + count:>20} {alone:>9.2f} {products:>12.2f} {both:>8.2f} {share:>10.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
