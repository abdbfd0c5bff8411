"""Chat templates: transformers' renderings of SmolLM2's template, the sandbox, the errors."""

from __future__ import annotations

import json

import pytest

from actors.errors import InvalidRequest, TemplateError
from actors.model.gguf.reader import open_gguf
from actors.model.text.chat import ChatTemplate
from tests.conftest import REFERENCE_DIR, gemma3_path, smollm2_path

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smollm2_template() -> ChatTemplate:
    return ChatTemplate.from_model_metadata(open_gguf(smollm2_path()))


def test_every_reference_case_renders_identically(smollm2_template: ChatTemplate) -> None:
    reference = json.loads((REFERENCE_DIR / "smollm2-135m" / "chat_template.json").read_text())
    assert len(reference["cases"]) >= 8
    for case in reference["cases"]:
        rendered = smollm2_template.render(case["messages"], case["add_generation_prompt"])
        assert rendered == case["rendered"]


def test_special_tokens_come_from_the_vocabulary(smollm2_template: ChatTemplate) -> None:
    assert smollm2_template.bos_token == "<|im_start|>"
    assert smollm2_template.eos_token == "<|im_end|>"
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert template.render(USER) == "<s>|</s>"


def test_a_model_without_template_says_how_to_pass_one() -> None:
    gemma = open_gguf(gemma3_path())
    with pytest.raises(TemplateError, match="no chat template.*override"):
        ChatTemplate.from_model_metadata(gemma)
    override = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    template = ChatTemplate.from_model_metadata(gemma, override=override)
    assert template.render(USER) == "<user>Hi"
    assert template.bos_token == "<bos>" and template.eos_token == "<eos>"


def test_transformers_environment_features() -> None:
    source = (
        "{% for m in messages %}\n"
        "  {{- m.content | tojson }}\n"
        "  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{% generation %}[{{ add_generation_prompt }}]{% endgeneration %}"
    )
    messages = [{"role": "user", "content": 'é "q"'}, {"role": "user", "content": "x"}] * 2
    rendered = ChatTemplate(source, bos_token="", eos_token="").render(messages, False)
    # trim_blocks/lstrip_blocks, unescaped non-ASCII tojson, loop controls, generation tags.
    assert rendered == '"é \\"q\\""\n"x"\n[False]'
    year = ChatTemplate("{{ strftime_now('%Y') }}", bos_token="", eos_token="").render(USER)
    assert year.isdigit() and len(year) == 4


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.__class__.__base__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set x = messages.append(1) %}",
        "{{ messages[0].update({'role': 'system'}) }}",
    ],
)
def test_sandbox_escapes_fail_with_template_error(source: str) -> None:
    with pytest.raises(TemplateError, match="sandbox"):
        ChatTemplate(source, bos_token="", eos_token="").render(USER)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{% for %}", "syntax error at line 1"),
        ("{{ raise_exception('system message required') }}", "system message required"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages[5].content.upper() }}", "render"),
        ("", "empty"),
    ],
)
def test_broken_templates_fail_with_template_error(source: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        ChatTemplate(source, bos_token="", eos_token="").render(USER)


def test_malformed_messages_are_invalid_requests(smollm2_template: ChatTemplate) -> None:
    for messages in ([], "hi", [{"content": "no role"}], [["user", "hi"]]):
        with pytest.raises(InvalidRequest) as caught:
            smollm2_template.render(messages)  # type: ignore[arg-type]
        assert caught.value.field == "messages"
