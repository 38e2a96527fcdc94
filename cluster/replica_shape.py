"""What one replica of a pool reserves, as plain data (no Ray import: the config builds it,
and Ray reads its environment when first imported)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaShape:
    """What one replica of a pool reserves: a bundle of Ray resources, on nodes whose labels
    match ``labels``."""

    bundle: Mapping[str, float]
    labels: Mapping[str, str]

    def describe(self) -> str:
        """The bundle as a person reads it: "8 GPU, 16 CPU, accelerator_type:H100"."""
        parts = []
        for name in ("GPU", "CPU"):
            if self.bundle.get(name):
                parts.append(f"{self.bundle[name]:g} {name}")
        parts += [
            name if value <= 0.01 else f"{value:g} {name}"
            for name, value in sorted(self.bundle.items())
            if name not in ("GPU", "CPU")
        ]
        where = ", ".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        return ", ".join(parts) + (f" on a node labelled {where}" if where else "")

    def fits(self, resources: Mapping[str, float], labels: Mapping[str, str]) -> bool:
        """Whether a node with these resources (and labels) could hold the bundle."""
        if not all(label_matches(labels.get(k), v) for k, v in self.labels.items()):
            return False
        return all(resources.get(name, 0.0) >= need - 1e-9 for name, need in self.bundle.items())


def label_matches(value: str | None, selector: str) -> bool:
    """Ray's label selector syntax: ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)``."""
    negated = selector.startswith("!")
    selector = selector[1:] if negated else selector
    if selector.startswith("in(") and selector.endswith(")"):
        matched = value in {v.strip() for v in selector[3:-1].split(",")}
    else:
        matched = value == selector
    return matched != negated
