"""The engine against transformers on tiny random checkpoints (fp32, CPU): greedy tokens and
prefill logits, alone, batched, chunked and with prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from tests.engine.checkpoints import make_checkpoint

NUM_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [1, 5, 9, 33, 100, 7],
    [1] + [(i * 37) % 250 + 3 for i in range(22)],
    [1] + [(i * 11) % 250 + 3 for i in range(44)],
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "llama3", "llama_linear"])
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(directory, request.param)
    return directory, model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        max_new_tokens=NUM_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        min_new_tokens=NUM_TOKENS,
    )
    return out[0, len(prompt) :].tolist()


def assert_prefill_logits_match(engine: LLMEngine, hf_model, atol: float) -> None:
    """Every prompt's logits at every position, one prefill each, against transformers'."""
    for prompt in PROMPTS:
        seq = Sequence(prompt_token_ids=prompt, params=GREEDY)
        seq.block_table, _ = engine.block_manager.allocate(prompt)
        ids, pos, meta, _, _ = engine.runner.prepare(ScheduledBatch([seq], [len(prompt)]))
        logits = engine.model.compute_logits(engine.model(ids, pos, meta, engine.cache))
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits.cpu(), expected, atol=atol, rtol=0)
        engine.block_manager.free(seq.block_table)


def test_prefill_logits_match_transformers(checkpoint):
    directory, hf_model = checkpoint
    engine = LLMEngine(directory, EngineConfig(num_kv_blocks=64), progress=False)
    assert_prefill_logits_match(engine, hf_model, atol=1e-4)


def test_greedy_tokens_match_transformers_one_by_one_and_batched(checkpoint):
    directory, hf_model = checkpoint
    expected = [hf_greedy(hf_model, p) for p in PROMPTS]
    llm = LLM(directory, num_kv_blocks=64, progress=False)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert alone == expected
    batched = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert batched == expected


@pytest.mark.gpu
def test_greedy_tokens_and_logits_match_transformers_on_cuda(checkpoint):
    """The Triton path (fused GEMMs, flash prefill, paged decode, CUDA graphs) in fp32 against
    transformers on the CPU: the same greedy tokens, and the same prefill logits up to the
    order of fp32 sums (the kernels' fp32 dots are IEEE, not tf32)."""
    directory, hf_model = checkpoint
    expected = [hf_greedy(hf_model, p) for p in PROMPTS]
    options = dict(num_kv_blocks=64, device="cuda", dtype="float32", progress=False)
    with LLM(directory, **options) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert_prefill_logits_match(llm.engine, hf_model, atol=1e-3)


def chunked_llm(directory) -> LLM:
    """Prompts in chunks of at most 16 tokens, every token computed (no prefix cache)."""
    return LLM(
        directory,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        progress=False,
    )


def test_chunked_prefill_matches(checkpoint):
    directory, hf_model = checkpoint
    llm = chunked_llm(directory)
    prompt = PROMPTS[2]  # 45 tokens → chunks of 16, 16, 13
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf_model, prompt)


def test_prefix_cache_hit_is_not_recomputed(checkpoint):
    directory, hf_model = checkpoint
    llm = LLM(directory, num_kv_blocks=64, progress=False)
    shared = PROMPTS[2][:40]
    first, second = shared + [7, 8, 9], shared + [10, 11]
    engine = llm.engine
    out_first = llm.generate([first], GREEDY)[0]
    computed_before = engine.num_prompt_tokens_computed
    out_second = llm.generate([second], GREEDY)[0]
    assert out_second.num_cached_tokens == 32  # two full 16-token blocks of the shared prefix
    assert engine.num_prompt_tokens_computed - computed_before == len(second) - 32
    assert out_first.token_ids == hf_greedy(hf_model, first)
    assert out_second.token_ids == hf_greedy(hf_model, second)


def test_mixed_batches_match(checkpoint):
    """Decode rows and a prompt chunk in one step: each part through its own attention path,
    tokens as transformers'."""
    directory, hf_model = checkpoint
    llm = chunked_llm(directory)
    runner, kinds = llm.engine.runner, set()
    inputs = runner.inputs

    def spy(plan):
        out = inputs(plan)
        kinds.add((out[2].decode is not None, out[2].prefill is not None))
        return out

    runner.inputs = spy
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY)  # the short one decodes meanwhile
    assert (True, True) in kinds
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model, p) for p in (PROMPTS[0], PROMPTS[2])]
