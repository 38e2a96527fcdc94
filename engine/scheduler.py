"""Chooses which tokens run in the next forward pass: continuous batching with chunked prefill.

Each step has a token budget. Running sequences decode first (one token each); the rest of
the budget goes to prompts, oldest first, a long prompt taking several steps (chunks). A
sequence is admitted only when blocks for all its current tokens can be allocated (reusing
cached prefix blocks). When a running sequence needs a block and none is free, the newest
running sequence is preempted: its blocks are freed and it is either recomputed later, or,
with a host KV tier, swapped out (its blocks copied to host slots and loaded back when it is
admitted again, no recompute), whichever costs less as measured (``preemption_mode``). A
sequence about to write into a block it shares with a fork gets its own copy first (the
batch lists the copies; the engine makes them before the forward pass).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import PREEMPTION_MODES
from engine.errors import EngineError
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """``preemption_mode``: "recompute" always; "swap" whenever the block manager's host
    tier has room; "auto" swaps where the tier's measured copies (out and back in) cost less
    than recomputing the sequence's tokens at ``prefill_token_s()`` seconds each (the step
    cost model's; None while unmeasured: recompute)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        preemption_mode: str = "auto",
        prefill_token_s: Callable[[], float | None] = lambda: None,
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise EngineError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                f"got {preemption_mode!r}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.prefill_token_s = prefill_token_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # ever, either way
        self.num_recomputes = 0  # preemptions that freed the blocks to recompute them
        self.num_swaps_out = 0  # preemptions that swapped the blocks out to the host tier
        self.num_swaps_in = 0  # swapped sequences loaded back

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        copies: list[tuple[int, int]] = []
        # 1. decode: one token for every running sequence, preempting the newest when full.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if not self._make_room_for_next_token(seq, copies):
                continue  # seq itself was preempted and removed from running
            seqs.append(seq)
            counts.append(1)
            budget -= 1
            index += 1
        # 2. prefill: prompts (or prompt chunks) oldest first, within the remaining budget.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.running and len(self.running) + 1 + len(seq.forks) > self.max_num_seqs:
                break  # its forks join the running sequences with it
            if seq.swapped_slots:
                if not self.block_manager.can_swap_in(seq.num_tokens):
                    break
                # Its computed tokens come back as they were: it goes on with its next token.
                seq.block_table = self.block_manager.swap_in(seq.swapped_slots, seq.num_tokens)
                seq.swapped_slots = []
                self.num_swaps_in += 1
            elif not seq.block_table:
                use_cache = seq.params.prompt_logprobs is None
                if not self.block_manager.can_allocate(seq.token_ids, use_cache=use_cache):
                    break
                seq.block_table, seq.num_cached_tokens = self.block_manager.allocate(
                    seq.token_ids, use_cache=use_cache
                )
                seq.num_computed_tokens = seq.num_cached_tokens
            chunk = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(chunk)
            budget -= chunk
            if chunk < seq.num_uncomputed_tokens:
                break  # the rest of this prompt goes in later steps
            self.waiting.popleft()
            self.running.append(seq)
        if not seqs:
            return None
        return ScheduledBatch(seqs, counts, copies)

    def _make_room_for_next_token(self, seq: Sequence, copies: list[tuple[int, int]]) -> bool:
        """A block for the token ``seq`` writes this step, its own (copied if shared);
        preempts the newest running sequences until there is one. False if ``seq`` itself
        was preempted."""
        bm = self.block_manager
        while True:
            if bm.grow(seq.block_table, seq.num_tokens):
                index = seq.num_computed_tokens // bm.block_size
                if not bm.is_shared(seq.block_table[index]):
                    return True
                if bm.num_free_blocks:
                    copies.append(bm.copy_on_write(seq.block_table, index))
                    return True
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back at the head of the queue, to be recomputed
        or (``should_swap``) with its computed blocks swapped out to the host tier."""
        self.running.remove(seq)
        bm = self.block_manager
        if self.should_swap(seq):
            seq.swapped_slots = bm.swap_out(
                seq.block_table[: bm.blocks_needed(seq.num_computed_tokens)]
            )
            self.num_swaps_out += 1
        else:
            seq.num_computed_tokens = 0
            self.num_recomputes += 1
        bm.free(seq.block_table)
        # Recompute or swap-in, its blocks are fresh ones: named (hashed) again as computed.
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Behind a prompt that is part-way through its chunks: that one holds its blocks and
        # must finish first, or neither could proceed.
        position = 1 if self.waiting and self.waiting[0].block_table else 0
        self.waiting.insert(position, seq)

    def should_swap(self, seq: Sequence) -> bool:
        """Whether preempting ``seq`` swaps it out rather than recomputing it."""
        bm = self.block_manager
        blocks = bm.blocks_needed(seq.num_computed_tokens)
        if self.preemption_mode == "recompute" or not blocks or not bm.can_swap_out(blocks):
            return False
        # A fork sharing blocks (ref_count > 1) is recomputed: freeing its table releases
        # none of the shared blocks (the sibling keeps them), so a swap would copy them out
        # for no room gained, and load them back as private copies, the sharing lost.
        if any(bm.is_shared(block_id) for block_id in seq.block_table):
            return False
        if self.preemption_mode == "swap":
            return True
        swap_s = bm.host_tier.copy_cost_s(blocks)
        per_token_s = self.prefill_token_s()
        if swap_s is None or per_token_s is None:
            return False  # unmeasured: today's behaviour
        return swap_s < seq.num_computed_tokens * per_token_s

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq.block_table)
        if seq.swapped_slots:  # aborted while swapped out
            self.block_manager.release_swapped(seq.swapped_slots)
            seq.swapped_slots = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
