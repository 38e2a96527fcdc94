"""Incremental detokenization for streaming: text that is safe to show as tokens arrive.

Two things are held back until they are settled:

- an incomplete character at the end (a multi-byte UTF-8 character split across tokens
  decodes to U+FFFD until its last byte arrives), and
- any tail of the text that could be the start of a stop string, because the text is cut
  *before* a stop string once it completes.

On finish everything left is flushed (an incomplete character then stays U+FFFD, as a full
decode would show it) and the text is cut at the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Decoding restarts from a few tokens back so that tokenizers whose decode depends on the
# previous token (SentencePiece's leading spaces, byte fallback) render the boundary right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed output token ids with :meth:`add`, then call :meth:`finish` once.

    ``add`` and ``finish`` return only the text not returned before. Concatenated, their
    results equal ``tokenizer.decode(all_output_ids)`` cut at the first stop string.
    ``stopped`` turns true as soon as a stop string is complete in the text; later tokens are
    then ignored.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # decode window start (context for the boundary)
        self._read_offset = len(context)  # tokens before this are already in self.text
        self.text = ""  # settled text (complete characters), before stop truncation
        self._emitted = 0  # characters of the presented text already returned
        self._scan_from = 0  # stop strings cannot start before this offset of self.text
        # Complete characters decoded in front of a still-incomplete one: not settled yet, but
        # a stop string in them ends the stream now, as it ends generation in the engine.
        self._pending = ""
        self.stopped = False
        self.finished = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Add new output tokens; return the newly presentable text (may be "")."""
        if self.finished:
            raise RuntimeError("add() after finish()")
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(token_ids)
        self._settle(final=False)
        return self._take(final=False)

    def finish(self) -> str:
        """Flush everything held back; return the last text."""
        if self.finished:
            return ""
        self.finished = True
        if not self.stopped:
            self._settle(final=True)
        return self._take(final=True)

    def output_text(self) -> str:
        """All text presented so far plus what is held back, cut at a complete stop string."""
        cut = self._stop_cut()
        return self.text if cut is None else (self.text + self._pending)[:cut]

    # ---- internals --------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _settle(self, final: bool) -> None:
        """Move newly complete text from the token window into ``self.text``."""
        self._pending = ""
        if self._read_offset >= len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) and not final:
            return  # nothing new yet (e.g. first byte of a multi-byte character)
        if full.endswith(_REPLACEMENT) and not final:
            # Possibly an incomplete character: wait for its remaining bytes.
            self._pending = full[len(prefix) :].rstrip(_REPLACEMENT)
            return
        self.text += full[len(prefix) :]
        # The next window starts at this one's end: a character boundary, and the tokens
        # decoded with the new ones give the boundary its context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _stop_cut(self) -> int | None:
        if not self.stop:
            return None
        # Text before _scan_from was searched already: only a stop ending in the new text
        # can be new, so long outputs cost O(new text) per call, not O(all text).
        visible = self.text + self._pending
        hits = [i for i in (visible.find(s, self._scan_from) for s in self.stop) if i >= 0]
        if hits:
            self._scan_from = min(hits)
            return min(hits)
        # Only settled text is final: the pending tail is searched again next time.
        self._scan_from = max(0, len(self.text) - max(map(len, self.stop)) + 1)
        return None

    def _held_back(self) -> int:
        """Length of the longest tail of ``self.text`` that is a proper prefix of a stop."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _take(self, final: bool) -> str:
        cut = self._stop_cut()
        source = self.text
        if cut is not None:
            self.stopped = True
            source = self.text + self._pending
            end = cut
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        if end <= self._emitted:
            return ""
        out = source[self._emitted : end]
        self._emitted = end
        return out
