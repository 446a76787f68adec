"""Chat templates from the artifact, rendered in a sandboxed Jinja environment.

A template is code that came with a model: the sandbox keeps it from reaching Python internals,
and the environment offers only what Hugging Face templates expect (raise_exception,
strftime_now, tojson, and the tokenizer's special tokens)."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import string
import sys
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator, Frame
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


# A render's bounds. Jinja's sandbox keeps a template from Python's internals but not from
# work: nested loops ran for most of an hour, and `'x' * 10**8` or a string doubled with `~`
# took gigabytes, tying up the server's threads (transformers and vLLM render unbounded too).
# Real templates stay far below: SmolLM2's runs 5 template lines per message, and a render of
# 200 messages takes 5 ms bounded against 1.2 ms unbounded (the line count's cost).
MAX_TEMPLATE_LINES = 2_000_000  # 0.2 s of an empty nested loop on a Zen 4 core
MAX_TEMPLATE_CHARS = 1 << 24  # the longest string or list a render builds, its output included


def _too_large(size: int) -> None:
    if size > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(
            f"the chat template built a value of length {size:,}, over the {MAX_TEMPLATE_CHARS:,} "
            "a render may: shorten the conversation, or fix the template"
        )


def _sized(value: object) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple) else 0


# Filters whose int argument is a width they pad to: a huge one is refused before it
# allocates. Other filters' and calls' results are checked after (a number to format is
# not a size).
_WIDTH_FILTERS = frozenset({"center", "indent"})
_PRINTF_SPEC = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d*))?")


def _widths(fmt: object) -> int:
    """The largest width or precision a format string asks for, in str.format's fields or
    printf's specs (`'{:>999999999}'`, `'%.999999999f'`): refused before they allocate."""
    if not isinstance(fmt, str):
        return 0
    numbers = [n for spec in _PRINTF_SPEC.findall(fmt) for n in spec if n]
    with contextlib.suppress(ValueError):  # not a valid str.format string: no fields
        fields = string.Formatter().parse(fmt)
        numbers += [n for _, _, spec, _ in fields if spec for n in re.findall(r"\d+", spec)]
    return max(map(int, numbers), default=0)


class _Compiler(CodeGenerator):
    """Compiles `a ~ b` to a call the environment checks: Jinja compiles it to a join that no
    sandbox hook sees."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the sizes that operators, filters and calls make bounded."""

    code_generator_class = _Compiler
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%":  # printf-style formatting, or a number's remainder
            _too_large(_widths(left))
        elif operator == "*":  # a repeat's length; numbers have none
            _too_large(max(_sized(left), _sized(right)) * max(_int(left), _int(right), 1))
        elif operator == "+":
            _too_large(_sized(left) + _sized(right))
        elif isinstance(left, int) and isinstance(right, int) and right > 0:  # **
            _too_large(left.bit_length() * right // 8)
        return super().call_binop(context, operator, left, right)

    def concat_checked(self, values: Iterable[object]) -> str:
        parts = [str(v) for v in values]
        _too_large(sum(map(len, parts)))
        return "".join(parts)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # `'...'.format`: its string's widths
            _too_large(_widths(value.__self__))
        return wrapped

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        result = super().call(__context, __obj, *args, **kwargs)
        _too_large(_sized(result))
        return result


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _bounded_filter(name: str, f: Callable) -> Callable:
    @functools.wraps(f)  # keeps Jinja's pass_context/pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if name in _WIDTH_FILTERS:
            _too_large(max(map(_int, [*args, *kwargs.values()]), default=0))
        elif name == "format":  # printf-style, the value filtered is the format
            _too_large(_widths(args[0] if args else None))
        result = f(*args, **kwargs)
        _too_large(_sized(result))
        return result

    return bounded


def _line_budget(limit: int) -> Callable:
    """A trace function for sys.settrace that counts the template's own lines (not Jinja's
    or Python's) and stops the render past `limit`: a loop's every turn runs some."""
    count = 0

    def line(frame: FrameType, event: str, arg: object) -> Callable | None:
        nonlocal count
        if event == "line":
            count += 1
            if count > limit:
                raise ChatTemplateError(
                    f"the chat template ran over {limit:,} template lines for one render (a "
                    "runaway loop): shorten the conversation, or fix the template"
                )
        return line

    def call(frame: FrameType, event: str, arg: object) -> Callable | None:
        return line if frame.f_code.co_filename == "<template>" else None

    return call


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = _BoundedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _Generation],
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
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
        outer = sys.gettrace()  # a debugger's or coverage's, given back after
        sys.settrace(_line_budget(MAX_TEMPLATE_LINES))
        try:
            text = self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **extra,
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # a template's own bug, surfaced with its message
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
        finally:
            sys.settrace(outer)
        _too_large(len(text))
        return text


def _token_text(value: str | dict | None) -> str | None:
    return value.get("content") if isinstance(value, dict) else value
