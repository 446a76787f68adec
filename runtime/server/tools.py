"""Tool calls: the grammar a forced call needs, and the parser that finds calls in the output.

`tool_choice` "required" and a named function constrain the output with a JSON schema (the
grammar engine makes it valid); "auto" lets the model write freely and parses the model's own
tool-call syntax, chosen by its chat template: Hermes/Qwen's `<tool_call>{json}</tool_call>`
blocks, or Llama 3.1's bare `{"name": ..., "parameters": ...}` (`;`-separated, after an optional
`<|python_tag|>`). Output that does not parse as a call stays content: a model that writes a
malformed call loses nothing.

One parser serves streaming and whole responses: it is fed text deltas and returns OpenAI's
streaming deltas (content, and tool_calls entries with an index); a whole response is the
same deltas merged, so both give the same result by construction.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def call_id() -> str:
    """OpenAI's shape: "call_" and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def syntax_for(template_source: str | None) -> str:
    """The tool-call syntax the model was trained on, read off its chat template: "llama3"
    for Llama 3.1's JSON form, "hermes" otherwise (Qwen, Hermes, and most ChatML templates)."""
    if template_source and PYTHON_TAG in template_source and HERMES_OPEN not in template_source:
        return "llama3"
    return "hermes"


def forced_schema(tools: list[dict[str, Any]], named: str | None) -> dict[str, Any]:
    """The schema a forced call's output must match: a named function's arguments, or for
    "required" a non-empty list of {name, arguments} objects, one of the tools each."""
    if named is not None:
        return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == named)
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"]["parameters"],
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}


@dataclass
class Delta:
    """What one chunk of output adds: content text and tool_calls delta entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _as_call(obj: Any, args_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) from a parsed call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of text that could begin tag (kept back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Turns a choice's generated text into content and tool_calls, delta by delta.

    mode: "none" (all content), "auto" (parse the model's syntax), "named" (the text is the
    named function's arguments, streamed as they come), "required" (the text is a JSON list of
    {name, arguments}, turned into calls when it is complete). `tools`: the names the request
    declared; in "auto" a call naming another stays content (a client must never be handed a
    call of a function it did not offer).
    """

    def __init__(
        self,
        mode: str,
        syntax: str = "hermes",
        name: str | None = None,
        tools: frozenset[str] = frozenset(),
    ) -> None:
        self.mode, self.syntax, self.name, self.tools = mode, syntax, name, tools
        self._buffer = ""  # text not yet handed out
        self._in_call = False  # auto/hermes: inside a <tool_call> block
        self._calls = 0
        self._started = False  # named: the call's id and name were sent

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> Delta:
        if self.mode == "none":
            return Delta(content=text)
        if self.mode == "named":
            return self._named(text)
        self._buffer += text
        if self.mode == "required" or self.syntax == "llama3":
            return self._llama3_prefix() if self.mode == "auto" else Delta()
        return self._hermes()

    def finish(self) -> Delta:
        """The end of the output: whatever is left, parsed if it can be."""
        if self.mode in ("none", "named"):
            return Delta()
        rest, self._buffer = self._buffer, ""
        if self.mode == "required":
            return self._required(rest)
        if self.syntax == "llama3":
            return self._llama3(rest)
        if self._in_call:
            delta = self._hermes_block(rest)
            return delta if delta.tool_calls else Delta(content=HERMES_OPEN + rest)
        return Delta(content=rest)

    def _next_call(self, name: str, arguments: str) -> dict[str, Any]:
        self._calls += 1
        return _call_delta(self._calls - 1, name, arguments)

    def _named(self, text: str) -> Delta:
        """The call's id and name with the first arguments text, then more arguments."""
        if not self._started:
            self._started = True
            return Delta(tool_calls=[self._next_call(self.name or "", text)])
        return Delta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])

    def _required(self, text: str) -> Delta:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return Delta(content=text)  # cut short (max_tokens): the client sees what came
        calls = [c for c in (_as_call(i, "arguments") for i in items) if c is not None]
        return Delta(tool_calls=[self._next_call(n, a) for n, a in calls])

    def _hermes(self) -> Delta:
        out = Delta()
        while True:
            if not self._in_call:
                at = self._buffer.find(HERMES_OPEN)
                if at == -1:
                    keep = _held_prefix(self._buffer, HERMES_OPEN)
                    cut = len(self._buffer) - keep
                    out.content += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    return out
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(HERMES_OPEN) :]
                self._in_call = True
            end = self._buffer.find(HERMES_CLOSE)
            if end == -1:
                return out
            block, self._buffer = self._buffer[:end], self._buffer[end + len(HERMES_CLOSE) :]
            self._in_call = False
            parsed = self._hermes_block(block)
            out.tool_calls += parsed.tool_calls
            out.content += parsed.content

    def _hermes_block(self, block: str) -> Delta:
        try:
            call = _as_call(json.loads(block), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None or call[0] not in self.tools:  # malformed or undeclared: as it was
            return Delta(content=HERMES_OPEN + block + HERMES_CLOSE)
        return Delta(tool_calls=[self._next_call(*call)])

    def _llama3_prefix(self) -> Delta:
        """Stream content until the output shows it is a call (it starts with `{` or the
        python tag); from then on hold everything for finish()."""
        if self._in_call:
            return Delta()
        head = self._buffer.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return Delta()  # undecided yet
        if head.startswith(("{", PYTHON_TAG)):
            self._in_call = True
            return Delta()
        self.mode = "none"  # plain content from here on
        out, self._buffer = self._buffer, ""
        return Delta(content=out)

    def _llama3(self, text: str) -> Delta:
        calls = _llama3_calls(text.strip().removeprefix(PYTHON_TAG).strip())
        if not calls or any(name not in self.tools for name, _ in calls):
            return Delta(content=text)  # not (all) calls of declared tools: the text as it was
        return Delta(tool_calls=[self._next_call(n, a) for n, a in calls])


def _llama3_calls(body: str) -> list[tuple[str, str]]:
    """Llama 3's calls: JSON objects separated by `;`, read one object at a time, since a `;`
    inside an argument (SQL, code, prose) is no separator. Empty unless all of it is calls."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            item, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return []
        call = _as_call(item, "parameters")
        if call is None:
            return []
        calls.append(call)
        rest = body[at:].lstrip()
        if rest and not rest.startswith(";"):
            return []
        at = len(body) - len(rest.removeprefix(";").lstrip())
    return calls


def merge_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole tool calls from their streamed deltas (arguments concatenated by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d["index"] not in calls:
            calls[d["index"]] = {
                "id": d["id"],
                "type": "function",
                "function": {"name": d["function"]["name"], "arguments": ""},
            }
        calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]
