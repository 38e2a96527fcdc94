"""The tokenizer a GGUF file describes in its metadata, rebuilt with `tokenizers`.

A GGUF has no tokenizer.json: it stores the vocabulary, merges (or scores), token types and
special token ids under llama.cpp's keys. Two tokenizer models cover the Llama family:
``gpt2`` (byte-level BPE, split by the pre-tokenizer ``tokenizer.ggml.pre`` names) and
``llama`` (SentencePiece BPE with byte fallback). An unknown model or pre-tokenizer is an
error: a tokenizer that splits text differently from the one the model was trained with would
serve quietly wrong answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.errors import CheckpointError, UnsupportedModelError

# llama.cpp's token types
_CONTROL = 3
_USER_DEFINED = 4

# The splits llama.cpp applies for each `tokenizer.ggml.pre` (its llama-vocab.cpp), written
# as the tokenizer.json of the original model has them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre_tokenizer():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# pre-tokenizer name → (pre-tokenizer factory, ignore_merges as the original tokenizer sets it)
_BYTE_LEVEL_PRE = {
    "default": (_gpt2_pre_tokenizer, False),
    "gpt2": (_gpt2_pre_tokenizer, False),
    "smollm": (
        lambda: pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()]
        ),
        False,
    ),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": (lambda: _split_then_bytes(_QWEN2_SPLIT), False),
}


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What engine.tokenizer.HFTokenizer needs from a GGUF's metadata."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    chat_templates: dict[str, str]  # name → Jinja template; "default" is the plain one


def tokenizer_from_gguf(metadata: dict[str, Any], source: str) -> GGUFTokenizerParts:
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{source} has no tokenizer (tokenizer.ggml.tokens is missing)")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, metadata, source)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(tokens, metadata, source)
    else:
        raise UnsupportedModelError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
        )
    _add_special_tokens(tokenizer, tokens, types)

    def token_at(key: str) -> tuple[int, str] | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return None if index is None or not 0 <= index < len(tokens) else (index, tokens[index])

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    _set_post_processor(tokenizer, bos if add_bos else None, eos if add_eos else None)
    stops = [token_at(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    templates = {}
    if metadata.get("tokenizer.chat_template"):
        templates["default"] = metadata["tokenizer.chat_template"]
    for name in metadata.get("tokenizer.chat_templates") or ():
        template = metadata.get(f"tokenizer.chat_template.{name}")
        if template:
            templates[name] = template
    return GGUFTokenizerParts(
        tokenizer=tokenizer,
        bos_token=bos[1] if bos else None,
        eos_token=eos[1] if eos else None,
        eos_token_ids=tuple(sorted({stop[0] for stop in stops if stop is not None})),
        chat_templates=templates,
    )


def _byte_level_bpe(tokens: list[str], metadata: dict[str, Any], source: str) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_PRE:
        raise UnsupportedModelError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_BYTE_LEVEL_PRE))})"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise CheckpointError(f"{source}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    alphabet = byte_level_alphabet()
    spelled = set(alphabet.values())
    # llama.cpp writes byte-level tokens in GPT-2's byte alphabet; respell any that are not.
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    make_pre, ignore_merges = _BYTE_LEVEL_PRE[pre]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ", 1)) for merge in merges],
            ignore_merges=ignore_merges,
        )
    )
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(tokens: list[str], metadata: dict[str, Any], source: str) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = metadata.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise CheckpointError(f"{source}: a llama tokenizer needs scores or merges")
        pairs = merges_from_scores(tokens, scores)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens of the vocabulary, the best-scored merged tokens first (how SentencePiece's BPE
    picks the next merge)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((score, left, right) for left, right in pairs)
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(left, right) for _, left, right in candidates]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_start|>, </s>) match whole and are special; user-defined ones
    match whole but are ordinary text."""
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _set_post_processor(
    tokenizer: Tokenizer, bos: tuple[int, str] | None, eos: tuple[int, str] | None
) -> None:
    if bos is None and eos is None:
        return
    present = [token for token in (bos, eos) if token is not None]
    single = " ".join(
        [*([f"{bos[1]}:0"] if bos else []), "$A:0", *([f"{eos[1]}:0"] if eos else [])]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(text, index) for index, text in present]
    )


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table (bytes that print as themselves keep their
    character; the rest are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table
