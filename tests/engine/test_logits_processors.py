"""Sampling options that change the logits: against transformers' logits processors on the
same logits (one step), and through the engine."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.logits_processors import process_logits
from engine.sequence import Sequence

V = 64
EOS = (2,)


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence(prompt_token_ids=prompt, params=SamplingParams(max_tokens=32, **params))
    s.token_ids.extend(output)
    return s


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 4


def test_nothing_asked_returns_the_logits_untouched(logits):
    seqs = [seq([1, 2], [3]), seq([4], []), seq([5], [6, 6], temperature=0.5, top_k=3)]
    assert process_logits(logits, seqs, EOS) is logits


def test_repetition_penalty_equals_transformers(logits):
    from transformers import RepetitionPenaltyLogitsProcessor

    histories = [([5, 6, 7], [8, 5]), ([1, 9, 9], [10, 11]), ([3, 3, 3], [3, 4])]
    seqs = [seq(p, o, repetition_penalty=1.4) for p, o in histories]
    ids = torch.tensor([p + o for p, o in histories])
    expected = RepetitionPenaltyLogitsProcessor(1.4)(ids, logits.clone())
    torch.testing.assert_close(process_logits(logits, seqs, EOS), expected, rtol=0, atol=0)


def test_min_tokens_equals_transformers(logits):
    from transformers import MinNewTokensLengthLogitsProcessor

    prompt = [5, 6, 7]
    seqs = [seq(prompt, [8] * n, min_tokens=3) for n in (0, 2, 3)]
    ids = torch.tensor([prompt + [8] * 3] * 3)
    got = process_logits(logits, seqs, EOS)
    for row, n in enumerate((0, 2, 3)):
        processor = MinNewTokensLengthLogitsProcessor(len(prompt), 3, list(EOS))
        expected = processor(ids[row : row + 1, : len(prompt) + n], logits[row : row + 1].clone())
        torch.testing.assert_close(got[row : row + 1], expected, rtol=0, atol=0)


def test_min_tokens_also_holds_back_stop_token_ids_but_not_an_ignored_eos(logits):
    got = process_logits(
        logits[:1], [seq([1], [], min_tokens=2, ignore_eos=True, stop_token_ids=(9,))], EOS
    )
    assert got[0, 9] == float("-inf") and got[0, EOS[0]] == logits[0, EOS[0]]


def test_logit_bias_equals_transformers_sequence_bias(logits):
    from transformers import SequenceBiasLogitsProcessor

    bias = {5: 2.5, 17: -100.0, 63: 7.0}
    seqs = [seq([1, 2], [3], logit_bias=tuple(bias.items())) for _ in range(3)]
    processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    expected = processor(torch.tensor([[1, 2, 3]] * 3), logits.clone())
    torch.testing.assert_close(process_logits(logits, seqs, EOS), expected)


def test_presence_and_frequency_penalties_follow_openais_formula(logits):
    output = [4, 4, 4, 9]
    s = seq([4, 20], output, presence_penalty=0.5, frequency_penalty=0.25)
    got = process_logits(logits[:1], [s], EOS)[0]
    expected = logits[0].clone()
    expected[4] -= 3 * 0.25 + 0.5
    expected[9] -= 1 * 0.25 + 0.5
    # The prompt does not count (OpenAI's and vLLM's semantics): token 20 is untouched.
    torch.testing.assert_close(got, expected)


def test_only_the_rows_that_ask_are_processed(logits):
    seqs = [seq([1], [5, 5]), seq([1], [5, 5], frequency_penalty=1.0), seq([1], [5, 5])]
    got = process_logits(logits, seqs, EOS)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 5] == logits[1, 5] - 2.0


@pytest.mark.parametrize(
    "options,words",
    [
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": ((1, 101.0),)}, "[-100, 100]"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token id"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "twice"),
        ({"logit_bias": (5,)}, "map token ids"),
    ],
)
def test_bad_options_are_refused(options, words):
    with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**options)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", progress=False, num_kv_blocks=64, cpu_gemm="torch")


def test_a_bias_of_100_makes_every_sampled_token_that_token(llm):
    params = SamplingParams(
        max_tokens=12, temperature=1.0, seed=1, ignore_eos=True, logit_bias={42: 100.0}
    )
    assert llm.generate([[1, 5, 6]], params)[0].token_ids == [42] * 12


def test_min_tokens_holds_back_a_forced_eos(llm):
    eos = llm.engine.tokenizer.eos_token_ids[0]
    forced = {eos: 100.0}
    out = llm.generate(
        [[1, 5, 6]], SamplingParams(max_tokens=12, temperature=0, min_tokens=5, logit_bias=forced)
    )[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.token_ids[:5]


def test_repetition_penalty_changes_a_repetitive_greedy_output(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate([[1, 5, 6]], greedy)[0].token_ids
    penalised = llm.generate(
        [[1, 5, 6]],
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=2.0),
    )[0].token_ids
    assert len(set(plain)) < len(plain)  # tiny's greedy output repeats itself
    assert len(set(penalised)) > len(set(plain))
