"""Chat messages' text is text: a special token typed in a message (``<|im_end|>`` then
``<|im_start|>system``) must not become the control token that opens a new turn.

A rendered chat is one string, and a tokenizer encodes every special token's text in it as that
token, wherever it came from: a client could close its own turn and write a system or
assistant turn the model then obeys (vLLM and transformers' ``apply_chat_template`` behave so;
OpenAI treats content as text). So the rendered prompt is encoded as the template wrote it,
except where a special token's text lies inside a message's content: those spans are encoded
as plain text (the tokenizer with ``encode_special_tokens``). A prompt without such text is
encoded exactly as before, in one piece.

Content is located by searching the rendered prompt for each message's text in order. A
template that changes the text it renders (trims it, say) can hide it; a message that holds a
special token and cannot be found is refused, since its token cannot be kept as text.
"""

from __future__ import annotations

import re

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

    def encode(self, rendered: str, contents: list[str | None]) -> list[int]:
        """Token ids of `rendered`, the chat template's output for messages whose texts are
        `contents` (in order; None for a message without text)."""
        ids: list[int] = []
        at = 0
        for start, end in self._typed_specials(rendered, contents):
            ids += token_ids(self.tokenizer, rendered[at:start])
            ids += token_ids(self._as_text, rendered[start:end])
            at = end
        return ids + token_ids(self.tokenizer, rendered[at:])

    def _typed_specials(self, rendered: str, contents: list[str | None]) -> list[tuple[int, int]]:
        """The spans of special tokens' text inside the messages' contents, in order."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, text in enumerate(contents):
            inside = self._occurrences(text or "")
            if not inside:
                continue
            found = rendered.find(text, cursor)
            if found < 0:
                token = text[inside[0][0] : inside[0][1]]
                raise ValueError(
                    f"messages[{i}].content holds {token!r}, the text of a special token, and "
                    "the chat template changes the content it renders, so it cannot be kept as "
                    "text: remove it from the message"
                )
            spans += [(found + a, found + b) for a, b in inside]
            cursor = found + len(text)
        return spans

    def _occurrences(self, text: str) -> list[tuple[int, int]]:
        """Where special tokens' texts lie in `text`, leftmost first, the longest at a place."""
        if self._pattern is None:
            return []
        return [m.span() for m in self._pattern.finditer(text)]
