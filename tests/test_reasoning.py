"""Reasoning kept apart (actors.reasoning): a thinking model's reasoning comes as the chunks'
`reasoning` and the server's `reasoning_content`, never in the text; its markers in neither.

The model is scripted: the fake backend over the tiny Qwen3's vocabulary with two of its
tokens made `<think>` and `</think>` (user-defined tokens, as in Qwen3's files), answering
through Qwen3's own chat template. After the assistant header it opens its reasoning, writes
it, closes it and answers; once its reasoning is closed (by itself, by the template or by a
forced end marker) it writes its answer. So each test knows exactly what the model wrote, and
what the engine made of it: split whole and streamed, with the template opening or closing
the reasoning (`enable_thinking: false`), a budget forcing the end marker, and a JSON schema
that holds from the end marker on while the reasoning stays free.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest

from actors import InvalidRequest
from actors.engine import Engine, collect
from actors.messages import Chunk
from actors.model.gguf.reader import open_gguf
from actors.model.text.chat import ChatTemplate
from actors.model.text.tokenizer import Tokenizer
from actors.model.text.vocab import read_vocab
from actors.params import SamplingParams, StructuredOutput
from actors.reasoning import (
    ANSWER,
    OPTIONAL,
    REASONING,
    ReasoningMarkers,
    opening_phase,
    reasoning_markers,
)
from actors.serve.app import ServerOptions
from tests.conftest import TINY_MODELS
from tests.test_engine_fake import CountingBackend
from tests.test_server_fake import MODEL, serving, until_ready

pytestmark = pytest.mark.anyio

# The tiny Qwen3's tokens that become the markers ('void' and 'ervice' before).
THINK, END_THINK = 1004, 1017
USER_DEFINED = 4
REASONING_TEXT = "Let me think about it."
ANSWER_TEXT = "The sky is blue."
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
DIGIT = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
         "required": ["answer"], "additionalProperties": False}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@functools.cache
def qwen3_metadata() -> dict[str, Any]:
    with open_gguf(TINY_MODELS["qwen3-q4k-tiny"]) as gguf:
        return dict(gguf.metadata)


@functools.cache
def thinking_tokenizer() -> Tokenizer:
    """The tiny Qwen3's tokenizer with `<think>` and `</think>` tokens (and without the
    merges that made the texts they replace)."""
    metadata = dict(qwen3_metadata())
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = np.array(metadata["tokenizer.ggml.token_type"])
    replaced = {tokens[THINK], tokens[END_THINK]}
    tokens[THINK], tokens[END_THINK] = "<think>", "</think>"
    types[[THINK, END_THINK]] = USER_DEFINED
    metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"] = tokens, types
    metadata["tokenizer.ggml.merges"] = [
        merge for merge in metadata["tokenizer.ggml.merges"]
        if merge.replace(" ", "") not in replaced and not replaced & set(merge.split(" "))]
    return Tokenizer(read_vocab(metadata))


QWEN3_TEMPLATE = qwen3_metadata()["tokenizer.chat_template"]
# As DeepSeek-R1 distills' and newer Qwen3 templates: the generation prompt opens the reasoning.
_HEAD, _GENERATION, _TAIL = QWEN3_TEMPLATE.rpartition("'<|im_start|>assistant\\n'")
OPEN_TEMPLATE = _HEAD + "'<|im_start|>assistant\\n<think>\\n'" + _TAIL
# A template that names no reasoning markers.
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{{ '<|im_start|>assistant\\n' }}")


class Thinker:
    """The scripted model: after the last assistant header it opens its reasoning, writes
    `reasoning`, closes it, then writes `answer` (after a blank line) and ends its turn; once
    its reasoning is closed, whoever closed it, it goes on with its answer. `opens`: False, it
    answers at once (where the prompt left its reasoning unopened)."""

    def __init__(self, reasoning: str = REASONING_TEXT, answer: str = ANSWER_TEXT,
                 opens: bool = True) -> None:
        tokenizer = thinking_tokenizer()
        self.header = tokenizer.encode("<|im_start|>assistant\n", add_bos=False,
                                       parse_special=True)
        # As Qwen3 writes it: `<think>` and a line break (the opened template writes both).
        self.reasoning = tokenizer.encode("\n" + reasoning, add_bos=False)
        self.answer = [*tokenizer.encode("\n\n" + answer, add_bos=False), tokenizer.eos_id]
        self.opens = opens

    def __call__(self, seen: np.ndarray) -> int:
        tokens = seen.tolist()
        width = len(self.header)
        start = max(at for at in range(len(tokens) - width + 1)
                    if tokens[at:at + width] == self.header)
        written = tokens[start + width:]
        if END_THINK in written:
            after = len(written) - written.index(END_THINK) - 1
            return self.answer[min(after, len(self.answer) - 1)]
        if THINK not in written:
            # Answering at once: the answer without its blank line.
            return THINK if self.opens else self.answer[min(len(written) + 1,
                                                            len(self.answer) - 1)]
        thought = len(written) - written.index(THINK) - 1
        return self.reasoning[thought] if thought < len(self.reasoning) else END_THINK


def chat_template(source: str | None) -> ChatTemplate:
    return ChatTemplate(source or QWEN3_TEMPLATE, bos_token="", eos_token="<|im_end|>")


def open_thinker(model: Thinker | None = None):
    backend = CountingBackend(vocab_size=thinking_tokenizer().vocab_size,
                              model=model or Thinker(), context_length=1024, num_blocks=1024)
    return Engine.open_backend(lambda: backend, thinking_tokenizer(), chat_template=chat_template)


def text_of(ids: Sequence[int]) -> str:
    return thinking_tokenizer().decode(ids)


def reasoning_written(template: str | None) -> list[int]:
    """The reasoning tokens the model writes itself: after the line break the opened template
    writes for it."""
    reasoning = Thinker().reasoning
    return reasoning if template is None else reasoning[1:]


def reasoning_tokens(template: str | None) -> int:
    """The answer's tokens of reasoning: those written, with the markers the model wrote."""
    return len(reasoning_written(template)) + (2 if template is None else 1)


# --- the rule: markers and where the answer begins --------------------------------------------


def test_markers_come_from_the_template_and_one_token_each() -> None:
    tokenizer = thinking_tokenizer()

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False, parse_special=True)

    assert reasoning_markers(QWEN3_TEMPLATE, tokenize) == ReasoningMarkers(THINK, END_THINK)
    # A template that never names them, or a vocabulary that spells them in pieces: none.
    assert reasoning_markers(PLAIN_TEMPLATE, tokenize) is None
    assert reasoning_markers(QWEN3_TEMPLATE, Tokenizer(read_vocab(qwen3_metadata())).encode) \
        is None
    # Magistral's pair, where the vocabulary has them as tokens.
    ministral = json.loads((TINY_MODELS["qwen3-q4k-tiny"].parents[1] / "chat-templates" /
                            "mistralai-Ministral-3-14B-Reasoning-2512.json").read_text())
    ids = {"[THINK]": [34], "[/THINK]": [35]}
    assert reasoning_markers(ministral["template"], lambda text: ids.get(text, [1, 2])) == \
        ReasoningMarkers(34, 35)


def test_where_the_answer_begins_follows_the_prompt() -> None:
    tokenizer = thinking_tokenizer()
    markers = ReasoningMarkers(THINK, END_THINK)

    def opening(template: str, **kwargs: Any) -> str:
        prompt = chat_template(template).render(ASK, chat_template_kwargs=kwargs)
        ids = tokenizer.encode(prompt, add_bos=False, parse_special=True)
        return opening_phase(markers, ids, tokenizer.decode)

    assert opening(QWEN3_TEMPLATE) == OPTIONAL
    assert opening(OPEN_TEMPLATE) == REASONING
    assert opening(QWEN3_TEMPLATE, enable_thinking=False) == ANSWER
    # Reasoning closed in an earlier turn, then more conversation: the answer may open its own.
    history = [*ASK, {"role": "assistant", "content": "<think>\nHm.\n</think>\n\nBlue."},
               *ASK]
    ids = tokenizer.encode(chat_template(None).render(history), add_bos=False,
                           parse_special=True)
    assert opening_phase(markers, ids, tokenizer.decode) == OPTIONAL


# --- the library: Chunk.reasoning, Completion.reasoning ----------------------------------------


async def streamed(engine: Engine, **chat: Any) -> list[Chunk]:
    return [chunk async for chunk in engine.chat(ASK, **{"params": GREEDY, **chat})]


@pytest.mark.parametrize("template", [None, OPEN_TEMPLATE], ids=["optional", "opened"])
async def test_reasoning_is_kept_out_of_the_text(template: str | None) -> None:
    async with open_thinker() as engine:
        whole = await collect(engine.chat(ASK, GREEDY, template))
        chunks = await streamed(engine, template=template)
    assert whole.reasoning == REASONING_TEXT
    assert whole.text == ANSWER_TEXT
    assert whole.finish_reason == "stop"
    # Every token counts; those of the reasoning, its markers included, are counted apart.
    assert whole.usage.reasoning_tokens == reasoning_tokens(template)
    # The answer's tokens: its blank line, its text, not the end of turn.
    assert whole.usage.completion_tokens == reasoning_tokens(template) + len(Thinker().answer) - 1
    # Streamed: the reasoning first, then the text, each whole; no chunk has both.
    assert "".join(chunk.reasoning for chunk in chunks) == REASONING_TEXT
    assert "".join(chunk.text for chunk in chunks) == ANSWER_TEXT
    last_thought = max(i for i, chunk in enumerate(chunks) if chunk.reasoning)
    first_text = min(i for i, chunk in enumerate(chunks) if chunk.text)
    assert last_thought < first_text
    assert not any(chunk.reasoning and chunk.text for chunk in chunks)


async def test_an_answer_that_does_not_open_its_reasoning_is_all_text() -> None:
    schema = SamplingParams(max_tokens=64, temperature=0.0,
                            structured=StructuredOutput(json_schema=DIGIT))
    async with open_thinker(Thinker(opens=False)) as engine:
        whole = await collect(engine.chat(ASK, GREEDY))
        budgeted = await collect(engine.chat(ASK, GREEDY, reasoning_budget=2))
        constrained = await collect(engine.chat(ASK, schema))
    assert (whole.reasoning, whole.text) == ("", ANSWER_TEXT)
    assert (budgeted.reasoning, budgeted.text) == ("", ANSWER_TEXT)
    assert constrained.reasoning == ""
    jsonschema.validate(json.loads(constrained.text), DIGIT)


async def test_with_thinking_disabled_the_answer_is_all_text() -> None:
    async with open_thinker() as engine:
        whole = await collect(engine.chat(ASK, GREEDY,
                                          chat_template_kwargs={"enable_thinking": False}))
    assert (whole.reasoning, whole.text) == ("", ANSWER_TEXT)
    assert whole.usage.reasoning_tokens == 0


async def test_without_markers_nothing_is_kept_apart() -> None:
    async with open_thinker() as engine:
        whole = await collect(engine.chat(ASK, GREEDY, PLAIN_TEMPLATE))
        with pytest.raises(InvalidRequest) as refused:
            await collect(engine.chat(ASK, GREEDY, PLAIN_TEMPLATE, reasoning_budget=4))
        with pytest.raises(InvalidRequest) as negative:
            engine.chat(ASK, GREEDY, reasoning_budget=-1)
    assert whole.reasoning == ""
    assert whole.text == f"<think>\n{REASONING_TEXT}</think>\n\n{ANSWER_TEXT}"
    assert refused.value.field == negative.value.field == "reasoning_budget"


@pytest.mark.parametrize("template", [None, OPEN_TEMPLATE], ids=["optional", "opened"])
@pytest.mark.parametrize("budget", [0, 3])
async def test_a_budget_forces_the_end_marker(template: str | None, budget: int) -> None:
    async with open_thinker() as engine:
        whole = await collect(engine.chat(ASK, GREEDY, template, reasoning_budget=budget))
    written = reasoning_written(template)[:budget]
    assert whole.reasoning == text_of(written).strip()
    assert whole.text == ANSWER_TEXT
    # The forced end marker is among the tokens; the model's own never came.
    opened = [THINK] if template is None else []
    assert list(whole.token_ids[:len(opened) + budget + 1]) == [*opened, *written, END_THINK]


@pytest.mark.parametrize("template", [None, OPEN_TEMPLATE], ids=["optional", "opened"])
async def test_a_schema_holds_from_the_end_marker_on(template: str | None) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0,
                            structured=StructuredOutput(json_schema=DIGIT))
    async with open_thinker() as engine:
        whole = await collect(engine.chat(ASK, params, template))
        budgeted = await collect(engine.chat(ASK, params, template, reasoning_budget=3))
    # The reasoning is the model's own, free; the answer matches the schema (the model itself
    # would have written prose).
    assert whole.reasoning == REASONING_TEXT
    jsonschema.validate(json.loads(whole.text), DIGIT)
    assert budgeted.reasoning == text_of(reasoning_written(template)[:3]).strip()
    jsonschema.validate(json.loads(budgeted.text), DIGIT)


# --- the server: message.reasoning_content and delta.reasoning_content -------------------------


@asynccontextmanager
async def thinking_server(template: str | None = None) -> AsyncIterator[openai.AsyncOpenAI]:
    async with serving(open_thinker, ServerOptions(chat_template=template)) as http:
        await until_ready(http)
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                      max_retries=0) as client:
            yield client


async def chat(client: openai.AsyncOpenAI, **request: Any) -> Any:
    return await client.chat.completions.create(
        model=MODEL, messages=ASK, **{"temperature": 0, "max_tokens": 64, **request})


async def streamed_deltas(client: openai.AsyncOpenAI, **request: Any) -> list[tuple[str, str]]:
    """The stream's deltas as (field, text): reasoning_content or content."""
    deltas = []
    async for chunk in await chat(client, stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            deltas += [(field, delta[field]) for field in ("reasoning_content", "content")
                       if delta.get(field)]
    return deltas


@pytest.mark.parametrize("template", [None, OPEN_TEMPLATE], ids=["optional", "opened"])
async def test_the_server_splits_reasoning_whole_and_streamed(template: str | None) -> None:
    async with thinking_server(template) as client:
        whole = await chat(client)
        deltas = await streamed_deltas(client)
    message = whole.choices[0].message
    assert message.reasoning_content == REASONING_TEXT
    assert message.content == ANSWER_TEXT
    assert whole.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens(template)
    fields = [field for field, _ in deltas]
    assert fields == sorted(fields, reverse=True)  # all reasoning_content, then content
    assert "".join(text for field, text in deltas if field == "reasoning_content") == \
        REASONING_TEXT
    assert "".join(text for field, text in deltas if field == "content") == ANSWER_TEXT


async def test_the_server_answers_a_schema_after_free_reasoning() -> None:
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "digit", "schema": DIGIT, "strict": True}}
    async with thinking_server() as client:
        whole = await chat(client, response_format=response_format)
        deltas = await streamed_deltas(client, response_format=response_format)
    message = whole.choices[0].message
    assert message.reasoning_content == REASONING_TEXT
    jsonschema.validate(json.loads(message.content), DIGIT)
    assert "".join(text for field, text in deltas if field == "content") == message.content


async def test_the_server_forces_the_end_at_the_reasoning_budget() -> None:
    async with thinking_server() as client:
        whole = await chat(client, extra_body={"reasoning_budget": 3})
        with pytest.raises(openai.BadRequestError) as refused:
            await chat(client, extra_body={"reasoning_budget": -2})
    message = whole.choices[0].message
    assert message.reasoning_content == text_of(Thinker().reasoning[:3]).strip()
    assert message.reasoning_content != REASONING_TEXT
    assert message.content == ANSWER_TEXT
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3 + 2
    assert refused.value.response.json()["error"]["param"] == "reasoning_budget"


async def test_the_server_with_thinking_disabled_answers_all_content() -> None:
    async with thinking_server() as client:
        whole = await chat(client, extra_body={"chat_template_kwargs":
                                               {"enable_thinking": False}})
        deltas = await streamed_deltas(client, extra_body={"chat_template_kwargs":
                                                           {"enable_thinking": False}})
    message = whole.choices[0].message
    assert message.content == ANSWER_TEXT
    assert getattr(message, "reasoning_content", None) is None
    assert {field for field, _ in deltas} == {"content"}
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0


UNIT = {"type": "function", "function": {
    "name": "unit", "description": "Pick a unit",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}},
                   "required": ["unit"], "additionalProperties": False}}}
# Reasoning that holds what would read as a call in the answer.
CALL_IN_REASONING = ('Maybe <tool_call>\n{"name": "unit", "arguments": {"unit": "C"}}\n'
                     '</tool_call> would do.')


async def test_tool_calls_are_read_and_enforced_after_the_reasoning() -> None:
    async with serving(lambda: open_thinker(Thinker(reasoning=CALL_IN_REASONING))) as http:
        await until_ready(http)
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                      max_retries=0) as client:
            auto = await chat(client, tools=[UNIT], max_tokens=200)
            required = await chat(client, tools=[UNIT], tool_choice="required", max_tokens=200)
    # "auto": the call in the reasoning is reasoning, the prose answer is content.
    message = auto.choices[0].message
    assert message.reasoning_content == CALL_IN_REASONING
    assert message.content == ANSWER_TEXT and message.tool_calls is None
    # "required": the reasoning is free, the answer after it is the call.
    message = required.choices[0].message
    assert message.reasoning_content == CALL_IN_REASONING
    (call,) = message.tool_calls
    assert call.function.name == "unit"
    assert json.loads(call.function.arguments)["unit"] in ("C", "F")
    assert required.choices[0].finish_reason == "tool_calls"
