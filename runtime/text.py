"""Strings that are not text. Python carries unpaired UTF-16 surrogates in str: from JSON
("\\ud83d" alone) and from bytes that were not UTF-8 (argv and stdin decode them as
\\udc80-\\udcff). The tokenizer refuses them with a bare TypeError, so each entry point
checks its text first and names it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def check_text(text: str, what: str, fix: str) -> None:
    """Raise ValueError naming `what`, the first unpaired surrogate and its offset."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds an unpaired UTF-16 surrogate (\\u{ord(text[e.start]):04x} at "
            f"character {e.start}), which is not text: {fix}"
        ) from e


def token_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids of `text`, encoded with the GIL released: Tokenizer.encode holds it for the
    whole call (5 s for a 4 MB message, stalling the server's event loop and its engine
    thread), encode_batch lets other threads run. 15 us more on a short prompt."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
