"""Tool calls in every format a chat template teaches (Hermes / Qwen3 tags, Llama 3.x JSON,
Mistral Nemo's `[TOOL_CALLS][...]`, Mistral's `[TOOL_CALLS]name[ARGS]{...}`) and the generic
format for templates that render no tools.

- The format each real template in tests/reference/chat-templates writes, and that the call
  it writes back reads as that call.
- Calls whose arguments hold the other formats' markers, closing tags, `{"name":`, escaped
  quotes, braces and unicode: read whole and streamed in every split, accepted by the grammar
  that enforces them, and served (official `openai` client, whole and streamed) by the app
  over a fake engine that answers a set text through the real template: the call comes back
  as a call, its arguments as the model wrote them, streamed in pieces.
- `parallel_tool_calls`: several calls enforced and read, or exactly one.
- The tiny llama with a template that renders no tools, end to end: a call through the
  generic format (required, named, one or several), text with "auto".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import openai
import pytest

from actors.engine import Engine
from actors.messages import Chunk, Usage
from actors.model.text.chat import ChatTemplate
from actors.params import SamplingParams, StructuredOutput
from actors.serve.app import ServerOptions
from actors.serve.replies import ChatShape
from actors.serve.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_NEMO,
    CallArguments,
    CallStart,
    ToolCallFormat,
    tool_choice,
)
from tests.test_engine_fake import CountingBackend, open_fake
from tests.test_server_fake import MODEL, serving, until_ready

REFERENCE = Path(__file__).parent / "reference" / "chat-templates"
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Arguments that hold every format's markers, a call's own opening, escapes and unicode.
TRICKY = {
    "code": 'print("</tool_call>")\nx = {"name": "run", "arguments": {}}  # ]} [TOOL_CALLS]',
    "more": '[ARGS]{"a": 1} [CALL_ID]x <|python_tag|> <tool_call> {"tool_calls": [',
    "quoted": 'say \\"hi\\" \\\\ and \\" then }]}',
    "unicode": "naïve café 😀 — \u2028 ﬁ {[(",
}
RUN = {"type": "function", "function": {
    "name": "run", "description": "Run some code",
    "parameters": {"type": "object",
                   "properties": {key: {"type": "string"} for key in TRICKY},
                   "required": list(TRICKY)}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}
TOOLS = [RUN, ADD]
NAMES = frozenset({"run", "add"})
SUM = {"a": 1, "b": 2}


def arguments_json(arguments: dict[str, Any], ascii_only: bool = False) -> str:
    # As the grammar lays JSON out; models write unicode as it is, or escaped.
    return json.dumps(arguments, ensure_ascii=ascii_only)


def answer_in(tool_format: ToolCallFormat, calls: list[tuple[str, str]]) -> str:
    """An answer that makes `calls` ((name, arguments JSON)), as each model writes them (and
    each enforcing grammar does)."""
    if tool_format is HERMES:
        return "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n'
                         "</tool_call>" for name, arguments in calls)
    if tool_format is LLAMA3:
        ((name, arguments),) = calls
        return f'{{"name": "{name}", "parameters": {arguments}}}'
    if tool_format is MISTRAL:
        return "".join(f"[TOOL_CALLS]{name}[ARGS]{arguments}" for name, arguments in calls)
    listed = ", ".join(f'{{"name": "{name}", "arguments": {arguments}}}'
                       for name, arguments in calls)
    return f"[TOOL_CALLS][{listed}]" if tool_format is MISTRAL_NEMO else \
        f'{{"tool_calls": [{listed}]}}'


FORMATS = {"hermes": HERMES, "llama3": LLAMA3, "mistral-nemo": MISTRAL_NEMO,
           "mistral": MISTRAL, "generic": GENERIC}


def calls_for(tool_format: ToolCallFormat, ascii_only: bool = False) -> list[tuple[str, str]]:
    """The adversarial call, and a second one where the format holds several."""
    calls = [("run", arguments_json(TRICKY, ascii_only))]
    return calls if tool_format.single else [*calls, ("add", arguments_json(SUM))]


# --- the formats of real templates ------------------------------------------------------------

EXPECTED_FORMATS = {
    "Qwen-Qwen3-0.6B": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral-nemo",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "unsloth-mistral-Devstral-Small-2507": "mistral",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
    "google-gemma-3-it": "generic",
    "microsoft-Phi-3.5-mini-instruct": "generic",
}
# Where a turn ends in these templates (the model stops at it; the reader never sees it).
TURN_ENDS = ("</s>", "<|eot_id|>", "<|im_end|>")


def reference(name: str) -> tuple[ChatTemplate, dict[str, Any]]:
    data = json.loads((REFERENCE / f"{name}.json").read_text())
    return ChatTemplate(data["template"], bos_token=data["bos_token"],
                        eos_token=data["eos_token"]), data


def until_turn_end(text: str) -> str:
    ends = [at for at in (text.find(end) for end in TURN_ENDS) if at >= 0]
    return text[:min(ends, default=len(text))]


@pytest.mark.parametrize("name", EXPECTED_FORMATS)
def test_each_real_template_has_its_format(name: str) -> None:
    template, _ = reference(name)
    assert ToolCallFormat.of_template(template).name == EXPECTED_FORMATS[name]


@pytest.mark.parametrize("name", [name for name, kind in EXPECTED_FORMATS.items()
                                  if kind != "generic"])
def test_the_call_a_template_writes_back_reads_as_that_call(name: str) -> None:
    """The assistant turn the template renders for a call (what its model learnt to write)
    is read back as the same call, whole and streamed."""
    template, data = reference(name)
    case = next(case for case in data["cases"]
                if any(message.get("tool_calls") for message in case["messages"]))
    turn = next(index for index, message in enumerate(case["messages"])
                if message.get("tool_calls"))
    before = template.render(case["messages"][:turn], tools=case["tools"])
    through = template.render(case["messages"][:turn + 1], add_generation_prompt=False,
                              tools=case["tools"])
    assert through.startswith(before)
    answer = until_turn_end(through[len(before):])
    (sent,) = case["messages"][turn]["tool_calls"]
    tool_format = ToolCallFormat.of_template(template)
    expected = [(sent["function"]["name"], sent["function"]["arguments"])]
    _, calls = tool_format.reader(frozenset({"get_weather"})).parse(answer)
    assert [(call.name, json.loads(call.arguments)) for call in calls] == expected
    assert read_streamed(tool_format, split_every(answer, 1), frozenset({"get_weather"}))[1] \
        == expected


# --- reading adversarial calls ----------------------------------------------------------------


def split_every(text: str, size: int) -> list[str]:
    return [text[start:start + size] for start in range(0, len(text), size)]


def read_streamed(tool_format: ToolCallFormat, texts: list[str], names: frozenset[str] = NAMES,
                  parallel: bool = True) -> tuple[str, list[tuple[str, Any]], list[int]]:
    """(the content, the calls with their arguments read, how many pieces each call's
    arguments came in) from an answer streamed as `texts`."""
    reader = tool_format.reader(names, parallel)
    pieces = [piece for text in texts for piece in reader.feed_pieces(text)]
    pieces += reader.end_pieces()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    calls: list[list[Any]] = []
    for piece in pieces:
        if isinstance(piece, CallStart):
            calls.append([piece.name, []])
        elif isinstance(piece, CallArguments):
            calls[-1][1].append(piece.text)
    return (content, [(name, json.loads("".join(texts))) for name, texts in calls],
            [len(texts) for _, texts in calls])


@pytest.mark.parametrize("ascii_only", [False, True], ids=["unicode", "escaped"])
@pytest.mark.parametrize("name", FORMATS)
def test_markers_inside_arguments_never_cut_a_call(name: str, ascii_only: bool) -> None:
    tool_format = FORMATS[name]
    calls = calls_for(tool_format, ascii_only)
    answer = answer_in(tool_format, calls)
    expected = [(call_name, json.loads(arguments)) for call_name, arguments in calls]
    content, found = tool_format.reader(NAMES).parse(answer)
    assert content is None
    assert [(call.name, json.loads(call.arguments)) for call in found] == expected
    assert [call.arguments for call in found] == [arguments for _, arguments in calls]
    for split in range(len(answer) + 1):
        assert read_streamed(tool_format, [answer[:split], answer[split:]])[:2] == ("", expected)
    streamed, found_streamed, pieces = read_streamed(tool_format, split_every(answer, 3))
    assert (streamed, found_streamed) == ("", expected)
    assert pieces[0] > 10  # the arguments stream as they come


@pytest.mark.parametrize("name", ["hermes", "mistral-nemo", "mistral"])
def test_text_around_calls_stays_text_in_auto(name: str) -> None:
    """Formats whose calls may follow text: text before, between and after is content, and
    a marker in the text that opens no call is text too."""
    tool_format = FORMATS[name]
    call = answer_in(tool_format, [("add", arguments_json(SUM))])
    marker = tool_format.opener.strip()
    answer = f"Let me see: {marker} is how I call. {call} Done."
    for texts in ([answer], split_every(answer, 1), split_every(answer, 4)):
        content, found, _ = read_streamed(tool_format, texts)
        assert found == [("add", SUM)]
        assert content == f"Let me see: {marker} is how I call. Done."


@pytest.mark.parametrize("name", ["llama3", "generic"])
def test_a_leading_format_reads_calls_only_at_the_start(name: str) -> None:
    tool_format = FORMATS[name]
    call = answer_in(tool_format, [("add", arguments_json(SUM))])
    assert tool_format.reader(NAMES).parse("Sure: " + call) == ("Sure: " + call, [])
    lead = "<|python_tag|>" if tool_format is LLAMA3 else ""
    content, calls = tool_format.reader(NAMES).parse(f" \n{lead}{call}")
    assert content is None and [call.name for call in calls] == ["add"]


def test_a_call_to_an_unknown_function_or_with_broken_json_is_text() -> None:
    for answer in ('{"tool_calls": [{"name": "rm", "arguments": {}}]}',
                   '{"tool_calls": [{"name": "add", "arguments": 3}]}',
                   '{"tool_calls": [{"nam": "add"}]}'):
        assert GENERIC.reader(NAMES).parse(answer) == (answer, [])
    answer = "[TOOL_CALLS]rm[ARGS]{}"
    assert MISTRAL.reader(NAMES).parse(answer) == (answer, [])


@pytest.mark.parametrize("name", ["hermes", "mistral-nemo", "mistral", "generic"])
def test_without_parallel_calls_one_call_is_read(name: str) -> None:
    tool_format = FORMATS[name]
    answer = answer_in(tool_format, calls_for(tool_format))
    content, calls = tool_format.reader(NAMES, parallel=False).parse(answer)
    assert [call.name for call in calls] == ["run"]
    assert content  # what follows the one call is text
    assert len(tool_format.reader(NAMES).parse(answer)[1]) == 2


# --- the grammar that enforces calls ----------------------------------------------------------


@pytest.fixture(scope="module")
def grammar_tokenizer(tiny_model_paths: dict[str, Path]) -> tuple[Any, Any]:
    from actors.model.loaded import open_model
    from actors.structured import GrammarCompiler

    tokenizer = open_model(tiny_model_paths["llama-q4k-tiny"]).tokenizer
    return tokenizer, GrammarCompiler(tokenizer).grammar_tokenizer()


def accepts(grammar_tokenizer: tuple[Any, Any], grammar: str, text: str) -> bool:
    import llguidance

    from actors.structured import _grammar_text

    tokenizer, compiled = grammar_tokenizer
    matcher = llguidance.LLMatcher(compiled, _grammar_text(StructuredOutput(grammar=grammar)),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_bos=False)) and \
        matcher.is_accepting()


@pytest.mark.parametrize("name", FORMATS)
def test_the_grammar_enforces_exactly_the_calls(name: str,
                                                grammar_tokenizer: tuple[Any, Any]) -> None:
    tool_format = FORMATS[name]
    calls = calls_for(tool_format)
    several = tool_format.grammar(TOOLS, parallel=True)
    one = tool_format.grammar(TOOLS, parallel=False)
    answer = answer_in(tool_format, calls)
    assert accepts(grammar_tokenizer, several, answer)
    assert accepts(grammar_tokenizer, one, answer_in(tool_format, calls[:1]))
    if not tool_format.single:
        assert not accepts(grammar_tokenizer, one, answer)
    wrong = json.dumps({**TRICKY, "code": 3}, ensure_ascii=False)
    assert not accepts(grammar_tokenizer, several, answer_in(tool_format, [("run", wrong)]))
    assert not accepts(grammar_tokenizer, several, answer_in(tool_format, [("rm", "{}")]))
    assert not accepts(grammar_tokenizer, several, "Sure. " + answer)


def test_the_generic_auto_grammar_takes_a_call_or_text(
        grammar_tokenizer: tuple[Any, Any]) -> None:
    choice = tool_choice(TOOLS, "auto")
    grammar = GENERIC.constraint(choice).grammar
    assert accepts(grammar_tokenizer, grammar, answer_in(GENERIC, calls_for(GENERIC)))
    assert accepts(grammar_tokenizer, grammar, "The answer is {42}.\nThanks")
    assert accepts(grammar_tokenizer, grammar, "")
    assert not accepts(grammar_tokenizer, grammar, '{"answer": 42}')
    assert not accepts(grammar_tokenizer, grammar, '  {"tool_calls": []}')
    # Formats whose templates render tools leave "auto" free.
    assert HERMES.constraint(choice) is None
    assert HERMES.constraint(tool_choice(TOOLS, "required")) is not None


def test_a_marker_that_is_a_special_token_is_enforced_as_that_token(
        grammar_tokenizer: tuple[Any, Any]) -> None:
    """Over the tiny llama's real vocabulary, a Hermes-like format whose markers are two of
    its special tokens: llguidance never matches a special token to literal text, so only
    the grammar of the format bound to the vocabulary takes the tokens the model would write."""
    import llguidance

    from actors.structured import _grammar_text

    tokenizer, compiled = grammar_tokenizer
    tagged = msgspec.structs.replace(HERMES, opener="<filename>\n", closer="\n<file_sep>",
                                     markers=("<filename>", "<file_sep>"))
    bound = tagged.with_vocabulary(
        lambda text, special: tokenizer.encode(text, add_bos=False, parse_special=special),
        tokenizer.decode)
    (opener,) = tokenizer.encode("<filename>", add_bos=False, parse_special=True)
    (closer,) = tokenizer.encode("<file_sep>", add_bos=False, parse_special=True)
    assert bound.special_tokens == {"<filename>": opener, "<file_sep>": closer}
    call = tokenizer.encode('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', add_bos=False)

    def takes(tool_format: ToolCallFormat) -> bool:
        grammar = _grammar_text(StructuredOutput(grammar=tool_format.grammar([ADD])))
        matcher = llguidance.LLMatcher(compiled, grammar, log_level=0)
        return matcher.consume_tokens([opener, *call, closer]) and matcher.is_accepting()

    assert takes(bound) and not takes(tagged)


def test_markers_that_are_special_tokens_are_written_and_read_as_those_tokens() -> None:
    """A model whose vocabulary has `[TOOL_CALLS]` and `[ARGS]` as control tokens (decoded as
    nothing): the grammar writes the tokens, and the reader gets their text back from the
    tokens' ids."""
    special = {"[TOOL_CALLS]": 7, "[ARGS]": 8}

    def tokenize(text: str, parse_special: bool) -> list[int]:
        if parse_special and text in special:
            return [special[text]]
        return [ord(char) for char in text]

    def detokenize(ids: list[int]) -> str:
        return "".join("" if token in special.values() else chr(token) for token in ids)

    tool_format = MISTRAL.with_vocabulary(tokenize, detokenize)
    assert tool_format.special_tokens == special
    grammar = tool_format.grammar([ADD])
    assert '"add" <[8]> %json' in grammar and "block: <[7]> call" in grammar
    assert "TOOL_CALLS" not in grammar and "ARGS" not in grammar
    # The answer as chunks: each control token's chunk has no text of its own.
    chunks = [Chunk(text="", token_id=7), Chunk(text="add", token_id=100),
              Chunk(text="", token_id=8), Chunk(text='{"a": 1, ', token_id=101),
              Chunk(text='"b": 2}', token_id=102)]
    shape = ChatShape(tool_format.reader(NAMES))
    deltas = [delta for number, chunk in enumerate(chunks)
              for delta in shape.pieces(shape.text(chunk), final=number == len(chunks) - 1)]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "add"
    assert json.loads("".join(delta["tool_calls"][0]["function"]["arguments"]
                              for delta in deltas)) == SUM
    assert not any(delta.get("content") for delta in deltas)


# --- the generic format's prompt --------------------------------------------------------------


def test_the_generic_prompt_describes_the_tools_and_keeps_roles_alternating() -> None:
    from actors.serve.tools import generic_chat

    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "add", "arguments": SUM}},
             {"id": "call_2", "type": "function",
              "function": {"name": "run", "arguments": {"code": "1"}}}]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Add and run."},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"},
                {"role": "tool", "tool_call_id": "call_2", "content": "1"}]
    choice = tool_choice(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    chat = generic_chat(messages, choice)
    assert [message["role"] for message in chat] == ["system", "user", "assistant", "user"]
    system = chat[0]["content"]
    assert system.startswith("Be brief.\n\n")
    described = [json.loads(line) for line in system.splitlines() if line.startswith('{"name"')]
    assert described == [tool["function"] for tool in choice.tools]
    assert 'call the function "add"' in system and "exactly one call" in system
    assert json.loads(chat[2]["content"]) == {"tool_calls": [
        {"name": "add", "arguments": SUM}, {"name": "run", "arguments": {"code": "1"}}]}
    assert [json.loads(line) for line in chat[3]["content"].splitlines()] == [
        {"tool_response": {"name": "add", "content": "3"}},
        {"tool_response": {"name": "run", "content": "1"}}]
    assert "answer in plain text" in generic_chat(messages[1:2], tool_choice(TOOLS, "auto"))[
        0]["content"]


# --- served: the app over a fake engine that answers a set text ---------------------------------


class ScriptedEngine:
    """The fake engine, answering every chat with `answer` (three characters a token) after
    rendering the conversation with the real template, as the engine does; what each chat
    was asked with is kept."""

    def __init__(self, engine: Engine, answer: str) -> None:
        self._engine = engine
        self.answer = answer
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             template: str | None = None, *, tools: list[dict[str, Any]] | None = None,
             **_: Any) -> AsyncIterator[Chunk]:
        self.prompts.append(self._engine.chat_template(template).render(messages, tools=tools))
        self.params.append(params)
        return self._chunks()

    def tokens(self) -> list[tuple[str, int]]:
        """The answer as (decoded text, token id) pairs."""
        return [(text, number) for number, text in enumerate(split_every(self.answer, 3))]

    async def _chunks(self) -> AsyncIterator[Chunk]:
        tokens = self.tokens()
        for number, (text, token_id) in enumerate(tokens):
            last = number == len(tokens) - 1
            yield Chunk(text=text, token_id=token_id, finish_reason="stop" if last else None,
                        usage=Usage(prompt_tokens=1, completion_tokens=len(tokens),
                                    cached_tokens=0) if last else None)


TEMPLATES = {"hermes": "Qwen-Qwen3-0.6B", "llama3": "meta-llama-Llama-3.1-8B-Instruct",
             "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407",
             "mistral": "Mistral-Small-3.2-24B-Instruct-2506", "generic": None}


def template_source(name: str) -> str:
    return reference(TEMPLATES[name])[1]["template"] if TEMPLATES[name] else PLAIN_TEMPLATE


@asynccontextmanager
async def served(name: str, answer: str, scripted: type[ScriptedEngine] = ScriptedEngine,
                 ) -> AsyncIterator[tuple[openai.AsyncOpenAI, ScriptedEngine]]:
    """The app over a `scripted` engine answering `answer`, with the real template of the
    format `name`, and an openai client for it."""
    backend = CountingBackend(context_length=8192, num_blocks=4096)
    engines: list[ScriptedEngine] = []

    @asynccontextmanager
    async def open_engine() -> AsyncIterator[ScriptedEngine]:
        def chat_template(source: str | None) -> ChatTemplate:
            return ChatTemplate(source or PLAIN_TEMPLATE, bos_token="<s>", eos_token="</s>")

        async with open_fake(backend, chat_template=chat_template) as engine:
            engines.append(scripted(engine, answer))
            yield engines[-1]

    options = ServerOptions(chat_template=template_source(name))
    async with serving(open_engine, options) as http:
        await until_ready(http)
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                      max_retries=0) as client:
            yield client, engines[0]


ASK = [{"role": "user", "content": "Run it."}]


async def streamed_reply(client: openai.AsyncOpenAI, **request: Any) -> dict[str, Any]:
    """A streamed chat as deltas accumulate: content, calls (id, name, argument pieces),
    the finish reason."""
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(model=MODEL, stream=True,
                                                             **request):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": delta.id, "name": None, "pieces": []})
            if delta.function.name:
                call["name"] = delta.function.name
            if delta.function.arguments:
                call["pieces"].append(delta.function.arguments)
        finish = choice.finish_reason or finish
    return {"content": content, "calls": [calls[index] for index in sorted(calls)],
            "finish": finish}


@pytest.mark.anyio
@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("name", FORMATS)
async def test_adversarial_calls_are_served_as_calls_whole_and_streamed(
        name: str, choice: str) -> None:
    tool_format = FORMATS[name]
    calls = calls_for(tool_format)
    expected = [(call_name, json.loads(arguments)) for call_name, arguments in calls]
    async with served(name, answer_in(tool_format, calls)) as (client, engine):
        whole = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                     tool_choice=choice)
        streamed = await streamed_reply(client, messages=ASK, tools=TOOLS, tool_choice=choice)
        # The calls go back into the conversation, rendered by the real template.
        back = [*ASK, whole.choices[0].message.model_dump(exclude_none=True),
                *({"role": "tool", "tool_call_id": call.id, "content": "done"}
                  for call in whole.choices[0].message.tool_calls)]
        await client.chat.completions.create(model=MODEL, messages=back, tools=TOOLS)
    (answer,) = whole.choices
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    assert [(call.function.name, json.loads(call.function.arguments))
            for call in answer.message.tool_calls] == expected
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(call["name"], json.loads("".join(call["pieces"])))
            for call in streamed["calls"]] == expected
    assert len(streamed["calls"][0]["pieces"]) > 10  # arguments stream as they are written
    enforced = [params.structured is not None for params in engine.params]
    assert enforced[:2] == [choice == "required" or not tool_format.renders_tools] * 2
    if tool_format.short_ids:  # Mistral's templates take back only ids of 9 characters
        assert all(len(call.id) == 9 for call in answer.message.tool_calls)
    assert "done" in engine.prompts[-1]


@pytest.mark.anyio
async def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    async with served("generic", "Hello! 2 + 2 = 4.") as (client, engine):
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *ASK],
            tools=TOOLS, parallel_tool_calls=False)
    (answer,) = reply.choices
    assert answer.message.content == "Hello! 2 + 2 = 4." and answer.message.tool_calls is None
    assert answer.finish_reason == "stop"
    (prompt,) = engine.prompts
    assert prompt.startswith("<|system|>Be brief.\n\nYou can call these functions")
    assert '"name": "run"' in prompt and "exactly one call" in prompt
    assert prompt.endswith("<|user|>Run it.\n<|assistant|>")


# --- end to end: the tiny llama, its template rendering no tools --------------------------------

BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in BOUNDED_TOOLS}
GREEDY = {"temperature": 0, "max_tokens": 400}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def tiny_llama(tiny_model_paths: dict[str, Path]) -> AsyncIterator[openai.AsyncOpenAI]:
    def open_engine() -> AbstractAsyncContextManager[Engine]:
        return Engine.open(tiny_model_paths["llama-q4k-tiny"], backend="cpu")

    async with serving(open_engine, ServerOptions(chat_template=PLAIN_TEMPLATE)) as http:
        await until_ready(http)
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            yield client


def checked(calls: Iterator[Any] | list[Any]) -> list[str]:
    """The calls' names, each call checked against its function's schema."""
    names = []
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.append(call.function.name)
    return names


@pytest.mark.anyio
async def test_the_tiny_llama_calls_through_the_generic_format(
        tiny_llama: openai.AsyncOpenAI) -> None:
    ask = {"model": MODEL, "messages": ASK, "tools": BOUNDED_TOOLS, **GREEDY}
    several = await tiny_llama.chat.completions.create(tool_choice="required", **ask)
    one = await tiny_llama.chat.completions.create(tool_choice="required",
                                                   parallel_tool_calls=False, **ask)
    named = await tiny_llama.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, **ask)
    for reply in (several, one, named):
        assert reply.choices[0].finish_reason == "tool_calls"
        assert reply.choices[0].message.content is None
    assert len(checked(several.choices[0].message.tool_calls)) >= 1
    assert len(checked(one.choices[0].message.tool_calls)) == 1
    assert checked(named.choices[0].message.tool_calls) == ["add"]
    streamed = await streamed_reply(tiny_llama, tool_choice="required",
                                    parallel_tool_calls=False, **{
                                        key: value for key, value in ask.items()
                                        if key != "model"})
    (call,) = streamed["calls"]
    assert (call["name"], "".join(call["pieces"])) == (
        one.choices[0].message.tool_calls[0].function.name,
        one.choices[0].message.tool_calls[0].function.arguments)
    assert len(call["pieces"]) > 1


@pytest.mark.anyio
async def test_the_tiny_llama_answers_text_with_auto(tiny_llama: openai.AsyncOpenAI) -> None:
    reply = await tiny_llama.chat.completions.create(
        model=MODEL, messages=ASK, tools=BOUNDED_TOOLS, temperature=0, max_tokens=12)
    (answer,) = reply.choices
    assert answer.message.tool_calls is None and answer.message.content
    assert not answer.message.content.lstrip().startswith("{")
