"""When a sequence is done: after each appended token, whether it ended the sequence and why
("stop": EOS, a stop token, a stop string; "length": max_tokens or the model's limit).

Stop strings are watched incrementally (constant work per token); with min_tokens, stops
count only once that many tokens are out, so the whole text is searched then. Called by
the engine on its thread; ``forget`` a sequence when it ends.
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._watches: dict[int, IncrementalDetokenizer] = {}  # seq_id → its stop watch

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` ends with ``token`` (just appended), or None while it goes on. A stop
        string found sets ``seq.stop_text_len``, where its text is cut."""
        params = seq.params
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                return "stop"
            if params.stop and self._stop_text_len(seq) is not None:
                return "stop"
        if num_output >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def forget(self, seq_id: int) -> None:
        self._watches.pop(seq_id, None)

    def _stop_text_len(self, seq: Sequence) -> int | None:
        if seq.params.min_tokens:
            text = self.tokenizer.decode(seq.output_token_ids)
            hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
            seq.stop_text_len = min(hits) if hits else None
            return seq.stop_text_len
        watch = self._watches.get(seq.seq_id)
        if watch is None:
            watch = self._watches[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.params.stop
            )
            watch.add(seq.output_token_ids[:-1])
        watch.add(seq.output_token_ids[-1:])
        if watch.stopped:
            seq.stop_text_len = len(watch.output_text())
        return seq.stop_text_len
