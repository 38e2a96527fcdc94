"""An engine's load at one moment (``LLMEngine.load``): what routing, admission and the planner
weigh replicas by."""

from __future__ import annotations

from dataclasses import dataclass

from engine.step_cost import StepCost


@dataclass(frozen=True)
class EngineLoad:
    running: int = 0  # sequences in the running batch
    waiting: int = 0  # sequences queued for their (next) prompt chunk
    queued_tokens: int = 0  # prompt tokens the waiting sequences still need computed
    oldest_wait_s: float = 0.0
    num_blocks: int = 0
    free_blocks: int = 0
    kv_usage: float = 0.0  # fraction of blocks in use
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache, ever
    prefix_query_tokens: int = 0  # prompt tokens looked up in it, ever
    step_cost: StepCost | None = None  # from this replica's own recent steps
    prompt_tokens_computed: int = 0  # ever
    preemptions: int = 0  # ever, recomputed or swapped
    max_num_seqs: int = 0
    recomputes: int = 0  # preemptions recomputed, ever
    swaps_out: int = 0  # preemptions swapped out to the host KV tier, ever
    swaps_in: int = 0  # swapped sequences loaded back, ever
    host_blocks: int = 0  # the host KV tier's slots (0: no tier)
    host_blocks_used: int = 0  # of those, holding cached prefix blocks or swapped ones
    host_hit_tokens: int = 0  # of prefix_hit_tokens, loaded from the host tier, ever
    host_offloads: int = 0  # blocks copied device → host, ever
    host_loads: int = 0  # blocks copied host → device, ever
