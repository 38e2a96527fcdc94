"""The generated gRPC code in protos/ matches the .proto files (regenerate with
``python -m protos.generate``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from protos import generate

# Version stamps change with the grpcio-tools release, not with the .proto files.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$", re.M
)


def test_generated_code_is_fresh(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    # protoc in a process of its own: grpc_tools' bundled C++ libraries crash when loaded
    # into a process that has loaded NIXL's (the NIXL transport's tests may have run here).
    code = f"from pathlib import Path; from protos import generate; generate.generate(Path({str(tmp_path)!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    fresh = [tmp_path / p.name for p in sorted(generate.PROTO_DIR.glob("*_pb2*.py"))]
    assert fresh, "no .proto files found"
    for path in fresh:
        checked_in = generate.PROTO_DIR / path.name
        assert checked_in.exists(), f"protos/{path.name} missing: run python -m protos.generate"
        assert _VERSION_LINES.sub("", checked_in.read_text()) == _VERSION_LINES.sub(
            "", path.read_text()
        ), f"protos/{path.name} is stale: run python -m protos.generate"


def test_generated_modules_import_as_a_package():
    from protos import kv_transfer_pb2, kv_transfer_pb2_grpc

    assert kv_transfer_pb2_grpc.kv__transfer__pb2 is kv_transfer_pb2
