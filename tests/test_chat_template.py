"""runtime/chat_template.py: what Hugging Face templates use renders as transformers renders it,
and what a template must not reach stays out of reach."""

from __future__ import annotations

import tracemalloc

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


# A template shipped with a model ran for most of an hour (nested loops) or built gigabytes
# (a repeat, a string doubled with `~` or `+`, a padded filter), tying up the server's
# threads; only when a conversation had two messages, so the load check passed.
TWO = "{% if messages | length > 1 %}BODY{% endif %}{{ messages[0].content }}"
RUNAWAY = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 10 ** 8 }}",
    "repeat a list": "{{ ([1] * 10 ** 8) | length }}",
    "doubled with ~": "{% set ns = namespace(s='x' * 16) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "doubled with +": "{% set ns = namespace(s='x' * 16) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "padded": "{{ 'a' | center(10 ** 10) }}",
    "indented": "{{ 'a\nb' | indent(10 ** 10) }}",
    "formatted": "{{ '{:>99999999}'.format('a') }}",
    "formatted, printf": "{{ '%.999999999f' % 1.0 }}",
    "formatted, filter": "{{ '%999999999d' | format(1) }}",
}


@pytest.mark.parametrize("name", RUNAWAY)
def test_a_runaway_template_fails_its_render_not_the_server(name: str) -> None:
    template = ChatTemplate(TWO.replace("BODY", RUNAWAY[name]), {})
    assert template.render(CHAT) == "héllo"  # what the load check renders
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match="shorten the conversation, or fix the"):
            template.render([*CHAT, {"role": "assistant", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**27, f"{peak / 2**20:.0f} MiB allocated before the refusal"


def test_bounds_leave_real_templates_alone() -> None:
    """Numbers to format are not sizes; repeats, joins and loops within the bounds run."""
    source = (
        "{% for m in messages %}{{ '%d' | format(1700000000123) }} {{ '-' * 3 }}"
        "{{ m.role ~ ':' ~ m.content }}{{ ([m.content] * 2) | join('|') }}"
        "{% for i in range(1000) %}{% endfor %}{{ 2 ** 70 }}{{ 7 % 3 }}{{ '%5.1f' % 2.25 }}"
        "{{ '{:>4}|{:06.2f}'.format('a', 2.5) }}{% endfor %}"
    )
    out = ChatTemplate(source, {}).render(CHAT * 50, add_generation_prompt=False)
    want = "1700000000123 ---user:héllohéllo|héllo1180591620717411303424" + "1  2.2   a|002.50"
    assert out == want * 50
