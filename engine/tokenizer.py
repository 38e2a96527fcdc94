"""Tokenizers: a Hugging Face tokenizer.json (through `tokenizers`) with its chat template,
and the byte-level tokenizer of the built-in `tiny` model.

Both expose the same interface: ``encode``, ``decode``, ``eos_token_ids``, ``vocab_size``
and ``apply_chat_template``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import CheckpointError, InvalidRequestError


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


def render_chat_template(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """Render a Hugging Face chat template (Jinja2, sandboxed), validating the messages."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(message.get("content", ""), str | list | None):
            raise InvalidRequestError(f"messages[{i}].content must be a string")

    def raise_exception(message: str) -> None:
        raise InvalidRequestError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, **variables)
    except jinja2.TemplateError as err:
        raise InvalidRequestError(f"chat template failed: {err}") from None


class HFTokenizer:
    """tokenizer.json + tokenizer_config.json of a Hugging Face checkpoint."""

    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint needs a tokenizer.json")
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises plain Exception
            raise CheckpointError(f"{path} is not a valid tokenizer: {err}") from None
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as err:
                raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = set(eos_token_ids)
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = tuple(sorted(eos))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template (tokenizer_config.json)")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return token.get("content")
    return token


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0–255) plus <bos> 256 and <eos> 257: the `tiny` model's."""

    BOS = 256
    EOS = 257
    CHAT_TEMPLATE = (
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )

    def __init__(self, vocab_size: int = 320) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens:
            specials = {self.BOS: "<bos>", self.EOS: "<eos>"}
            text = "".join(chr(t) if t < 256 else specials.get(t, f"<{t}>") for t in token_ids)
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return render_chat_template(
            self.CHAT_TEMPLATE, messages, add_generation_prompt=add_generation_prompt
        )
