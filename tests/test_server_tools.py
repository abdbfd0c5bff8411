"""OpenAI function tools on the server side, without a model: `tools` / `tool_choice` checked,
the call format read from a chat template, the grammar that enforces a call (compiled and run
by llguidance over the tiny model's vocabulary), the calls read out of answers whole and
streamed in every split, and chat templates given tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.errors import InvalidRequest
from actors.model.text.chat import ChatTemplate
from actors.serve.protocol import chat_generation, completion_generation, with_tool_grammar
from actors.serve.replies import ChatShape
from actors.serve.schemas import LARGEST
from actors.serve.tools import (
    MAX_TOOLS,
    MAX_TOOLS_JSON_BYTES,
    ToolCall,
    ToolCallFormat,
    tool_choice,
)

TEMPLATES = Path(__file__).parent.parent / "examples" / "chat_templates"
CHATML_TOOLS = (TEMPLATES / "chatml_tools.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
# Its parameters as pydantic writes them: a nested model is a reference into `$defs`.
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                        "required": ["x"]}}}}}


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, bos_token="", eos_token="")


HERMES = ToolCallFormat.of_template(template(CHATML_TOOLS))
LLAMA31 = ToolCallFormat.of_template(template(
    '{%- if tools %}...{{ \'{"name": "\' + tool_call.name + \'", "parameters": \' }}{% endif %}'))
NAMES = frozenset({"get_weather", "add"})


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


# --- tools and tool_choice --------------------------------------------------------------------


def test_tool_choice_modes() -> None:
    assert tool_choice(None, None) is None and tool_choice([], "none") is None
    assert tool_choice(None, "auto") is None
    auto = tool_choice([WEATHER, ADD], None)
    assert auto.mode == "auto" and not auto.enforced and auto.names == NAMES
    assert tool_choice([WEATHER], "required").enforced
    named = tool_choice([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert (named.mode, named.function, named.enforced) == ("function", "add", True)
    assert [tool["function"]["name"] for tool in named.callable_tools()] == ["add"]
    bare = tool_choice([{"type": "function", "function": {"name": "now"}}], "auto")
    assert bare.tools[0]["function"]["parameters"]["properties"] == {}


@pytest.mark.parametrize(("tools", "choice", "field"), [
    (None, "required", "tool_choice"),
    ({"type": "function"}, None, "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
])
def test_tool_refusals_name_the_field(tools: object, choice: object, field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        tool_choice(tools, choice)
    assert caught.value.field == field


def function(name: str, description: str = "") -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "description": description}}


@pytest.mark.parametrize("choice", [None, "none", "required"])
def test_more_functions_than_openai_allows_are_refused_before_any_is_read(
        choice: str | None) -> None:
    """Counted first: the last tool, malformed, is never looked at; tool_choice "none" (the
    template would not see them) is no way around it."""
    tools = [function(f"fn_{index}") for index in range(MAX_TOOLS)] + [{"type": "bogus"}]
    with pytest.raises(InvalidRequest, match=f"{MAX_TOOLS + 1} functions.*at most {MAX_TOOLS}"):
        chat_generation(body(tools=tools, tool_choice=choice), 8192)
    assert len(tool_choice(tools[:MAX_TOOLS], choice).tools) == MAX_TOOLS


def test_tools_past_their_json_size_are_refused() -> None:
    third = MAX_TOOLS_JSON_BYTES // 3
    tools = [function(name, "d" * third) for name in ("a", "b", "c", "d")]
    with pytest.raises(InvalidRequest, match=f"at most {MAX_TOOLS_JSON_BYTES:,}") as caught:
        tool_choice(tools, "auto")
    assert caught.value.field == "tools"
    assert tool_choice(tools[:2], "auto").names == {"a", "b"}


def test_a_function_declared_twice_is_named_wherever_it_is() -> None:
    tools = [function(f"f{index}") for index in range(MAX_TOOLS - 1)] + [function("f7")]
    with pytest.raises(InvalidRequest, match="'f7' twice"):
        tool_choice(tools, None)


def test_tool_choice_none_keeps_the_tools_from_the_template() -> None:
    assert chat_generation(body(tools=[WEATHER], tool_choice="none"), 8192).tools is None


def test_an_enforced_call_is_a_grammar_and_conflicts_with_another_constraint() -> None:
    generation = chat_generation(body(tools=[WEATHER, ADD], tool_choice="required"), 8192)
    assert generation.params.structured is None  # the grammar depends on the template
    enforced = with_tool_grammar(generation, HERMES)
    assert enforced.structured_field == "tools"
    assert '"get_weather"' in enforced.params.structured.grammar
    auto = chat_generation(body(tools=[WEATHER]), 8192)
    assert with_tool_grammar(auto, HERMES) is auto
    with pytest.raises(InvalidRequest) as caught:
        chat_generation(body(tools=[WEATHER], tool_choice="required",
                             response_format={"type": "json_object"}), 8192)
    assert caught.value.field == "tool_choice"


# --- structured-output fields -----------------------------------------------------------------


@pytest.mark.parametrize(("fields", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer"}, "strict": True}}}, "json_schema",
     {"type": "integer", "minimum": -LARGEST, "maximum": LARGEST}),  # bounded in length
    ({"guided_json": {"type": "string"}}, "json_schema", {"type": "string"}),
    ({"guided_json": '{"type": "string"}'}, "json_schema", {"type": "string"}),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ("yes", "no")),
    ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"'),
])
def test_structured_fields(fields: dict[str, object], kind: str, value: object) -> None:
    for generation in (chat_generation(body(**fields), 8192),
                       completion_generation(body(prompt="hi", **fields))):
        structured = generation.params.structured
        assert structured.kind == kind and getattr(structured, kind) == value
        assert generation.structured_field == next(iter(fields))
    assert chat_generation(body(response_format={"type": "text"}), 8192).params.structured is None


@pytest.mark.parametrize(("fields", "field"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_grammar": 'start: "a"'}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"guided_json": "[" * 100_000}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_structured_refusals_name_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_generation(body(**fields), 8192)
    assert caught.value.field == field
    assert field in str(caught.value)


# --- messages that carry calls ----------------------------------------------------------------


def test_a_call_and_its_result_are_fed_back() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    generation = chat_generation(body(messages=messages, tools=[WEATHER]), 8192)
    assert generation.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert generation.messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    prompt = ChatTemplate(CHATML_TOOLS, bos_token="", eos_token="").render(
        generation.messages, tools=list(generation.tools.tools))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt
    assert '"description": "The weather in a city now"' in prompt


@pytest.mark.parametrize("message", [
    {"role": "assistant", "tool_calls": {"function": {"name": "f", "arguments": "{}"}}},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
])
def test_bad_calls_in_messages_are_refused(message: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_generation(body(messages=[{"role": "user", "content": "hi"}, message]), 8192)
    assert caught.value.field.startswith("messages[1]")


def test_a_template_without_tools_refuses_them() -> None:
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", bos_token="",
                         eos_token="")
    assert not plain.renders_tools
    assert plain.render([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(InvalidRequest, match="does not render tools") as caught:
        plain.render([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert caught.value.field == "tools"
    assert ChatTemplate(CHATML_TOOLS, bos_token="", eos_token="").renders_tools


# --- the call format and the grammar ----------------------------------------------------------


def test_the_format_comes_from_the_template() -> None:
    assert (HERMES.name, HERMES.opener, HERMES.closer, HERMES.arguments_key) == \
        ("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
    assert (LLAMA31.name, LLAMA31.opener, LLAMA31.closer, LLAMA31.arguments_key) == \
        ("llama3", "", "", "parameters")


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA31], ids=["hermes", "bare"])
def test_the_grammar_accepts_a_valid_call_only(tool_format: ToolCallFormat,
                                               tiny_tokenizer: object) -> None:
    import llguidance

    from actors.params import StructuredOutput
    from actors.structured import GrammarCompiler, _grammar_text

    tokenizer = GrammarCompiler(tiny_tokenizer).grammar_tokenizer()
    grammar = _grammar_text(StructuredOutput(grammar=tool_format.grammar([WEATHER, ADD, MOVE])))
    key = tool_format.arguments_key

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ok = matcher.consume_tokens(tiny_tokenizer.encode(text, add_bos=False))
        return ok and matcher.is_accepting()

    valid = (f'{tool_format.opener}{{"name": "add", "{key}": {{"a": 1, "b": 2}}}}'
             f'{tool_format.closer}')
    assert accepts(valid)
    assert accepts(valid.replace('"add"', '"move"').replace('"a": 1, "b": 2', '"to": {"x": 1}'))
    assert not accepts(valid.replace('"add"', '"move"').replace('"a": 1, "b": 2',
                                                                '"to": {"x": "1"}'))
    assert not accepts(valid.replace('"b": 2', '"b": "two"'))
    assert not accepts(valid.replace('"add"', '"mul"'))
    assert not accepts("Sure. " + valid)
    if tool_format.closer:
        assert not accepts(valid.removesuffix(tool_format.closer))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_paths: dict[str, Path]) -> object:
    from actors.model.loaded import open_model

    return open_model(tiny_model_paths["llama-q4k-tiny"]).tokenizer


# --- reading calls out of answers -------------------------------------------------------------

CALL_TEXT = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(("tool_format", "answer", "content", "calls"), [
    (HERMES, f"<tool_call>\n{CALL_TEXT}\n</tool_call>", None, [("add", {"a": 1, "b": 2})]),
    (HERMES, f"Let me add.\n<tool_call>\n{CALL_TEXT}\n</tool_call>\n<tool_call>"
             '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
     "Let me add.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    (HERMES, "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (HERMES, '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "mul", "arguments": {}}</tool_call>', []),
    # A call ends where its JSON does: one cut before its closing tag is still a call.
    (HERMES, f"<tool_call>\n{CALL_TEXT}", None, [("add", {"a": 1, "b": 2})]),
    # Its arguments once begun are the call's, even if the call is cut before it closes...
    (HERMES, f"<tool_call>\n{CALL_TEXT[:-1]}", None, [("add", {"a": 1, "b": 2})]),
    # ...but a call cut before its name and arguments are read is text.
    (HERMES, '<tool_call>\n{"name": "add", "argu', '<tool_call>\n{"name": "add", "argu', []),
    (HERMES, "a < b, and <tool_ is no tag", "a < b, and <tool_ is no tag", []),
    (LLAMA31, ' {"name": "add", "parameters": {"a": 1, "b": 2}}', None,
     [("add", {"a": 1, "b": 2})]),
    (LLAMA31, "Not a call: {}", "Not a call: {}", []),
    (LLAMA31, '{"a": 1}', '{"a": 1}', []),
    (LLAMA31, '{"name": ["add"], "parameters": {}}', '{"name": ["add"], "parameters": {}}', []),
    (LLAMA31, '{"a": ' + "[" * 5000, '{"a": ' + "[" * 5000, []),  # past the parser's depth
])
def test_calls_are_read_whole_and_streamed_alike(
        tool_format: ToolCallFormat, answer: str, content: str | None,
        calls: list[tuple[str, dict]]) -> None:
    found_content, found = tool_format.reader(NAMES).parse(answer)
    assert found_content == content
    assert [(call.name, json.loads(call.arguments)) for call in found] == calls
    for split in range(len(answer) + 1):
        streamed = _streamed(tool_format, [answer[:split], answer[split:]])
        assert streamed["calls"] == calls
        assert streamed["content"].strip() == (content or "")


def _streamed(tool_format: ToolCallFormat, texts: list[str]) -> dict[str, object]:
    """The deltas of a streamed answer, accumulated as the openai client does."""
    shape = ChatShape(tool_format.reader(NAMES))
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for number, text in enumerate(texts):
        for piece in shape.pieces(text, final=number == len(texts) - 1):
            content += piece.get("content") or ""
            for delta in piece.get("tool_calls", ()):
                call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                call["name"] += delta["function"].get("name", "")
                call["arguments"] += delta["function"]["arguments"]
    return {"content": content,
            "calls": [(call["name"], json.loads(call["arguments"])) for call in calls.values()]}


def test_a_whole_reply_with_calls_finishes_with_tool_calls() -> None:
    choice = ChatShape(HERMES.reader(NAMES)).choice(
        f"<tool_call>\n{CALL_TEXT}\n</tool_call>", None, "stop")
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert choice["message"]["content"] is None
    # A call cut short (its arguments streamed before the cut) is the call as far as it went.
    cut = ChatShape(HERMES.reader(NAMES)).choice(f"<tool_call>\n{CALL_TEXT[:-4]}", None,
                                                  "length")
    assert cut["finish_reason"] == "length"
    assert cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b":'
    cut = ChatShape(HERMES.reader(NAMES)).choice('<tool_call>\n{"name": "ad', None, "length")
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]


def test_call_ids_differ() -> None:
    assert ToolCall("add", "{}").id != ToolCall("add", "{}").id


# --- Engine.chat with tools -------------------------------------------------------------------


@pytest.mark.anyio
async def test_engine_chat_renders_tools_and_fed_back_calls(
        tiny_model_paths: dict[str, Path]) -> None:
    from actors import Engine, SamplingParams
    from actors.engine import collect

    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    once = SamplingParams(max_tokens=1, temperature=0)
    async with Engine.open(tiny_model_paths["llama-q4k-tiny"], backend="cpu") as engine:
        answer = await collect(engine.chat(messages, once, CHATML_TOOLS, tools=[WEATHER, ADD]))
        with_tools = answer.usage.prompt_tokens
        answer = await collect(engine.chat(messages, once, CHATML_TOOLS))
        assert answer.usage.prompt_tokens < with_tools  # the tools are in the prompt
        with pytest.raises(InvalidRequest, match="does not render tools") as caught:
            await collect(engine.chat(messages, once, "{{ messages[0].content }}",
                                      tools=[WEATHER]))
        assert caught.value.field == "tools"
        with pytest.raises(InvalidRequest) as caught:
            engine.chat(messages, once, CHATML_TOOLS, tools="add")
        assert caught.value.field == "tools"
        with pytest.raises(InvalidRequest, match="only an assistant message has tool calls"):
            engine.chat([{"role": "user", "content": "hi", "tool_calls": [call]}], once,
                        CHATML_TOOLS)


# --- a reply's events, as the openai client accumulates them -----------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("tool_format", [HERMES, LLAMA31], ids=["hermes", "bare"])
async def test_an_auto_answer_streams_as_the_client_accumulates_it(
        tool_format: ToolCallFormat) -> None:
    """Text, then two calls, token by token: the client's own stream state rebuilds the same
    message as the whole reply."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from actors.messages import Chunk, Usage
    from actors.serve.replies import Reply

    key = tool_format.arguments_key
    calls = [f'{{"name": "add", "{key}": {{"a": 1, "b": 2}}}}',
             f'{{"name": "get_weather", "{key}": {{"city": "Rome"}}}}']
    if not tool_format.leading:
        answer = "Let me check.\n" + "\n".join(f"<tool_call>\n{call}\n</tool_call>"
                                               for call in calls)
        expected_calls, expected_content = calls, "Let me check."
    else:
        answer, expected_calls, expected_content = calls[0], calls[:1], None
    tokens = [answer[start:start + 3] for start in range(0, len(answer), 3)]

    async def chunks():
        for number, text in enumerate(tokens):
            last = number == len(tokens) - 1
            yield Chunk(text=text, token_id=number, finish_reason="stop" if last else None,
                        usage=Usage(prompt_tokens=1, completion_tokens=len(tokens),
                                    cached_tokens=0) if last else None)

    def reply() -> Reply:
        return Reply([ChatShape(tool_format.reader(NAMES))], model="m", fingerprint="fp_test",
                     want_logprobs=False, include_usage=False, token_text=str,
                     count=lambda *_: None)

    whole = (await reply().whole(chunks()))["choices"][0]
    state = ChatCompletionStreamState()
    stream = chunks()
    streamed = reply()
    async for event in streamed.events(await streamed.first(stream), stream):
        if event.startswith(b"data: {"):
            state.handle_chunk(ChatCompletionChunk.model_validate_json(event[6:]))
    (accumulated,) = state.get_final_completion().choices
    assert accumulated.finish_reason == whole["finish_reason"] == "tool_calls"
    content = (accumulated.message.content or "").strip() or None
    assert content == whole["message"]["content"] == expected_content
    for got, sent, expected in zip(accumulated.message.tool_calls,
                                   whole["message"]["tool_calls"], expected_calls, strict=True):
        assert got.function.name == sent["function"]["name"] == json.loads(expected)["name"]
        assert json.loads(got.function.arguments) == json.loads(sent["function"]["arguments"]) \
            == json.loads(expected)[key]
        assert got.id.startswith("call_")
