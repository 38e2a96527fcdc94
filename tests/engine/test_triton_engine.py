"""The whole engine with every Triton kernel forced on (run in Triton's CPU interpreter):
the same greedy tokens as the torch path, for fp32 and fp8 KV caches, through prefill,
prefix hits, chunked prefill and split-K decode."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.checkpoints import make_checkpoint

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [
    [1] + [(i * 13) % 250 + 3 for i in range(36)],
    [1, 7, 8, 9],
    [1] + [(i * 13) % 250 + 3 for i in range(20)],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp(
        "qwen2"
    )  # QKV bias and tied embeddings exercise the epilogues
    make_checkpoint(directory, "qwen2", head_dim=16)
    return directory


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_path_matches_torch_path(checkpoint, monkeypatch, kv_cache_dtype):
    options = dict(
        num_kv_blocks=32, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32, progress=False
    )
    expected = [o.token_ids for o in LLM(checkpoint, **options).generate(PROMPTS, PARAMS)]
    monkeypatch.setenv("PDCLUSTER_FORCE_TRITON", "1")
    llm = LLM(checkpoint, **options)
    got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == expected
    # the third prompt shares its first block with the first: a prefix hit under Triton too
    assert llm.engine.block_manager.prefix_hit_tokens >= 16
