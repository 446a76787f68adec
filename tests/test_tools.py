"""The tool-call parser on well-formed, malformed and streamed (split anywhere) outputs, for
both syntaxes, plus the forced-call schema and the syntax read off a chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.server.tools import (
    ToolCallParser,
    forced_schema,
    merge_calls,
    syntax_for,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]


NAMES = frozenset({"get_weather", "noop", "sql"})  # what the requests declared


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed the pieces, finish, and merge: (content, whole calls)."""
    content, deltas = "", []
    for piece in pieces:
        d = parser.feed(piece)
        content += d.content
        deltas += d.tool_calls
    d = parser.finish()
    return content + d.content, merge_calls(deltas + d.tool_calls)


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in chunks of 3 and 7."""
    return [[text], list(text)] + [
        [text[i : i + n] for i in range(0, len(text), n)] for n in (3, 7)
    ]


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize("pieces", splits(HERMES))
def test_hermes_calls_parse_however_the_text_is_split(pieces: list[str]) -> None:
    content, calls = run(ToolCallParser("auto", "hermes", tools=NAMES), pieces)
    assert content.strip() == "Let me check."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("noop", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_hermes_streams_content_before_the_call_and_holds_a_partial_tag() -> None:
    parser = ToolCallParser("auto", "hermes", tools=NAMES)
    assert parser.feed("Hello <tool").content == "Hello "  # "<tool" may open a call
    assert parser.feed("box> ok").content == "<toolbox> ok"  # it did not


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
        '<tool_call>["not", "a", "call"]</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut short
    ],
)
def test_malformed_hermes_calls_stay_content(text: str) -> None:
    for pieces in splits(text):
        assert run(ToolCallParser("auto", "hermes", tools=NAMES), pieces) == (text, [])


def test_an_unclosed_but_complete_hermes_call_still_counts() -> None:
    text = '<tool_call>{"name": "noop", "arguments": {}}'
    assert calls_of(run(ToolCallParser("auto", "hermes", tools=NAMES), [text])[1]) == [("noop", {})]


LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "noop"}'


@pytest.mark.parametrize("pieces", splits(LLAMA) + splits(LLAMA.removeprefix("<|python_tag|>")))
def test_llama3_json_calls(pieces: list[str]) -> None:
    content, calls = run(ToolCallParser("auto", "llama3", tools=NAMES), pieces)
    assert content == ""
    assert calls_of(calls) == [("get_weather", {"city": "Oslo"}), ("noop", {})]


def test_llama3_arguments_may_hold_semicolons() -> None:
    """`;` separates calls only between objects: inside an argument it is the argument's."""
    text = '{"name": "sql", "parameters": {"q": "select 1; drop t"}};{"name": "noop"} ; '
    for pieces in splits(text):
        content, calls = run(ToolCallParser("auto", "llama3", tools=NAMES), pieces)
        assert content == "" and calls_of(calls) == [
            ("sql", {"q": "select 1; drop t"}),
            ("noop", {}),
        ]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "x", "parameters": [1]}',
        "{oops",
        '{"name": "a"} {"name": "b"}',  # no separator
        '{"name": "a"}; trailing words',
    ],
)
def test_llama3_text_or_malformed_json_is_content(text: str) -> None:
    for pieces in splits(text):
        assert run(ToolCallParser("auto", "llama3", tools=NAMES), pieces) == (text, [])


def test_llama3_streams_plain_text_as_it_comes() -> None:
    parser = ToolCallParser("auto", "llama3", tools=NAMES)
    assert parser.feed("  ").content == ""  # undecided
    assert parser.feed("Sure").content == "  Sure"
    assert parser.feed(" thing").content == " thing"


def test_named_streams_arguments_as_deltas() -> None:
    parser = ToolCallParser("named", name="get_weather")
    first = parser.feed('{"city"')
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert len(first.tool_calls) == 1 and first.tool_calls[0]["id"].startswith("call_")
    later = parser.feed(': "Rome"}')
    assert later.tool_calls == [{"index": 0, "function": {"arguments": ': "Rome"}'}}]
    calls = merge_calls(first.tool_calls + later.tool_calls + parser.finish().tool_calls)
    assert calls_of(calls) == [("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("pieces", splits('[{"name": "noop", "arguments": {"a": 1}}]'))
def test_required_output_becomes_calls_at_the_end(pieces: list[str]) -> None:
    assert calls_of(run(ToolCallParser("required"), pieces)[1]) == [("noop", {"a": 1})]


def test_required_cut_short_is_content() -> None:
    assert run(ToolCallParser("required"), ['[{"name": "no']) == ('[{"name": "no', [])


def test_none_mode_is_all_content() -> None:
    assert run(ToolCallParser("none"), splits(HERMES)[1]) == (HERMES, [])


def test_forced_schemas() -> None:
    assert forced_schema(TOOLS, "get_weather") == WEATHER
    required = forced_schema(TOOLS, None)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "X"}}], required)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "other", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)


def test_syntax_from_template() -> None:
    assert syntax_for("{{ '<tool_call>' }}") == "hermes"
    assert syntax_for("{{ '<|python_tag|>' }} Environment: ipython") == "llama3"
    assert syntax_for(None) == "hermes"


@pytest.mark.parametrize(
    ("syntax", "text"),
    [
        ("hermes", '<tool_call>{"name": "delete_all", "arguments": {"x": 1}}</tool_call>'),
        ("llama3", '{"name": "noop"}; {"name": "delete_all", "parameters": {}}'),
    ],
)
def test_a_call_of_an_undeclared_function_stays_content(syntax: str, text: str) -> None:
    """The model may write any name; a client was handed a call of `delete_all`, which it
    never offered."""
    for pieces in splits(text):
        assert run(ToolCallParser("auto", syntax, tools=NAMES), pieces) == (text, [])
