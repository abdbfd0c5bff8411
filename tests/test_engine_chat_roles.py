"""engine.chat's checks of what a chat template gets: roles no chat template knows are refused
before any work starts, and `chat_template_kwargs` reach the template (or are refused at the
door, by name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors import Engine, InvalidRequest, SamplingParams, TemplateError
from actors.model.text.chat import CHAT_ROLES

pytestmark = pytest.mark.anyio

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Writes its `greeting` variable before the messages, and refuses a chat without one.
GREETING = (
    "{% if greeting is not defined %}{{ raise_exception('pass a greeting') }}{% endif %}"
    "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
USER = [{"role": "user", "content": "hi"}]


async def test_unknown_roles_are_refused_by_name(tiny_model_paths: dict[str, Path]) -> None:
    async with Engine.open(tiny_model_paths["llama-q4k-tiny"], backend="cpu") as engine:
        with pytest.raises(InvalidRequest, match="'wizard'") as caught:
            engine.chat([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}],
                        template=CHATML)
        assert caught.value.field == "messages" and "messages[1]" in str(caught.value)
        for role in CHAT_ROLES:  # every known role renders
            chunks = engine.chat([{"role": role, "content": "hi"}], template=CHATML)
            await chunks.aclose()


async def test_chat_template_kwargs_reach_the_template(tiny_model_paths: dict[str, Path]) -> None:
    greeting = "Good morning, dear assistant, and welcome: "
    async with Engine.open(tiny_model_paths["llama-q4k-tiny"], backend="cpu") as engine:
        chunks = [chunk async for chunk in engine.chat(
            USER, SamplingParams(max_tokens=1), GREETING,
            chat_template_kwargs={"greeting": greeting})]
        expected = engine.tokenize(greeting + "hi", parse_special=True)
        with pytest.raises(TemplateError, match="refused the conversation: pass a greeting"):
            async for _ in engine.chat(USER, SamplingParams(max_tokens=1), GREETING):
                pass
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(expected)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"messages": []}, "may not set 'messages'"),
    ({"bos_token": "<s>"}, "may not set 'bos_token'"),
    ("greeting", "must be an object"),
    ({"greeting": object()}, "holds a value of type object"),
])
async def test_bad_chat_template_kwargs_are_refused_at_the_door(
        tiny_model_paths: dict[str, Path], kwargs: object, message: str) -> None:
    async with Engine.open(tiny_model_paths["llama-q4k-tiny"], backend="cpu") as engine:
        with pytest.raises(InvalidRequest, match=message) as caught:
            engine.chat(USER, template=GREETING, chat_template_kwargs=kwargs)  # type: ignore[arg-type]
    assert caught.value.field == "chat_template_kwargs"
