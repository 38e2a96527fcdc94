"""Tokenizer files as transformers writes them: the chat template in chat_template.jinja
(transformers 5), chat_template.json, or named templates in tokenizer_config.json; stop
tokens from generation_config.json."""

from __future__ import annotations

import json

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.tokenizer import HFTokenizer
from tests.engine.checkpoints import (
    CHAT_TEMPLATE,
    make_checkpoint,
    save_tokenizer_with_transformers,
    write_tokenizer,
)

CHAT = [{"role": "user", "content": "w5 w6"}]


def test_transformers_5_layout_chat_template_jinja(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer_with_transformers(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    ours = HFTokenizer.from_directory(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    expected = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(CHAT) == expected
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1


def test_chat_template_json_and_named_templates(tmp_path):
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    config["chat_template"] = [
        {"name": "default", "template": "named {{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = HFTokenizer.from_directory(tmp_path)
    assert ours.apply_chat_template(CHAT) == "named w5 w6"
    assert ours.chat_templates["tool_use"] == "tools"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    assert HFTokenizer.from_directory(tmp_path).apply_chat_template(CHAT).startswith("<|user|>")


def test_generation_config_eos_list_stops_generation(tmp_path):
    make_checkpoint(tmp_path, "llama")
    llm = LLM(tmp_path, num_kv_blocks=64, progress=False)
    free_run = llm.generate(
        [[1, 5, 9]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    tokens = free_run[0].token_ids
    stop_at = next(t for t in tokens if t != 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop_at]}))
    llm = LLM(tmp_path, num_kv_blocks=64, progress=False)
    assert stop_at in llm.tokenizer.eos_token_ids and 2 in llm.tokenizer.eos_token_ids
    out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=12, temperature=0))[0]
    first_stop = next(i for i, t in enumerate(tokens) if t in (2, stop_at))
    assert out.token_ids == tokens[: first_stop + 1] and out.finish_reason == "stop"


def test_no_chat_template_is_a_clear_error(tmp_path):
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        HFTokenizer.from_directory(tmp_path).apply_chat_template(CHAT)
