"""Tokenizers: a `tokenizers` tokenizer with its chat templates (from a Hugging Face
checkpoint directory or a GGUF file), and the byte-level tokenizer of the built-in `tiny`
model.

Both expose the same interface: ``encode``, ``decode``, ``eos_token_ids``, ``vocab_size``
and ``apply_chat_template``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import CheckpointError, InvalidRequestError

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...

    @property
    def chat_template_takes_tools(self) -> bool: ...


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
    """A `tokenizers` tokenizer with its special tokens and chat templates: from a Hugging Face
    checkpoint directory (``from_directory``) or a GGUF file's metadata (``from_gguf``)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_templates: dict[str, str],
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_templates = chat_templates  # name → template; "default" is the plain one
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._tok.token_to_id(bos_token) if bos_token else None
        eos = set(eos_token_ids)
        if eos_token and self._tok.token_to_id(eos_token) is not None:
            eos.add(self._tok.token_to_id(eos_token))
        self.eos_token_ids = tuple(sorted(eos))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_directory(
        cls, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()
    ) -> HFTokenizer:
        """tokenizer.json, tokenizer_config.json, the chat template wherever transformers put
        it, and generation_config.json's stop tokens."""
        from tokenizers import Tokenizer as RustTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint needs a tokenizer.json")
        try:
            tokenizer = RustTokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises plain Exception
            raise CheckpointError(f"{path} is not a valid tokenizer: {err}") from None
        config = _read_json(model_dir / "tokenizer_config.json") or {}
        generation = _read_json(model_dir / "generation_config.json") or {}
        stops = generation.get("eos_token_id")
        stops = stops if isinstance(stops, list) else [] if stops is None else [stops]
        return cls(
            tokenizer,
            chat_templates=directory_chat_templates(model_dir, config),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            eos_token_ids=tuple(eos_token_ids) + tuple(int(t) for t in stops),
        )

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> HFTokenizer:
        from engine.gguf_tokenizer import tokenizer_from_gguf

        parts = tokenizer_from_gguf(gguf.metadata, gguf.path.name)
        return cls(
            parts.tokenizer,
            chat_templates=parts.chat_templates,
            bos_token=parts.bos_token,
            eos_token=parts.eos_token,
            eos_token_ids=parts.eos_token_ids,
        )

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.chat_template:
            raise InvalidRequestError(
                "this model has no chat template (none in the checkpoint's tokenizer files "
                "or GGUF metadata)"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
        )

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the template renders a ``tools`` list (else a server describes them)."""
        return bool(self.chat_template) and "tools" in self.chat_template


def directory_chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """A checkpoint's chat templates, by name. transformers 5 writes chat_template.jinja (and
    additional_chat_templates/NAME.jinja); earlier versions chat_template.json or a
    ``chat_template`` entry of tokenizer_config.json, a string or a list of {name, template}."""
    templates: dict[str, str] = {}
    legacy = _read_json(model_dir / "chat_template.json") or {}
    for source in (config.get("chat_template"), legacy.get("chat_template")):
        if isinstance(source, str):
            templates["default"] = source
        elif isinstance(source, list):
            for entry in source:
                if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                    templates[str(entry.get("name", "default"))] = entry["template"]
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        templates["default"] = jinja.read_text()
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = path.read_text()
    return templates


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


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
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return render_chat_template(
            self.CHAT_TEMPLATE, messages, add_generation_prompt=add_generation_prompt
        )

    chat_template_takes_tools = False
