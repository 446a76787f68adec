"""Chat messages' text is text: a special token typed in a message (``<|im_end|>`` then
``<|im_start|>system``) must not become the control token that opens a new turn.

A rendered chat is one string, and a tokenizer encodes every special token's text in it as that
token, wherever it came from: a client could close its own turn and write a system or
assistant turn the model then obeys (vLLM and transformers' ``apply_chat_template`` behave so;
OpenAI treats content as text). So the rendered prompt is encoded as the template wrote it,
except where a special token's text lies inside a message's content: those spans are encoded
as plain text (the tokenizer with ``encode_special_tokens``). A prompt without such text is
encoded exactly as before, in one piece.

Content is located by rendering the chat once more with a unique mark in place of each such
message: the template's own text lies between the marks, so a message that repeats the
template's text (``<|im_end|>`` right after the template's own) cannot be mistaken for it. A
template that changes the text it renders beyond trimming whitespace hides it; a message that
holds a special token and cannot be found is refused, since its token cannot be kept as text.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

from tokenizers import Tokenizer

from runtime.text import token_ids


class MessageText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._as_text = Tokenizer.from_str(tokenizer.to_str())
        self._as_text.encode_special_tokens = True
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        longest_first = sorted(specials, key=len, reverse=True)  # an alternation takes the first
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if specials else None

    def encode(
        self,
        rendered: str,
        contents: list[str | None],
        rerender: Callable[[dict[int, str]], str],
    ) -> list[int]:
        """Token ids of `rendered`, the chat template's output for messages whose texts are
        `contents` (in order; None for a message without text). `rerender` renders the same
        chat with some messages' texts replaced ({index: text})."""
        ids: list[int] = []
        at = 0
        for start, end in self._typed_specials(rendered, contents, rerender):
            ids += token_ids(self.tokenizer, rendered[at:start])
            ids += token_ids(self._as_text, rendered[start:end])
            at = end
        return ids + token_ids(self.tokenizer, rendered[at:])

    def check_plain(self, value: object, where: str) -> None:
        """A client's string the template renders outside a message's content (a message's
        name, tool calls' arguments, tools' descriptions and schemas, template kwargs) holds
        no special token's text: only content is located and kept as text, so such a token
        would become the control token. Refused, naming the field."""
        if isinstance(value, str):
            found = self._occurrences(value)
            if found:
                a, b = found[0]
                raise ValueError(
                    f"{where} holds {value[a:b]!r}, the text of a special token, which the chat "
                    "template would render as that token; only a message's content may hold "
                    "it (kept as text): remove it"
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                self.check_plain(key, f"{where}.{key}")
                self.check_plain(item, f"{where}.{key}")
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                self.check_plain(item, f"{where}.{i}")

    def _typed_specials(
        self,
        rendered: str,
        contents: list[str | None],
        rerender: Callable[[dict[int, str]], str],
    ) -> list[tuple[int, int]]:
        """The spans of special tokens' texts inside the messages' contents, in order."""
        typed = [i for i, text in enumerate(contents) if text and self._occurrences(text)]
        if not typed:
            return []
        tag = secrets.token_hex(8)
        marks = {i: f"\ue000{tag}:{i}\ue001" for i in typed}
        pieces = re.split(f"\ue000{tag}:\\d+\ue001", rerender(marks))
        spans: list[tuple[int, int]] = []
        at = 0
        for k, i in enumerate(typed):
            if len(pieces) != len(typed) + 1 or not rendered.startswith(pieces[k], at):
                raise self._hidden(i, contents[i])
            at += len(pieces[k])
            after = pieces[k + 1]
            shown = next(
                (
                    variant
                    for variant in _as_rendered(contents[i])
                    if rendered.startswith(variant, at)
                    and rendered.startswith(after, at + len(variant))
                ),
                None,
            )
            if shown is None:
                raise self._hidden(i, contents[i])
            spans += [(at + a, at + b) for a, b in self._occurrences(shown)]
            at += len(shown)
        if rendered[at:] != pieces[-1]:
            raise self._hidden(typed[-1], contents[typed[-1]])
        return spans

    def _hidden(self, i: int, text: str) -> ValueError:
        a, b = self._occurrences(text)[0]
        return ValueError(
            f"messages[{i}].content holds {text[a:b]!r}, the text of a special token, and the "
            "chat template changes the content it renders, so it cannot be kept as text: "
            "remove it from the message"
        )

    def _occurrences(self, text: str) -> list[tuple[int, int]]:
        """Where special tokens' texts lie in `text`, leftmost first, the longest at a place."""
        if self._pattern is None:
            return []
        return [m.span() for m in self._pattern.finditer(text)]


def _as_rendered(text: str) -> tuple[str, ...]:
    """How a template may render a message's text: as is, or trimmed (Llama 3's `| trim`)."""
    return tuple(dict.fromkeys((text, text.strip(), text.lstrip(), text.rstrip())))
