"""Chat templates as their authors wrote them: every case of tests/reference/chat-templates
(rendered by transformers, `strftime_now` pinned to the recorded date) renders to the identical
string, its `kwargs` passed as chat_template_kwargs; a conversation the template refuses is a
TemplateError carrying the template's own message. Then the kwargs' checks."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from actors.errors import InvalidRequest, TemplateError
from actors.model.text.chat import (
    MAX_TEMPLATE_KWARGS_CHARS,
    MAX_TEMPLATE_KWARGS_DEPTH,
    RENDER_VARIABLES,
    ChatTemplate,
)
from tests.conftest import REFERENCE_DIR

TEMPLATES_DIR = REFERENCE_DIR / "chat-templates"
REFERENCE_FILES = sorted(path for path in TEMPLATES_DIR.glob("*.json") if path.name != "index.json")
USER = [{"role": "user", "content": "Hi"}]


def _reference(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _template(reference: dict[str, Any]) -> ChatTemplate:
    pinned = datetime.fromisoformat(reference["strftime_now_date"])
    return ChatTemplate(reference["template"], bos_token=reference["bos_token"],
                        eos_token=reference["eos_token"], now=lambda: pinned)


def _render(template: ChatTemplate, conversation: dict[str, Any]) -> str:
    return template.render(conversation["messages"], conversation["add_generation_prompt"],
                           tools=conversation.get("tools"),
                           chat_template_kwargs=conversation.get("kwargs"))


def _entries(key: str) -> list[Any]:
    return [pytest.param(path, index, id=f"{path.stem}-{index}")
            for path in REFERENCE_FILES for index in range(len(_reference(path)[key]))]


@pytest.fixture(scope="module")
def templates() -> dict[Path, ChatTemplate]:
    return {path: _template(_reference(path)) for path in REFERENCE_FILES}


def test_every_family_is_here() -> None:
    assert len(REFERENCE_FILES) >= 10
    assert all(_reference(path)["cases"] for path in REFERENCE_FILES)
    kwargs = [case["kwargs"] for path in REFERENCE_FILES
              for case in _reference(path)["cases"] if case.get("kwargs")]
    assert {"enable_thinking": False} in kwargs  # Qwen3's


@pytest.mark.parametrize(("path", "index"), _entries("cases"))
def test_reference_case_renders_identically(templates: dict[Path, ChatTemplate], path: Path,
                                            index: int) -> None:
    case = _reference(path)["cases"][index]
    assert _render(templates[path], case) == case["rendered"]


# Where a refusal's recorded text may lie in a reference file's `refused` entry.
REFUSAL_TEXT_KEYS = ("message", "error", "exception")


def test_reference_refusals_are_the_templates_own(templates: dict[Path, ChatTemplate]) -> None:
    """Every `refused` conversation of every file is a TemplateError carrying the text the
    reference recorded; and, so that this cannot pass on empty lists, the Mistral and Gemma 3
    templates refuse two user turns in a row with their own words."""
    for path in REFERENCE_FILES:
        for refusal in _reference(path)["refused"]:
            recorded = next((refusal[key] for key in REFUSAL_TEXT_KEYS if key in refusal), "")
            with pytest.raises(TemplateError, match=re.escape(recorded)):
                templates[path].render(refusal["messages"],
                                       refusal.get("add_generation_prompt", True),
                                       tools=refusal.get("tools"),
                                       chat_template_kwargs=refusal.get("kwargs"))
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for name, words in (("mistralai-Mistral-Nemo-Instruct-2407", "roles must alternate"),
                        ("google-gemma-3-it", "Conversation roles must alternate")):
        with pytest.raises(TemplateError, match=f"refused the conversation: .*{words}"):
            templates[TEMPLATES_DIR / f"{name}.json"].render(two_users)


def test_the_pinned_clock_is_what_strftime_now_reads() -> None:
    source = "{{ strftime_now('%d %b %Y') }}"
    pinned = ChatTemplate(source, bos_token="", eos_token="", now=lambda: datetime(2024, 2, 29))
    assert pinned.render(USER) == "29 Feb 2024"
    before = datetime.now().strftime("%d %b %Y")
    today = ChatTemplate(source, bos_token="", eos_token="").render(USER)
    assert today in (before, datetime.now().strftime("%d %b %Y"))  # unpinned: the local date


def test_qwen3_thinking_switch_changes_the_prompt(templates: dict[Path, ChatTemplate]) -> None:
    qwen3 = templates[TEMPLATES_DIR / "Qwen-Qwen3-0.6B.json"]
    thinking = qwen3.render(USER)
    not_thinking = qwen3.render(USER, chat_template_kwargs={"enable_thinking": False})
    assert not_thinking == thinking + "<think>\n\n</think>\n\n"


def test_kwargs_are_template_variables_of_any_json_shape() -> None:
    template = ChatTemplate("{{ persona.name }}/{{ flags | join(',') }}/{{ level }}/{{ none }}",
                            bos_token="", eos_token="")
    kwargs = {"persona": {"name": "Ada"}, "flags": ["a", "b"], "level": 2.5, "none": None}
    assert template.render(USER, chat_template_kwargs=kwargs) == "Ada/a,b/2.5/None"
    probe = ChatTemplate("{{ level is defined }}", bos_token="", eos_token="")
    assert probe.render(USER, chat_template_kwargs={"level": 1}) == "True"
    assert probe.render(USER) == "False"  # nothing stays from an earlier render


def test_a_refusal_carries_the_templates_message() -> None:
    template = ChatTemplate(
        "{% if not allow %}{{ raise_exception('Conversations must allow it.') }}{% endif %}ok",
        bos_token="", eos_token="")
    with pytest.raises(TemplateError, match="refused the conversation: Conversations must "
                                            "allow it\\.$"):
        template.render(USER)
    assert template.render(USER, chat_template_kwargs={"allow": True}) == "ok"


RESERVED = [*RENDER_VARIABLES, "raise_exception", "strftime_now", "namespace", "range"]


@pytest.mark.parametrize("name", RESERVED)
def test_reserved_names_are_refused_by_name(name: str) -> None:
    template = ChatTemplate("{{ messages[0].content }}", bos_token="", eos_token="")
    with pytest.raises(InvalidRequest, match=f"may not set {name!r}") as caught:
        template.render(USER, chat_template_kwargs={name: "x"})
    assert caught.value.field == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ("enable_thinking", "must be an object.*not str"),
        ([("enable_thinking", False)], "must be an object.*not list"),
        ({"enable thinking": False}, "the key 'enable thinking'"),
        ({"1st": False}, "the key '1st'"),
        ({"options": {1: "one"}}, "key that is not a string: 1"),
        ({"when": datetime(2025, 1, 1)}, "holds a value of type datetime"),
        ({"ratio": float("nan")}, "holds nan"),
        ({"tags": {"a", "b"}}, "holds a value of type set"),
        ({"notes": "x" * MAX_TEMPLATE_KWARGS_CHARS}, "larger than"),
        ({"items": [0] * MAX_TEMPLATE_KWARGS_CHARS}, "larger than"),
        ({"deep": json.loads("[" * (MAX_TEMPLATE_KWARGS_DEPTH + 1) + "]" *
                             (MAX_TEMPLATE_KWARGS_DEPTH + 1))}, "nests deeper"),
    ],
)
def test_kwargs_that_are_not_named_json_values_are_refused(kwargs: Any, message: str) -> None:
    template = ChatTemplate("{{ messages[0].content }}", bos_token="", eos_token="")
    with pytest.raises(InvalidRequest, match=message) as caught:
        template.render(USER, chat_template_kwargs=kwargs)
    assert caught.value.field == "chat_template_kwargs"


def test_kwargs_just_within_the_bounds_render() -> None:
    template = ChatTemplate("{{ notes | length }}", bos_token="", eos_token="")
    notes = "x" * (MAX_TEMPLATE_KWARGS_CHARS - 100)
    assert template.render(USER, chat_template_kwargs={"notes": notes}) == str(len(notes))
    deep = json.loads("[" * MAX_TEMPLATE_KWARGS_DEPTH + "]" * MAX_TEMPLATE_KWARGS_DEPTH)
    assert template.render(USER, chat_template_kwargs={"notes": deep}) == "1"
