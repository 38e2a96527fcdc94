"""docs/structure.md's request lifecycle names functions that exist: each ``Class.method``
is a method (or attribute) of a class of that name, each other name a class or function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kv_transfer", "workers", "prefill_worker", "decode_worker", "router")


def _definitions() -> tuple[dict[str, set[str]], set[str]]:
    classes: dict[str, set[str]] = {}
    functions: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    members = classes.setdefault(node.name, set())
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            members.add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            members.add(item.target.id)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    functions.add(node.name)
    return classes, functions


def test_every_name_in_the_lifecycle_exists():
    doc = (ROOT / "docs" / "structure.md").read_text()
    lifecycle = doc[doc.index("## A request's life") : doc.index("## Words")]
    names = set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`", lifecycle))
    assert len(names) > 20
    classes, functions = _definitions()
    missing = []
    for name in sorted(names):
        owner, _, member = name.rpartition(".")
        if owner:
            if member not in classes.get(owner, ()):
                missing.append(name)
        elif name not in classes and name not in functions:
            missing.append(name)
    assert not missing, f"docs/structure.md names what the code does not have: {missing}"
