"""Structured output: a request's grammar (a JSON schema, any JSON, a regex, a choice of
strings, EBNF) as a token mask applied before sampling, with xgrammar (what vLLM and SGLang
use).

Who calls: the engine's loop thread only — ``mask`` before each sample, ``accept`` for each
token a sequence takes (sampled here, or its first token sampled on a prefill worker, which
masked it the same way), ``forget`` when it finishes. Grammars compile once per spec and are
cached (``compile``: also how the router checks one before admitting the request). xgrammar
is imported on first use: a server that never sees a grammar never loads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from engine.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. ``source``: the schema as JSON text (json_schema), the
    regex, the choices as a JSON list of strings (choice), the EBNF (grammar); "" for
    json_object (any JSON object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"grammar kind must be one of {list(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.source, str):
            raise InvalidRequestError("a grammar's source must be a string")
        if self.kind != "json_object" and not self.source:
            raise InvalidRequestError(f"a {self.kind} grammar needs a source")

    @classmethod
    def choice(cls, options: Seq[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options)))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(
            "structured output needs xgrammar, which is not installed on this server "
            "(pip install 'pdcluster[structured]')"
        ) from None
    return xgrammar


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; the results are cached."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        xgr = _xgrammar()
        self._compiler = xgr.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size), max_threads=1)
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; InvalidRequestError with the library's message if it cannot
        be compiled."""
        return self._compile(spec)

    def _compile_uncached(self, spec: GrammarSpec):
        compiler = self._compiler
        try:
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.source)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                options = json.loads(spec.source)
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(o) for o in options)
                )
            return compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as err:
            lines = str(err).strip().splitlines() or [repr(err)]
            # xgrammar prefixes its C++ messages with "[hh:mm:ss] file.cc:line: ".
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[-1])
            raise InvalidRequestError(f"the {spec.kind} cannot be compiled: {message}") from None


class GrammarMasks:
    """Each grammar-bound sequence's matcher, and the masks they put on a batch's logits."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self._matchers: dict[int, Any] = {}  # seq_id → its xgrammar GrammarMatcher

    def mask(self, logits: torch.Tensor, seq_ids: Seq[int], specs: Seq[GrammarSpec | None]) -> None:
        """Set to -inf, in place, every logit [n, V] its row's grammar does not allow next."""
        rows = [i for i, spec in enumerate(specs) if spec is not None]
        if not rows:
            return
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(specs), self.compiler.vocab_size)
        for i in list(rows):
            matcher = self._matcher(seq_ids[i], specs[i])
            if matcher.is_terminated():  # the grammar is complete: nothing left to constrain
                rows.remove(i)
                continue
            matcher.fill_next_token_bitmask(bitmask, i)
        if not rows:
            return
        if logits.shape[-1] != self.compiler.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[-1]} columns, the grammar's vocabulary "
                f"{self.compiler.vocab_size}"
            )
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def accept(self, seq_id: int, spec: GrammarSpec, token: int) -> None:
        """Advance the sequence's grammar by the token it took. A token the grammar refuses
        (one sampled without the mask cannot happen; a stop token past the end can) leaves
        the matcher where it was."""
        self._matcher(seq_id, spec).accept_token(token)

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def _matcher(self, seq_id: int, spec: GrammarSpec):
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            xgr = _xgrammar()
            matcher = xgr.GrammarMatcher(self.compiler.compile(spec))
            self._matchers[seq_id] = matcher
        return matcher


def _tokenizer_info(tokenizer: Any, vocab_size: int):
    """xgrammar's view of the vocabulary: the tokenizers' Tokenizer inside HFTokenizer, or
    the byte tokenizer (tiny: ids 0-255 are the bytes)."""
    xgr = _xgrammar()
    stop = list(tokenizer.eos_token_ids)
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None:
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=inner)
        return xgr.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=vocab_size, stop_token_ids=stop
        )
    # Empty entries are special tokens to xgrammar: never allowed inside a grammar.
    vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
    return xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop
    )
