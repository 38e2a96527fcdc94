"""Structured output (xgrammar masks in the sampler): on tiny (regex, choice, bad grammars)
and on the real default model (a JSON schema, 10 seeded samples)."""

from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured_output import GrammarSpec

pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", progress=False, num_kv_blocks=64, cpu_gemm="torch")


def test_a_regex_holds_for_every_seeded_sample(tiny):
    grammar = GrammarSpec("regex", "[a-c]{3}-[0-9]{2}")
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=s, grammar=grammar) for s in range(4)
    ]
    outputs = tiny.generate([[1, 2, 3]] * 4, params)
    for out in outputs:
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", out.text), out.text
        assert out.finish_reason == "stop"  # the grammar's end allows only EOS


def test_a_choice_is_one_of_its_options(tiny):
    params = SamplingParams(max_tokens=8, temperature=0, grammar=GrammarSpec.choice(["yes", "no"]))
    assert tiny.generate([[5, 6]], params)[0].text in ("yes", "no")


def test_grammar_and_plain_requests_share_a_batch(tiny):
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    bound = SamplingParams(max_tokens=6, temperature=0, grammar=GrammarSpec("regex", "x+y"))
    alone = tiny.generate([[7, 8]], plain)[0].token_ids
    mixed = tiny.generate([[7, 8], [7, 8]], [plain, bound])
    assert mixed[0].token_ids == alone
    assert re.fullmatch("x+y", mixed[1].text)


@pytest.mark.parametrize(
    "spec,words",
    [
        (GrammarSpec("json_schema", '{"type": "nonsense"}'), "nonsense"),
        (GrammarSpec("regex", "(unclosed"), "regex cannot be compiled"),
        (GrammarSpec("grammar", "root ::= missing_rule"), "grammar cannot be compiled"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_with_its_message(tiny, spec, words):
    with pytest.raises(InvalidRequestError, match=re.escape(words)):
        tiny.generate([[1]], SamplingParams(max_tokens=4, grammar=spec))
    assert not tiny.engine.has_unfinished()


def test_bad_specs_are_refused():
    with pytest.raises(InvalidRequestError, match="kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(InvalidRequestError, match="needs a source"):
        GrammarSpec("regex", "")


def test_the_default_model_follows_a_json_schema_in_10_of_10_samples(default_model_file):
    jsonschema = pytest.importorskip("jsonschema")
    llm = LLM("smollm2-135m", progress=False, dtype="float32", num_kv_blocks=256)
    grammar = GrammarSpec("json_schema", json.dumps(PERSON))
    messages = [{"role": "user", "content": "Describe a person as JSON: name, age and city."}]
    prompt = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    params = [
        SamplingParams(max_tokens=64, temperature=0.8, seed=s, grammar=grammar) for s in range(10)
    ]
    outputs = llm.generate([prompt] * 10, params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
