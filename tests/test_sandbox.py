"""Chat templates render within bounds of steps and size: a template that would run forever or write
gigabytes is stopped, deterministically, however busy the machine; real templates render unchanged."""

from __future__ import annotations

import pytest

from fixtures.checkpoints import CHATML, GENERATION_CHATML
from minigpt.data import sandbox
from minigpt.data.chat import ChatTemplate
from minigpt.runtime.errors import ConfigError

CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."}]


@pytest.fixture
def small_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hundred times fewer steps, so the tests that run into them are quick; real templates still fit."""
    monkeypatch.setattr(sandbox, "MAX_STEPS", 10_000)


@pytest.mark.parametrize(
    ("source", "bound"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
        ("{% for x in messages * 50000 %}{% for y in messages * 50000 %}{% endfor %}{% endfor %}", "steps"),
        (
            "{% macro f() %}{% for i in range(100) %}{{ i }}{% endfor %}{{ f() }}{% endmacro %}{{ f() }}",
            "steps",
        ),
        ("{% for m in messages %}{{ m['content'] * 1000000 }}{% endfor %}", "characters"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "characters",
        ),
        (
            "{% set ns = namespace(s=['a']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "characters",
        ),
        ("{{ 'x' | center(1000000000) }}", "characters"),
        ("{{ messages[0]['content'].ljust(1000000000) }}", "characters"),
        ("{{ '%0999999999d' % 1 }}", "characters"),
        ("{{ 10 ** 1000000000 }}", "characters"),
        ("{% for i in range(2000) %}{{ messages * 10 }}{% endfor %}", "characters"),
    ],
)
def test_a_template_past_its_bounds_is_stopped_in_one_line_naming_it(
    source: str, bound: str, small_budget: None
) -> None:
    with pytest.raises(ConfigError) as e:
        ChatTemplate(source, origin="the chat template in ck/chat_template.jinja").render(CONVERSATION)
    said = str(e.value)
    assert said.startswith("the chat template in ck/chat_template.jinja ") and f" {bound} rendering" in said
    assert "\n" not in said


def test_real_templates_of_long_conversations_render_within_the_bounds(small_budget: None) -> None:
    """The bounds grow with the conversation: a thousand turns of ordinary templates render whole."""
    long = [{"role": r, "content": f"turn {i} " * 20} for i in range(500) for r in ("user", "assistant")]
    for source in (CHATML, GENERATION_CHATML):
        rendered = ChatTemplate(source).render(long)
        assert all(m["content"] in rendered.text for m in long)
    assert len(ChatTemplate(GENERATION_CHATML).render(long).assistant) == 500


def test_the_bounds_hold_only_while_rendering() -> None:
    assert sandbox.current() is None
    with sandbox.bounded(sandbox.Budget.for_input(1, 10)) as budget:
        assert sandbox.current() is budget
    assert sandbox.current() is None
