"""Render a checkpoint's Jinja chat template (`tokenizer_config.json` → `chat_template`) without transformers.

The environment mirrors what Hugging Face templates expect: a sandboxed, immutable Jinja environment with
`trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` filter that keeps non-ASCII text, the
`raise_exception` and `strftime_now` globals, and a no-op `{% generation %}` block. The sandbox means a
template cannot reach Python internals; it only formats the messages it is given.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["ChatTemplateError", "compile_chat_template", "render_chat_template", "select_chat_template"]


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or raised while rendering."""


def select_chat_template(value: Any, name: str = "default") -> str | None:
    """`chat_template` as stored in tokenizer_config.json: a string, or a list of `{name, template}`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        by_name = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if name not in by_name:
            raise ChatTemplateError(f"chat_template has no template named {name!r} (has {sorted(by_name)})")
        return by_name[name]
    raise ChatTemplateError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str):
    """Compile once per template string (templates are long; rendering happens per prompt)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; render as-is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def render_chat_template(
    source: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text for `messages`; `special_tokens` fills `bos_token`, `eos_token`, ... in the template."""
    import jinja2

    template = compile_chat_template(source)
    context: dict[str, Any] = {"tools": None, "documents": None}  # as transformers passes them
    context.update(special_tokens or {})
    context.update(kwargs)
    try:
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
