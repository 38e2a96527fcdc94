"""Tensor parallelism inside one engine (Megatron-style): which slice of every weight a rank
holds, and the model shape each rank computes.

Degree t over a model with Hq query heads, Hkv KV heads and MLP width I, rank r holds:
- query heads [r·Hq/t, (r+1)·Hq/t) — column-parallel rows of q_proj;
- KV heads split, Hkv/t each, when t <= Hkv; when t > Hkv (t a multiple of Hkv) each KV
  head is replicated on t/Hkv ranks: rank r holds head r // (t/Hkv), the one its query
  heads read (GQA groups never straddle ranks);
- MLP columns [r·I/t, (r+1)·I/t) of gate and up (column-parallel), the matching input
  columns of down_proj and of o_proj (row-parallel: each rank's partial sum, all-reduced);
- the embedding replicated (a lookup costs no FLOPs; a vocab-parallel one would add an
  all-reduce of the hidden states to every forward), the LM head on rank 0 only: rank 0
  samples, so only it needs logits, and no [tokens, vocab] gather crosses the ranks.
Each rank's paged cache holds only its KV heads (fp8 scales per block and local head).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import EngineError


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise EngineError, saying why, unless ``size`` ranks can split ``config``'s heads."""
    if not isinstance(size, int) or size < 1:
        raise EngineError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return
    hq, hkv = config.num_heads, config.num_kv_heads
    if hq % size:
        raise EngineError(
            f"tensor_parallel_size {size} does not divide the model's {hq} query heads "
            f"(choose a divisor of {hq}: {', '.join(map(str, _divisors(hq)))})"
        )
    if size <= hkv and hkv % size:
        raise EngineError(
            f"tensor_parallel_size {size} does not divide the model's {hkv} KV heads "
            f"(at most {hkv} ranks split them; more must be a multiple of {hkv})"
        )
    if size > hkv and size % hkv:
        raise EngineError(
            f"tensor_parallel_size {size} is more than the model's {hkv} KV heads but not a "
            f"multiple of it, so the KV heads cannot be replicated evenly"
        )
    if config.intermediate_size % size:
        raise EngineError(
            f"tensor_parallel_size {size} does not divide the MLP width {config.intermediate_size}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank`` of ``size`` over the full model ``config``."""

    config: ModelConfig
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise EngineError(f"rank {self.rank} is outside tensor parallel size {self.size}")

    def _share(self, count: int) -> range:
        """This rank's equal share of ``count`` things (``size`` divides ``count``)."""
        per_rank = count // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def q_heads(self) -> range:
        return self._share(self.config.num_heads)

    @property
    def kv_heads(self) -> range:
        hkv = self.config.num_kv_heads
        if self.size <= hkv:
            return self._share(hkv)
        head = self.rank // (self.size // hkv)
        return range(head, head + 1)

    def kv_heads_by_rank(self) -> tuple[tuple[int, int], ...]:
        """Every rank's KV heads [start, stop) at this degree (what a KV peer must know)."""
        ranks = (dataclasses.replace(self, rank=r).kv_heads for r in range(self.size))
        return tuple((heads.start, heads.stop) for heads in ranks)

    @property
    def mlp_columns(self) -> range:
        return self._share(self.config.intermediate_size)

    @property
    def has_lm_head(self) -> bool:
        return self.rank == 0

    @property
    def local_config(self) -> ModelConfig:
        """The model shape this rank computes: its heads and MLP columns, all else whole."""
        if self.size == 1:
            return self.config
        return dataclasses.replace(
            self.config,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.mlp_columns),
        )

    def describe(self) -> dict:
        """What a peer exchanging KV with this rank must know about its heads."""
        return {
            "tensor_parallel_size": self.size,
            "rank": self.rank,
            "kv_heads": [self.kv_heads.start, self.kv_heads.stop],
        }
