"""Forks (OpenAI's n): one prefill, shared prompt blocks with copy-on-write, each fork a
sequence of its own; and prompt logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Fork, Sequence

PROMPT = list(range(3, 24))  # 21 tokens: one full block of 16 and a partial one
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)


def engine(**options) -> LLMEngine:
    return LLMEngine("tiny", EngineConfig(num_kv_blocks=64, **options), progress=False)


def run(eng: LLMEngine) -> dict[str, list[int]]:
    outputs = {}
    while eng.has_unfinished():
        for output in eng.step().finished:
            outputs[output.request_id] = output.token_ids
    return outputs


def seeded(i: int) -> SamplingParams:
    return dataclasses.replace(SAMPLED, seed=SAMPLED.seed + i)


def test_forks_equal_their_requests_run_alone_after_one_prefill():
    eng = engine()
    forks = [Fork(f"r-{i}", seeded(i)) for i in (1, 2, 3)]
    eng.add_request(PROMPT, seeded(0), "r-0", forks)
    together = run(eng)
    assert eng.num_prompt_tokens_computed == len(PROMPT)  # one prefill for four sequences
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks

    alone = engine(enable_prefix_caching=False)
    for i in range(4):
        alone.add_request(PROMPT, seeded(i), f"r-{i}")
        assert run(alone) == {f"r-{i}": together[f"r-{i}"]}
    assert len({tuple(t) for t in together.values()}) == 4  # different seeds, different samples


def test_forks_share_the_prompt_blocks_and_copy_the_partial_one_on_write():
    eng = engine()
    eng.add_request(PROMPT, seeded(0), "a", [Fork("b", seeded(1))])
    eng.step()  # the prefill: both sampled their first token
    a, b = eng._requests["a"], eng._requests["b"]
    assert a.block_table == b.block_table
    used_after_prefill = eng.block_manager.num_used_blocks
    eng.step()  # the first decode writes position 21, in the shared partial block
    assert a.block_table[0] == b.block_table[0]  # the full block stays shared
    assert a.block_table[1] != b.block_table[1]  # the partial one was copied for one of them
    assert eng.block_manager.num_used_blocks == used_after_prefill + 1
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    twins = engine()
    twins.add_request(PROMPT, greedy, "x", [Fork("y", greedy)])
    out = run(twins)
    assert out["x"] == out["y"]


def test_a_prompt_of_whole_blocks_needs_no_copy():
    eng = engine()
    eng.add_request(list(range(3, 35)), seeded(0), "a", [Fork("b", seeded(1))])
    eng.step()
    batch = eng.scheduler.schedule()
    assert batch is not None and batch.copies == []


def test_aborting_before_the_first_token_hands_the_prompt_to_a_fork():
    eng = engine(max_num_batched_tokens=8, block_size=8)  # three chunks: abort between them
    eng.add_request(PROMPT, seeded(0), "p", [Fork("f1", seeded(1)), Fork("f2", seeded(2))])
    eng.step()
    assert eng.abort("f2").finish_reason == "abort"  # a fork not spawned yet
    assert eng.abort("p").finish_reason == "abort"  # the prompt goes on as f1
    assert eng.request_ids() == ["f1"]
    out = run(eng)
    assert list(out) == ["f1"] and len(out["f1"]) == SAMPLED.max_tokens
    alone = engine(enable_prefix_caching=False)
    alone.add_request(PROMPT, seeded(1), "f1")
    assert run(alone) == out
    assert eng.num_prompt_tokens_computed == len(PROMPT)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_fork_ids_and_width_are_checked():
    eng = engine(max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="repeat"):
        eng.add_request(PROMPT, SAMPLED, "a", [Fork("a", SAMPLED)])
    with pytest.raises(InvalidRequestError, match="limit of 4"):
        eng.add_request(PROMPT, SAMPLED, "a", [Fork(f"f{i}", SAMPLED) for i in range(4)])
    eng.add_request(PROMPT, SAMPLED, "a", [Fork("b", SAMPLED)])
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request(PROMPT, SAMPLED, "b")
    assert eng.abort("nope") is None


def test_forks_under_memory_pressure_stay_exact():
    """Preemption of forks (freeing shared blocks) and their recompute change nothing."""
    params = [dataclasses.replace(seeded(i), max_tokens=40) for i in range(4)]
    roomy = engine()
    roomy.add_request(PROMPT, params[0], "r-0", [Fork(f"r-{i}", params[i]) for i in (1, 2, 3)])
    expected = run(roomy)
    tight = LLMEngine("tiny", EngineConfig(num_kv_blocks=9), progress=False)
    tight.add_request(PROMPT, params[0], "r-0", [Fork(f"r-{i}", params[i]) for i in (1, 2, 3)])
    assert run(tight) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def reference_prompt_logprobs(eng: LLMEngine, prompt: list[int]) -> torch.Tensor:
    seq = Sequence(prompt_token_ids=prompt, params=SAMPLED)
    seq.block_table, _ = eng.block_manager.allocate(prompt, use_cache=False)
    ids, pos, meta, _, _ = eng.runner.prepare(ScheduledBatch([seq], [len(prompt)]))
    logits = eng.model.compute_logits(eng.model(ids, pos, meta, eng.cache)).float()
    eng.block_manager.free(seq.block_table)
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("chunk", [8, 512])
def test_prompt_logprobs_match_the_full_forward(chunk):
    eng = engine(max_num_batched_tokens=chunk, block_size=8)
    expected = reference_prompt_logprobs(eng, PROMPT)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    outputs = []
    for request_id in ("first", "again"):  # the second would hit the prefix cache
        eng.add_request(PROMPT, params, request_id)
        while eng.has_unfinished():
            outputs += eng.step().finished
    for output in outputs:
        entries = output.prompt_logprobs
        assert len(entries) == len(PROMPT) and entries[0] is None
        for position, entry in enumerate(entries[1:]):
            assert entry.token_id == PROMPT[position + 1]
            assert entry.logprob == pytest.approx(
                float(expected[position, entry.token_id]), abs=1e-4
            )
            top = expected[position].topk(2)
            assert list(entry.top) == top.indices.tolist()


def test_prompt_logprobs_come_with_the_first_token():
    eng = engine()
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    eng.add_request(PROMPT, params, "a", [Fork("b", params)])
    result = eng.step()
    assert set(result.prompt_logprobs) == {"a", "b"}
    assert len(result.prompt_logprobs["a"]) == len(PROMPT)
    assert eng.step().prompt_logprobs == {}
