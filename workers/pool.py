"""The pools a worker actor belongs to. A str enum: a pool is also its config key, actor name
prefix and metric label, so ``Pool.PREFILL == "prefill"``."""

from __future__ import annotations

from enum import StrEnum


class Pool(StrEnum):
    PREFILL = "prefill"  # computes prompts, streams their KV to decode
    DECODE = "decode"  # receives KV, decodes
    COLOCATED = "colocated"  # both phases in one engine (the baseline mode)

    @property
    def computes_prompts(self) -> bool:
        return self in (Pool.PREFILL, Pool.COLOCATED)

    @property
    def decodes(self) -> bool:
        return self in (Pool.DECODE, Pool.COLOCATED)
