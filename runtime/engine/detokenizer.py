"""Incremental detokenization: token ids in, text deltas out, O(1) work per token.

The prefix-offset/read-offset technique (as in TGI and vLLM): keep a small window of ids whose
first part (up to the read offset) has already been turned into text. For each new token,
decode the window with and without the unread tail and emit the difference. Decoding a window
rather than single tokens keeps the decoder's context-dependent behaviour right (SentencePiece
"▁" prefixes, whose leading space is stripped only at the start of a decode, byte-fallback and
byte-level tokens that together form one character), and diffing against the window's own
decode cancels whatever the decoder does at the window's start.

Text is held back while the decode ends in U+FFFD: a byte-level BPE or byte-fallback token can
end in the middle of a multi-byte UTF-8 character, and the rest arrives with the next tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

# Prompt tokens kept as left context for the first generated tokens (vLLM uses 5).
_PROMPT_CONTEXT = 5
# A UTF-8 character is at most 4 bytes, so a valid one never needs more than 4 held tokens.
# Past this many the text is emitted even if it ends in U+FFFD (invalid bytes from the model,
# or a genuine U+FFFD character), which keeps the work per token bounded: the window holds at
# most the last emitted chunk plus the held tokens, 2 * (_MAX_HELD + 1) ids.
_MAX_HELD = 8
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text, one token at a time.

    step() returns the text the new token completes (possibly ""); `text` is everything
    emitted so far. Their concatenation equals the text of decoding prompt + output minus the
    prompt's, and with an empty prompt exactly tokenizer.decode(output ids).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._special: frozenset[int] = (
            frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
            if skip_special_tokens
            else frozenset()
        )
        window = [int(t) for t in list(prompt_ids)[-_PROMPT_CONTEXT:]]
        window = [t for t in window if t not in self._special]
        self._window: list[int] = window  # ids from the prefix offset on
        self._read = len(window)  # window[:_read] is already text (or prompt)
        self._prefix_text = self._decode(window)  # decode(window[:_read])
        self._parts: list[str] = []
        self._text: str | None = ""
        self._n_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Add one generated token; return the new text it completes (may be "")."""
        self._n_tokens += 1
        token_id = int(token_id)
        if token_id in self._special:
            # decode(skip_special_tokens=True) drops these before decoding: dropping them here
            # is the same, and keeps a run of them from growing the window.
            return ""
        self._window.append(token_id)
        new_text = self._decode(self._window)
        overdue = len(self._window) - self._read > _MAX_HELD
        if len(new_text) <= len(self._prefix_text):
            if overdue:  # tokens that decode to nothing in context: stop carrying them
                self._advance()
            return ""
        if new_text.endswith(_REPLACEMENT) and not overdue:
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._advance()
        self._parts.append(delta)
        self._text = None
        return delta

    def _advance(self) -> None:
        """The old read offset becomes the prefix offset; everything in the window is read."""
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)

    def flush(self) -> str:
        """At the end of a sequence: emit any held-back text, even an incomplete character."""
        if len(self._window) == self._read:
            return ""
        delta = self._decode(self._window)[len(self._prefix_text) :]
        self._advance()
        if delta:
            self._parts.append(delta)
            self._text = None
        return delta

    @property
    def text(self) -> str:
        """All generated text emitted so far."""
        if self._text is None:
            self._text = "".join(self._parts)
            self._parts = [self._text]
        return self._text

    @property
    def num_tokens(self) -> int:
        """Tokens passed to step() so far (special ones included)."""
        return self._n_tokens
