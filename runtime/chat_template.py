"""Chat templates from the artifact, rendered in a sandboxed Jinja environment.

A template is code that came with a model: the sandbox keeps it from reaching Python internals,
and the environment offers only what Hugging Face templates expect (raise_exception,
strftime_now, tojson, and the tokenizer's special tokens)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token")  # from tokenizer_config.json
# What a template is given by the caller itself; extra template variables cannot set them.
TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", *SPECIAL_TOKENS})


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: its four keyword arguments (templates pass them)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates use to mark the
    assistant's tokens for training masks: rendered as its body (the mask is not needed here)."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class ChatTemplateError(ValueError):
    """The template is broken, or it refused the conversation."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _Generation],
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from e
        self.source = source
        self.special_tokens = special_tokens

    @classmethod
    def from_artifact(cls, root: Path, override: str | Path | None = None) -> ChatTemplate | None:
        """The artifact's template, or `override`'s; None when the artifact has none. A
        missing override is an error: it read as "no template" and chats failed later."""
        path = Path(override) if override is not None else root / "chat_template.jinja"
        if not path.is_file():
            if override is not None:
                raise ChatTemplateError(f"{path}: no such chat template file")
            return None
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ChatTemplateError(f"{path}: the chat template is not UTF-8 text ({e})") from e
        template = cls(source, tokens)
        template.check(path)
        return template

    def check(self, path: Path) -> None:
        """Render a one-message conversation at load: a template that fails on it, or
        renders nothing, would fail every chat request while the server said it was healthy."""
        try:
            text = self.render([{"role": "user", "content": "Hello"}])
        except ChatTemplateError as e:
            raise ChatTemplateError(
                f"{path}: the chat template cannot render a one-message conversation "
                f"({e}); fix it, or give --chat-template FILE"
            ) from e
        if "Hello" not in text:
            raise ChatTemplateError(
                f"{path}: the chat template renders a one-message conversation as {text!r}, "
                "without the message; fix it, or give --chat-template FILE"
            )

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ChatTemplateError("every message needs a 'role' and a 'content'")
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **extra,
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # a template's own bug, surfaced with its message
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e


def _token_text(value: str | dict | None) -> str | None:
    return value.get("content") if isinstance(value, dict) else value
