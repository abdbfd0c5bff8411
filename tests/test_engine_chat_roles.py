"""engine.chat refuses roles no chat template knows, before any work starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors import Engine, InvalidRequest
from actors.model.text.chat import CHAT_ROLES

pytestmark = pytest.mark.anyio

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_unknown_roles_are_refused_by_name(tiny_model_paths: dict[str, Path]) -> None:
    async with Engine.open(tiny_model_paths["llama-q4k-tiny"], backend="cpu") as engine:
        with pytest.raises(InvalidRequest, match="'wizard'") as caught:
            engine.chat([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}],
                        template=CHATML)
        assert caught.value.field == "messages" and "messages[1]" in str(caught.value)
        for role in CHAT_ROLES:  # every known role renders
            chunks = engine.chat([{"role": role, "content": "hi"}], template=CHATML)
            await chunks.aclose()
