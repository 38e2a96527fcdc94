"""The identity of a full KV block: a hash chain over the token ids of every block up to and
including it. One function for the engine's prefix cache and the router's index of what each
replica caches (router/kv_index.py), so both name a block the same way, in every process.

Python's ``hash()`` is not used: its value is the interpreter's business (a tuple's hash may
change between versions, ``str`` is salted per process), and the router and the replicas may
run different interpreters. blake2b over the parent's hash and the tokens' bytes is stable,
and a 64-bit digest is a few hundred nanoseconds a block.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

_LITTLE_ENDIAN = sys.byteorder == "little"


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """A full block's identity: its tokens and (through ``parent``, the previous block's
    hash, None for the first) every token before it. An unsigned 64-bit int."""
    tokens = array("q", token_ids)
    if not _LITTLE_ENDIAN:
        tokens.byteswap()
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"\xff" * 8 if parent is None else parent.to_bytes(8, "little"))
    digest.update(tokens.tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, max_tokens: int | None = None
) -> list[int]:
    """The chain hash of each full block among the first ``max_tokens`` (default all) tokens,
    in order: the names the prefix cache gives a prompt's blocks."""
    count = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
    hashes: list[int] = []
    parent = None
    for start in range(0, count - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
