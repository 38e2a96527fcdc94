"""Regenerate the Python code of every ``.proto`` file in this folder.

Usage: ``python -m protos.generate`` (needs ``grpcio-tools``, in the ``dev`` extra).
``python -m protos.generate --check`` regenerates into a temporary folder and exits 1 if any
checked-in file differs (the staleness test uses :func:`generate` the same way).

grpc_tools writes ``import foo_pb2 as foo__pb2`` in ``foo_pb2_grpc.py``, which only works with
``protos/`` on ``sys.path``; the import is rewritten to ``from protos import foo_pb2`` so the
generated modules import as part of the ``protos`` package.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    return sorted(proto_dir.glob("*.proto"))


def _fix_imports(text: str, package: str) -> str:
    # "import kv_transfer_pb2 as kv__transfer__pb2" -> "from protos import kv_transfer_pb2 as ..."
    return re.sub(
        r"^import (\w+_pb2) as (\w+)$", rf"from {package} import \1 as \2", text, flags=re.M
    )


def generate(out_dir: Path = PROTO_DIR, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on every .proto in ``proto_dir``, writing ``*_pb2.py`` and ``*_pb2_grpc.py``
    into ``out_dir``. Returns the written files. Raises RuntimeError if protoc fails."""
    from grpc_tools import protoc

    protos = proto_files(proto_dir)
    if not protos:
        return []
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    written = []
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            path = out_dir / f"{proto.stem}{suffix}"
            path.write_text(_fix_imports(path.read_text(), "protos"))
            written.append(path)
    return written


def stale_files(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Names of generated files that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), proto_dir)
        return [
            f.name
            for f in fresh
            if not (proto_dir / f.name).exists()
            or (proto_dir / f.name).read_text() != f.read_text()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: protos/{name} (run python -m protos.generate)")
        return 1 if stale else 0
    for path in generate():
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
