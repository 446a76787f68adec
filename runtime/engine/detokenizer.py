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

Byte-level BPE tokenizers (GPT-2's scheme: Llama 3, Qwen, SmolLM2) need none of that: their
decoder maps each token to bytes on its own, and the text of a run of ids is those bytes joined
and decoded as UTF-8, invalid bytes replaced. ByteLevelDetokenizer keeps each id's bytes and
feeds them to Python's incremental UTF-8 decoder: no tokenizer call per token (0.8 us a token
against 2.2 for the window's two decodes with SmolLM2's tokenizer, paid for every token of every
sequence on the engine's thread).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from typing import Protocol

import tokenizers
from tokenizers import decoders

# Prompt tokens kept as left context for the first generated tokens (vLLM uses 5).
_PROMPT_CONTEXT = 5
# A UTF-8 character is at most 4 bytes, so a valid one never needs more than 4 held tokens.
# Past this many the text is emitted even if it ends in U+FFFD (invalid bytes from the model,
# or a genuine U+FFFD character), which keeps the work per token bounded: the window holds at
# most the last emitted chunk plus the held tokens, 2 * (_MAX_HELD + 1) ids.
_MAX_HELD = 8
_REPLACEMENT = "\ufffd"


class _Emitted:
    """The text a detokenizer has emitted, joined only when read."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._text: str | None = ""
        self._n_tokens = 0

    def _emit(self, delta: str) -> str:
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


class IncrementalDetokenizer(_Emitted):
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
        super().__init__()
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
        return self._emit(delta)

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
        return self._emit(delta)


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def _gpt2_bytes() -> dict[str, int]:
    """The character the ByteLevel pre-tokenizer writes for each byte, as a map back to the
    byte: printable Latin-1 stands for itself, every other byte for a character from U+0100
    on, in byte order (GPT-2's table, which tokenizers' ByteLevel decoder inverts)."""
    own = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in own}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 0x100 + n
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF = _gpt2_bytes()


class TokenBytes:
    """Each id's bytes under a ByteLevel decoder, read from the tokenizer once per id and
    shared by every sequence of an engine. As the decoder does: a token whose characters are
    all in the byte table is those bytes, any other (an added token with a space or a
    character past Latin-1 in it) its own UTF-8; an id the tokenizer lacks (a model's padded
    vocabulary) is nothing."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        added = tokenizer.get_added_tokens_decoder().items()
        self.special: frozenset[int] = frozenset(i for i, t in added if t.special)

    @staticmethod
    def of(tokenizer: tokenizers.Tokenizer) -> TokenBytes | None:
        """The table, where the tokenizer decodes bytes-wise (None: use the window)."""
        return TokenBytes(tokenizer) if isinstance(tokenizer.decoder, decoders.ByteLevel) else None

    def __getitem__(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            token = self._tokenizer.id_to_token(token_id)
            if token is None:
                found = b""
            else:
                try:
                    found = bytes(_BYTE_OF[c] for c in token)
                except KeyError:
                    found = token.encode()
            self._bytes[token_id] = found
        return found


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's tokens for raw bytes


def piece_bytes(tokenizer: tokenizers.Tokenizer, table: TokenBytes | None, token_id: int) -> bytes:
    """One token's own bytes, for logprobs (OpenAI's ``bytes``): a token may hold part of a
    UTF-8 character, which its decoded text can only show as U+FFFD. From a byte-level
    tokenizer's table, a SentencePiece byte-fallback token's <0xNN>, else its decoded text."""
    if table is not None:
        return table[token_id]
    found = _BYTE_FALLBACK.fullmatch(tokenizer.id_to_token(token_id) or "")
    if found:
        return bytes([int(found.group(1), 16)])
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


class ByteLevelDetokenizer(_Emitted):
    """IncrementalDetokenizer's contract for byte-level tokenizers, by bytes: an incomplete
    character waits in the UTF-8 decoder (at most 3 bytes), invalid bytes come out at once as
    U+FFFD, as tokenizers' lossy decode gives them."""

    def __init__(
        self, table: TokenBytes, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        super().__init__()
        self._table = table
        self._special = table.special if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # a character the prompt's last tokens began is completed by the first output tokens
        for t in list(prompt_ids)[-3:]:
            if int(t) not in self._special:
                self._utf8.decode(table[int(t)])

    def step(self, token_id: int) -> str:
        """Add one generated token; return the new text it completes (may be "")."""
        self._n_tokens += 1
        token_id = int(token_id)
        if token_id in self._special:
            return ""
        return self._emit(self._utf8.decode(self._table[token_id]))

    def flush(self) -> str:
        """At the end of a sequence: an incomplete character becomes U+FFFD."""
        return self._emit(self._utf8.decode(b"", final=True))


def detokenizer(
    tokenizer: tokenizers.Tokenizer,
    table: TokenBytes | None,
    prompt_ids: Sequence[int],
    skip_special_tokens: bool = True,
) -> Detokenizer:
    """One sequence's detokenizer: by bytes where the engine has a table (TokenBytes.of)."""
    if table is not None:
        return ByteLevelDetokenizer(table, prompt_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
