"""runtime/chat_template.py: what Hugging Face templates use renders as transformers renders it,
and what a template must not reach stays out of reach."""

from __future__ import annotations

import pytest

from runtime.chat_template import ChatTemplate, ChatTemplateError

CHAT = [{"role": "user", "content": "héllo", "meta": {"b": 1, "a": [1, 2]}}]


@pytest.mark.parametrize(
    ("expression", "want"),
    [
        ("m.content | tojson", '"héllo"'),
        ("m.content | tojson(ensure_ascii=True)", '"h\\u00e9llo"'),
        ("m.meta | tojson(sort_keys=True)", '{"a": [1, 2], "b": 1}'),
        ("m.meta | tojson(separators=(',', ':'))", '{"b":1,"a":[1,2]}'),
        ("m.meta | tojson(indent=1)", '{\n "b": 1,\n "a": [\n  1,\n  2\n ]\n}'),
    ],
)
def test_tojson_takes_transformers_keyword_arguments(expression: str, want: str) -> None:
    """Templates that pass them failed every request with a TypeError."""
    template = ChatTemplate("{% for m in messages %}{{ " + expression + " }}{% endfor %}", {})
    assert template.render(CHAT, add_generation_prompt=False) == want


def test_the_generation_block_renders_its_body() -> None:
    """transformers' training-mask marker; it did not parse, so the template did not load."""
    source = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "<a>{{ m.content }}</a>{% endgeneration %}{% else %}<u>{{ m.content }}</u>"
        "{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    assert ChatTemplate(source, {}).render(messages) == "<u>q</u><a>r</a>"


@pytest.mark.parametrize(
    "expression",
    ["''.__class__.__mro__", "messages.append(1)", "range(10 ** 9) | list | length"],
)
def test_the_sandbox_still_holds(expression: str) -> None:
    template = ChatTemplate("{{ " + expression + " }}", {})
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        template.render(CHAT)
