"""Pydantic's validation errors as one readable line: for API clients (the server's 400s,
with the param) and for files a user wrote (recipes, manifests). Pydantic's own rendering
spans lines and links to its docs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError


def _describe(err: dict[str, Any]) -> tuple[str, str | None]:
    loc = list(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path"):  # FastAPI's prefix
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return (f"invalid JSON body: {detail}" if detail else "invalid JSON body"), None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "unsupported_field":  # raised over the whole body; it names its field
        return msg, (err.get("ctx") or {}).get("field")
    if not loc:
        return ("request body is missing" if err.get("type") == "missing" else msg), None
    path = ".".join(str(part) for part in loc)
    text = msg if msg == path or msg.startswith(path + " ") else f"{path}: {msg}"
    value = err.get("input")
    if err.get("type") != "missing" and isinstance(value, (bool, int, float, str)):
        shown = repr(value) if not isinstance(value, str) or len(value) <= 40 else None
        if shown is not None:
            text += f" (got {shown})"
    return text, path


def validation_message(exc: ValidationError | Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message for a pydantic or FastAPI validation error, plus the param
    (dotted path of the first bad field, e.g. "messages.0.role"; None for body-level errors)."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    if not errors:
        return "invalid request", None
    described = [_describe(e) for e in errors]
    return "; ".join(text for text, _ in described), described[0][1]
