"""One tokenizer interface for HF checkpoints (`tokenizer.json` via the `tokenizers` library, plus
`tokenizer_config.json` for special tokens and the chat template) and for the built-in tokenizer.

Prompt encoding follows transformers: a chat-rendered prompt is encoded without adding special tokens
(the template writes them), a plain-text prompt with them (e.g. a BOS from the post-processor).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from jaxrl_fp8.data.chat_template import ChatTemplateError, render_chat_template, select_chat_template
from jaxrl_fp8.data.records import Message

__all__ = ["TextTokenizer", "load_tokenizer"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry {value!r} is neither a string nor an object with 'content'")


class TextTokenizer:
    """A `tokenizers.Tokenizer` with special-token ids, stop ids and chat-template rendering."""

    def __init__(
        self,
        tokenizer,
        *,
        special_tokens: dict[str, str | None] | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Sequence[int] = (),
        name: str = "tokenizer",
    ):
        self.tokenizer = tokenizer
        self.name = name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        for key, token in self.special_tokens.items():
            if tokenizer.token_to_id(token) is None:
                raise ValueError(f"{name}: {key}={token!r} is not in the vocabulary")
        self._extra_stop_ids = tuple(int(i) for i in extra_stop_ids)

    # construction ------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "TextTokenizer":
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`)."""
        from tokenizers import Tokenizer

        directory = os.fspath(directory)
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing (only fast tokenizers with tokenizer.json are supported)")
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from e
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{config_path}:{e.lineno}: invalid JSON: {e.msg}") from e
        try:
            special = {k: _token_content(config.get(k)) for k in _SPECIAL_KEYS}
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from e
        template = None
        jinja_path = os.path.join(directory, "chat_template.jinja")
        json_template_path = os.path.join(directory, "chat_template.json")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        elif os.path.isfile(json_template_path):
            with open(json_template_path, encoding="utf-8") as f:
                template = select_chat_template(json.load(f).get("chat_template"))
        else:
            template = select_chat_template(config.get("chat_template"))
        stop_ids: list[int] = []
        gen_path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(tokenizer, special_tokens=special, chat_template=template, extra_stop_ids=stop_ids,
                   name=directory)

    @classmethod
    def from_json_str(cls, tokenizer_json: str, **kwargs) -> "TextTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(tokenizer_json), **kwargs)

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json` and a minimal `tokenizer_config.json` (each via a temp file + rename)."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        config: dict[str, Any] = dict(self.special_tokens)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        for name, text in (("tokenizer.json", self.tokenizer.to_str()),
                           ("tokenizer_config.json", json.dumps(config, indent=2))):
            tmp = os.path.join(directory, f".{name}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, os.path.join(directory, name))

    # ids ---------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_id(self) -> int:
        """The pad token, else EOS (common for decoder-only checkpoints), else 0."""
        for key in ("pad_token", "eos_token"):
            if (i := self._id(key)) is not None:
                return i
        return 0

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a response: EOS plus `generation_config.json`'s `eos_token_id`s."""
        ids = list(self._extra_stop_ids)
        if self.eos_id is not None and self.eos_id not in ids:
            ids.insert(0, self.eos_id)
        return tuple(ids)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    # text <-> ids ------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # prompts -----------------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.name}: has no chat_template (tokenizer_config.json)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **kwargs)

    def render_prompt(self, prompt: str | Sequence[Message], use_chat_template: bool | None = None,
                      **template_kwargs: Any) -> tuple[str, bool]:
        """Prompt text and whether the chat template produced it.

        `use_chat_template=None` (auto): chat messages always go through the template; a plain string goes
        through it as one user message when the tokenizer has a template.
        """
        if isinstance(prompt, str):
            if use_chat_template is None:
                use_chat_template = self.chat_template is not None
            if not use_chat_template:
                return prompt, False
            prompt = ({"role": "user", "content": prompt},)
        elif use_chat_template is False:
            raise ChatTemplateError(f"{self.name}: a chat-format prompt needs the chat template "
                                    "(use_chat_template=False was requested)")
        return self.apply_chat_template(prompt, add_generation_prompt=True, **template_kwargs), True

    def encode_prompt(self, prompt: str | Sequence[Message], use_chat_template: bool | None = None,
                      **template_kwargs: Any) -> tuple[str, list[int]]:
        """Rendered prompt text and its token ids, ready for generation."""
        text, templated = self.render_prompt(prompt, use_chat_template, **template_kwargs)
        return text, self.encode(text, add_special_tokens=not templated)


def load_tokenizer(directory: str | os.PathLike) -> TextTokenizer:
    """The tokenizer of an HF checkpoint directory."""
    return TextTokenizer.from_pretrained(directory)
