"""OpenAI function tools: the request's `tools` and `tool_choice` checked, the grammar that
enforces calls, and the calls read back out of the answer, whole or as it streams.

A model writes its calls in the shape its chat template taught it; the template's source says
which (`ToolCallFormat.of_template`): Hermes / Qwen `<tool_call>` tags, Llama 3's bare JSON
with "parameters", Mistral's `[TOOL_CALLS]` (a JSON list, or `name[ARGS]{...}`), and for a
template that renders no tools the generic format: the tools described in a system message,
the answer a `{"tool_calls": [...]}` object or text. With `tool_choice` "required" or a
named function the calls are enforced token by token (a Lark grammar holding each function's
JSON schema); with "auto" the answer is free (the generic format: a call or text) and read as
it comes: calls found in it become `tool_calls`, anything else stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec

from actors.errors import InvalidRequest
from actors.model.text.chat import ChatTemplate
from actors.params import StructuredOutput
from actors.serve.schemas import bounded_numbers
from actors.structured import JSON_LAYOUT

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Where JSON schemas keep the subschemas their references name.
DEFINITIONS = ("$defs", "definitions")
# A function declared without parameters takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# The most functions one request may declare: OpenAI's limit, so a client written for OpenAI
# never meets it.
MAX_TOOLS = 128
# The most JSON text the tools may take together. The template writes them into the prompt,
# and an enforced call's grammar holds them all; large real tool sets take tens of KiB.
MAX_TOOLS_JSON_BYTES = 512 << 10

ChoiceMode = Literal["auto", "none", "required", "function"]


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """A request's tools, checked, and how it lets the model use them: `mode` "auto" (it may
    call them), "none" (it answers in text; the template does not see the tools), "required"
    (it calls them: the grammar holds the calls) or "function" (it calls `function`).
    `parallel` (OpenAI's parallel_tool_calls; never for a named function): several calls in
    one answer, else one at most."""

    tools: tuple[dict[str, Any], ...]
    mode: ChoiceMode
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def enforced(self) -> bool:
        """Whether the answer must be a call (a grammar enforces it)."""
        return self.mode in ("required", "function")

    def callable_tools(self) -> list[dict[str, Any]]:
        """The tools the enforced call may use: the named one, or all."""
        if self.mode == "function":
            return [tool for tool in self.tools if tool["function"]["name"] == self.function]
        return list(self.tools)


def tool_choice(tools: Any, choice: Any, parallel: bool | None = None) -> ToolChoice | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls` (None: OpenAI's default,
    true), checked (None: no tools asked for)."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest(f"tool_choice {choice!r} needs tools"[:200], field="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of function tools", field="tools")
    check_tool_count(len(tools))
    checked = tuple(_checked_tool(index, tool) for index, tool in enumerate(tools))
    _check_tools_size(checked)
    names = [tool["function"]["name"] for tool in checked]
    _check_unique(names)
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(tools=checked, mode=choice or "auto", parallel=parallel is not False)
    name = _named_function(choice)
    if name not in names:
        raise InvalidRequest(f"tool_choice names the function {name!r}, which tools does not "
                             f"declare (it declares {', '.join(names)})", field="tool_choice")
    # A named function is called once, whatever parallel_tool_calls says (as vLLM does).
    return ToolChoice(tools=checked, mode="function", function=name, parallel=False)


def check_tool_count(count: int) -> None:
    """Refuse more functions than MAX_TOOLS (before any is read)."""
    if count > MAX_TOOLS:
        raise InvalidRequest(f"tools declares {count:,} functions; this server takes at most "
                             f"{MAX_TOOLS}, as OpenAI's API does", field="tools")


def _check_tools_size(tools: tuple[dict[str, Any], ...]) -> None:
    size = len(msgspec.json.encode(tools))
    if size > MAX_TOOLS_JSON_BYTES:
        raise InvalidRequest(f"tools take {size:,} bytes of JSON; this server takes at most "
                             f"{MAX_TOOLS_JSON_BYTES:,} for all functions together", field="tools")


def _check_unique(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidRequest(f"tools declares the function {name!r} twice", field="tools")
        seen.add(name)


def _checked_tool(index: int, tool: Any) -> dict[str, Any]:
    """One tool as templates take it: `{"type": "function", "function": {"name",
    "description"?, "parameters"}}`."""
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise InvalidRequest(f'{where} must be an object with "type": "function" (the only tools '
                             "this server has)", field="tools")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequest(f"{where}.function must be an object", field="tools")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, "
                             f"got {name!r}"[:200], field="tools")
    parameters = function.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, Mapping):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object",
                             field="tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description must be a string", field="tools")
    checked: dict[str, Any] = {"name": name, "parameters": dict(parameters)}
    if description is not None:
        checked["description"] = description
    return {"type": "function", "function": checked}


def _named_function(choice: Any) -> str:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
    raise InvalidRequest('tool_choice must be "auto", "none", "required" or {"type": '
                         '"function", "function": {"name": ...}}', field="tool_choice")


def openai_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def mistral_call_id() -> str:
    """A call id as Mistral's templates take them back: 9 letters and digits (they refuse
    others)."""
    return uuid.uuid4().hex[:9]


class ToolCall(msgspec.Struct, frozen=True):
    """One call read from the answer; `arguments` is its JSON text."""

    name: str
    arguments: str
    id: str = msgspec.field(default_factory=openai_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# --- what the reader says, piece by piece -----------------------------------------------------


class CallStart(msgspec.Struct, frozen=True):
    """A call begins: its id and function; its arguments follow as `CallArguments`."""

    id: str
    name: str


class CallArguments(msgspec.Struct, frozen=True):
    """The next piece of the open call's arguments (JSON text, as the model writes it)."""

    text: str


class CallEnd(msgspec.Struct, frozen=True):
    """The open call is complete."""


Piece = str | CallStart | CallArguments | CallEnd


# --- the formats ------------------------------------------------------------------------------


class ToolCallFormat(msgspec.Struct, frozen=True, kw_only=True):
    """How a model writes its calls, as data the grammar and the reader both follow.

    Calls come in blocks: `opener`, the calls (split by `separator`; None: one call a block),
    `closer`; the grammar writes `between_blocks` between blocks. A call is a JSON object
    `{"name": ..., <arguments_key>: {...}}`, or (`named`) the function's name, `[ARGS]` and
    the arguments' JSON (Mistral's newer templates). `leading`: the calls open the answer, so
    an answer that starts otherwise is text; `single`: at most one call an answer (the
    template writes one back); `lead_marker`: may come before leading calls and is no text.
    `markers` are the format's marker texts: `with_vocabulary` finds those that are one
    token of a model (the grammar then writes that token, and the reader gets its text back
    where decoding leaves it out). `renders_tools` False is the generic format:
    the template knows no tools, so a system message describes them (`generic_chat`)."""

    name: str
    opener: str = ""
    separator: str | None = None
    closer: str = ""
    between_blocks: str = ""
    named: bool = False
    arguments_key: str = "arguments"
    leading: bool = False
    single: bool = False
    lead_marker: str = ""
    short_ids: bool = False
    renders_tools: bool = True
    markers: tuple[str, ...] = ()
    special_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    hidden_tokens: dict[int, str] = msgspec.field(default_factory=dict)

    @classmethod
    def of_template(cls, template: ChatTemplate) -> ToolCallFormat:
        """The format `template` writes calls back in (so its model learnt to write them so);
        the generic format for a template that renders no tools."""
        source = template.source
        if not template.renders_tools:
            return GENERIC
        if MISTRAL_CALLS in source:
            return MISTRAL if MISTRAL_ARGS in source else MISTRAL_NEMO
        if TOOL_CALL_OPEN in source:
            return HERMES
        # Llama 3.x writes calls back as {"name": ..., "parameters": ...}.
        if PYTHON_TAG in source or '"parameters"' in source:
            return LLAMA3
        return BARE_JSON

    def with_vocabulary(self, tokenize: Callable[[str, bool], list[int]],
                        detokenize: Callable[[list[int]], str]) -> ToolCallFormat:
        """This format for one model: `tokenize(text, parse_special)` and `detokenize(ids)`
        are its tokenizer's. A marker that is one token is written as that token by the
        grammar (the model knows it so, not spelt out: llguidance never matches a special
        token's text to a literal), and where its decoded text leaves it out (a control
        token), the reader gets it back from the token's id."""
        special: dict[str, int] = {}
        hidden: dict[int, str] = {}
        for marker in self.markers:
            ids = tokenize(marker, True)
            if len(ids) == 1:
                special[marker] = ids[0]
                if detokenize(ids) != marker:
                    hidden[ids[0]] = marker
        return msgspec.structs.replace(self, special_tokens=special, hidden_tokens=hidden)

    def text_of(self, text: str, token_id: int | None) -> str:
        """A token's text as the reader takes it: with the marker the token stands for, where
        decoding leaves it out."""
        marker = self.hidden_tokens.get(token_id) if token_id is not None else None
        return text + marker if marker else text

    def constraint(self, choice: ToolChoice) -> StructuredOutput | None:
        """What the answer is held to: the calls, when `choice` enforces them; in the generic
        format's "auto", a call or text (text that does not start like a call); else None."""
        if choice.enforced:
            grammar = self.grammar(choice.callable_tools(), choice.parallel)
        elif not self.renders_tools and choice.mode == "auto":
            grammar = self.grammar(list(choice.tools), choice.parallel, or_text=True)
        else:
            return None
        return StructuredOutput(grammar=grammar)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool = True,
                or_text: bool = False) -> str:
        """llguidance's Lark grammar of calls to `tools` (several with `parallel`, unless the
        format holds one), each function's arguments held to its `parameters` schema;
        `or_text`: or a text that does not start like the calls."""
        rules = [f"fn{index}: {self._call_rule(tool['function'])}"
                 for index, tool in enumerate(tools)]
        several = parallel and not self.single
        if self.separator is not None:
            listed = f"call ({self._lark(self.separator)} call)*" if several else "call"
            calls = f"calls: {self._lark(self.opener)} {listed} {self._lark(self.closer)}"
        else:
            block = f"block: {self._lark(self.opener)} call {self._lark(self.closer)}"
            calls = (f"calls: block ({self._lark(self.between_blocks)} block)*" if several
                     else "calls: block")
            rules.append(block)
        start = ["start: calls"]
        if or_text:
            # Text is anything whose first non-blank character cannot start the calls.
            first = re.escape(self.opener.strip()[:1])
            start = ['start: calls | TEXT | ""', f"TEXT: /\\s*[^{first}\\s](.|\\n)*/"]
        call = " | ".join(f"fn{index}" for index in range(len(tools)))
        return "\n".join([*start, calls, f"call: {call}", *rules])

    def _call_rule(self, function: dict[str, Any]) -> str:
        if self.named:
            return (f"{json.dumps(function['name'])} {self._lark(MISTRAL_ARGS)} "
                    f"%json {json.dumps(_laid_out(dict(function['parameters'])))}")
        return f"%json {json.dumps(self._call_schema(function))}"

    def _call_schema(self, function: dict[str, Any]) -> dict[str, Any]:
        # The parameters' definitions move to the root, where their `#/$defs/...` references
        # (pydantic writes them) point once the parameters are nested in the call.
        parameters = dict(function["parameters"])
        definitions = {key: parameters.pop(key) for key in DEFINITIONS if key in parameters}
        return _laid_out({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
            **definitions,
        })

    def _lark(self, text: str) -> str:
        """`text` as a Lark sequence: its markers that are special tokens as those tokens
        (`<[id]>`), the rest as literals; nothing for no text."""
        parts = []
        while text:
            found = [(text.find(marker), marker) for marker in self.special_tokens
                     if marker in text]
            if not found:
                parts.append(json.dumps(text))
                break
            at, marker = min(found)
            if at:
                parts.append(json.dumps(text[:at]))
            parts.append(f"<[{self.special_tokens[marker]}]>")
            text = text[at + len(marker):]
        return " ".join(parts)

    def reader(self, names: frozenset[str], parallel: bool = True) -> ToolCallReader:
        """A reader of calls to `names` (at most one unless `parallel`)."""
        return ToolCallReader(self, names, parallel)


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    # Laid out as every JSON constraint is (a grammar's `%json` has no defaults), its numbers
    # bounded in length as a response_format schema's are.
    return {**bounded_numbers(schema), "x-guidance": JSON_LAYOUT}


TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_CALL_ID = "[CALL_ID]"
MISTRAL_ARGS = "[ARGS]"

# Hermes, Qwen 2.5 and Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
# per call, after any text.
HERMES = ToolCallFormat(name="hermes", opener=TOOL_CALL_OPEN + "\n",
                        closer="\n" + TOOL_CALL_CLOSE, between_blocks="\n",
                        markers=(TOOL_CALL_OPEN, TOOL_CALL_CLOSE))
# Llama 3.1 to 3.3: the answer is one call, `{"name": ..., "parameters": {...}}`, perhaps
# after `<|python_tag|>`; their templates write back one call a message.
LLAMA3 = ToolCallFormat(name="llama3", arguments_key="parameters", leading=True, single=True,
                        lead_marker=PYTHON_TAG, markers=(PYTHON_TAG,))
# A template that renders tools in a shape not known here: the answer is one JSON call.
BARE_JSON = ToolCallFormat(name="json", leading=True, single=True)
# Mistral Nemo: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any text.
MISTRAL_NEMO = ToolCallFormat(name="mistral-nemo", opener=MISTRAL_CALLS + "[", separator=", ",
                              closer="]", short_ids=True, markers=(MISTRAL_CALLS,))
# Mistral Small 3.2, Devstral, Ministral 3: `[TOOL_CALLS]name[ARGS]{...}` per call (Small 3.2
# writes back `[CALL_ID]id` before `[ARGS]`, which the reader skips).
MISTRAL = ToolCallFormat(name="mistral", opener=MISTRAL_CALLS, named=True, short_ids=True,
                         markers=(MISTRAL_CALLS, MISTRAL_CALL_ID, MISTRAL_ARGS))
# Any other model: its template renders no tools, so a system message describes them and
# the answer is `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` or text.
GENERIC = ToolCallFormat(name="generic", opener='{"tool_calls": [', separator=", ",
                         closer="]}", leading=True, renders_tools=False)


# --- the generic format's prompt --------------------------------------------------------------


def generic_chat(messages: list[dict[str, Any]], choice: ToolChoice) -> list[dict[str, Any]]:
    """`messages` as a template that knows no tools takes them, in the generic format: the
    tools described in the system message (one added, or the first one's text extended), an
    assistant's calls written as the call object it answers with, and call results as user
    messages `{"tool_response": {"name": ..., "content": ...}}` (several in a row, one
    message), so that the roles still alternate."""
    description = _generic_instructions(choice)
    if messages and messages[0]["role"] == "system":
        system = {**messages[0], "content": f"{messages[0]['content']}\n\n{description}"}
        messages = messages[1:]
    else:
        system = {"role": "system", "content": description}
    chat = [system]
    called: dict[str, str] = {}  # call id -> function name
    after_result = False
    for message in messages:
        role = message["role"]
        if role == "tool":
            result = {"content": message["content"]}
            name = called.get(message.get("tool_call_id", ""))
            response = json.dumps({"tool_response": {"name": name, **result} if name else result},
                                  ensure_ascii=False)
            if after_result:
                chat[-1] = {**chat[-1], "content": f"{chat[-1]['content']}\n{response}"}
            else:
                chat.append({"role": "user", "content": response})
            after_result = True
            continue
        after_result = False
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            called.update((call["id"], call["function"]["name"]) for call in calls)
            envelope = json.dumps({"tool_calls": [
                {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                for call in calls]}, ensure_ascii=False)
            text = (message.get("content") or "").strip()
            chat.append({"role": "assistant",
                         "content": f"{text}\n{envelope}" if text else envelope})
            continue
        chat.append(message)
    return chat


def _generic_instructions(choice: ToolChoice) -> str:
    functions = "\n".join(json.dumps(tool["function"], ensure_ascii=False)
                          for tool in choice.tools)
    how_many = ("It may list several calls, made together." if choice.parallel
                else "It lists exactly one call.")
    if choice.mode == "function":
        when = f'Now call the function "{choice.function}".'
    elif choice.mode == "required":
        when = "Now call one or more of them."
    else:
        when = ("If none of them is needed, answer in plain text instead (an answer that "
                'starts with "{" is read as calls).')
    return (
        "You can call these functions (each with a JSON schema of its parameters):\n"
        f"{functions}\n\n"
        "To call functions, answer with only this JSON object, and nothing after it:\n"
        '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}\n'
        f"{how_many} {when}\n"
        "The results come back in a user message, each as "
        '{"tool_response": {"name": "<function name>", "content": <its result>}}.'
    )


# --- reading calls out of an answer -----------------------------------------------------------


class ToolCallReader:
    """Reads the calls (to functions of `names`; at most one unless `parallel`) out of an
    answer written in `format`: whole with `parse`, or as it streams with `feed` then `end`
    (text and whole calls) or `feed_pieces` then `end_pieces` (text, then each call opened,
    its arguments in pieces as they arrive, and closed).

    Calls are read by their structure: a call's JSON ends where its brackets close outside
    its strings, so a marker inside an argument (`</tool_call>`, `[TOOL_CALLS]`, `{"name":`)
    is argument text. A call opens once its name is read and its arguments begin, and its
    arguments stream as written (their JSON is the grammar's to hold, where a call is
    enforced); a call whose name comes after its arguments is read whole. Text that may still
    become a call is held until it is decided; a call that does not parse, or names an unknown
    function, stays text."""

    def __init__(self, format: ToolCallFormat, names: frozenset[str],
                 parallel: bool = True) -> None:
        self.format = format
        self.names = names
        self._parallel = parallel
        self._state = "start" if format.leading else "text"
        self._buffer = ""  # text not yet read
        self._undecided = ""  # text read into a block that may still turn out to be text
        self._call = self._new_call()
        self._open = False  # a call has started and not ended
        self._block_calls = 0
        self._calls = 0
        # Whitespace-only text beside a call is layout, not content: held until text follows.
        self._space = ""
        self._called = False
        self._building: tuple[CallStart, list[str]] | None = None  # for `feed` and `end`

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside the calls, or None when there is none; the calls). A reader of
        its own reads it, so that this one's stream is left as it was."""
        whole = ToolCallReader(self.format, self.names, self._parallel)
        pieces = [*whole.feed(text), *whole.end()]
        content = "".join(piece for piece in pieces if isinstance(piece, str)).strip()
        calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
        return (content or None) if calls else text, calls

    def feed(self, text: str) -> list[str | ToolCall]:
        """The text and whole calls that `text`, following what came before, settles."""
        return self._whole_calls(self.feed_pieces(text))

    def end(self) -> list[str | ToolCall]:
        """The answer is complete: everything still held, settled, as text and whole calls."""
        return self._whole_calls(self.end_pieces())

    def feed_pieces(self, text: str) -> list[Piece]:
        """The pieces that `text`, following what came before, settles."""
        self._buffer += text
        return self._without_layout(self._read(final=False), final=False)

    def end_pieces(self) -> list[Piece]:
        """The answer is complete: everything still held, settled (a call cut short ends
        where the answer does)."""
        return self._without_layout(self._read(final=True), final=True)

    def _whole_calls(self, pieces: list[Piece]) -> list[str | ToolCall]:
        whole: list[str | ToolCall] = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                self._building = (piece, [])
            elif isinstance(piece, CallArguments) and self._building is not None:
                self._building[1].append(piece.text)
            elif isinstance(piece, CallEnd) and self._building is not None:
                start, texts = self._building
                whole.append(ToolCall(start.name, "".join(texts), start.id))
                self._building = None
            elif isinstance(piece, str):
                whole.append(piece)
        return whole

    def _without_layout(self, pieces: list[Piece], final: bool) -> list[Piece]:
        """`pieces` less the whitespace between text and calls (held at the end of each text
        until text or a call follows, so that it falls the same however the text was split)."""
        kept: list[Piece] = []
        for piece in pieces:
            if not isinstance(piece, str):
                self._space = ""
                self._called = True
                kept.append(piece)
                continue
            text = piece.rstrip()
            if text:
                kept.append(self._space + text)
                self._space = ""
            self._space += piece[len(text):]
        if final and self._space and not self._called:
            kept.append(self._space)
            self._space = ""
        return kept

    # Each state reads what it can of the buffer: True when it moved on (read on), False when
    # it waits for more text.

    def _read(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        states = {"start": self._at_start, "text": self._in_text, "plain": self._in_plain,
                  "opener": self._at_opener, "call": self._in_call, "after": self._after_call}
        while states[self._state](pieces, final):
            pass
        return [piece for piece in pieces if piece != ""]

    def _at_start(self, pieces: list[Piece], final: bool) -> bool:
        """The answer's start, where leading calls must begin (blanks and a lead marker
        aside)."""
        blanks = len(self._buffer) - len(self._buffer.lstrip())
        if blanks == len(self._buffer) and not final:
            return False
        self._take(blanks)
        if self.format.lead_marker:
            found, size = _match(self.format.lead_marker, self._buffer)
            if found == _PARTIAL and not final:
                return False
            if found == _MATCH:
                self._take(size)
        self._state = "opener"
        return True

    def _in_text(self, pieces: list[Piece], final: bool) -> bool:
        """Text, up to where a block of calls may open."""
        at = self._buffer.find(self.format.opener.strip()[:1])
        if at < 0:
            pieces.append(self._buffer)
            self._buffer = ""
            return False
        pieces.append(self._buffer[:at])
        self._buffer = self._buffer[at:]
        self._state = "opener"
        return True

    def _in_plain(self, pieces: list[Piece], final: bool) -> bool:
        """The rest of the answer is text."""
        pieces.append(self._buffer)
        self._buffer = ""
        return False

    def _at_opener(self, pieces: list[Piece], final: bool) -> bool:
        found, size = _match(self.format.opener, self._buffer)
        if found == _PARTIAL and not final:
            return False
        if found != _MATCH:
            return self._broken(pieces)
        self._take(size)
        self._next_call()
        return True

    def _in_call(self, pieces: list[Piece], final: bool) -> bool:
        size, events, status = self._call.read(self._buffer, final)
        self._take(size)
        for name, text in events:
            if name is not None:
                pieces.append(CallStart(id=self._call_id(), name=name))
                self._open = True
                self._block_calls += 1
            if text:
                pieces.append(CallArguments(text))
        if self._open:
            self._undecided = ""  # the call's text is read: it cannot become text again
        if status == _DONE:
            pieces.append(CallEnd())
            self._open = False
            self._calls += 1
            self._state = "after"
            return True
        if status == _BROKEN or final:
            return self._broken(pieces)
        return False

    def _after_call(self, pieces: list[Piece], final: bool) -> bool:
        """After a call: the next call of its block, the block's end, or (neither) text."""
        waiting = False
        if self.format.separator is not None and self._may_call_again():
            found, size = _match(self.format.separator, self._buffer)
            if found == _MATCH:
                self._take(size)
                self._next_call()
                return True
            waiting = found == _PARTIAL
        found, size = _match(self.format.closer, self._buffer)
        if found == _MATCH:
            self._take(size)
            self._undecided = ""
        elif (waiting or found == _PARTIAL) and not final:
            return False
        self._end_block()
        return True

    def _broken(self, pieces: list[Piece]) -> bool:
        """The block does not go on as the format says: an open call ends where it broke, and
        what the block read that was no call is text (past its first character, a block may
        still open)."""
        if self._open:
            pieces.append(CallEnd())
            self._open = False
            self._calls += 1
        text, self._undecided = self._undecided + self._buffer, ""
        if not self._block_calls and text:
            pieces.append(text[0])
            text = text[1:]
        self._buffer = text
        self._end_block()
        return True

    def _end_block(self) -> None:
        self._block_calls = 0
        done = self.format.leading or (self._calls and not self._may_call_again())
        self._state = "plain" if done else "text"

    def _may_call_again(self) -> bool:
        return self._parallel and not self.format.single

    def _next_call(self) -> None:
        self._call = self._new_call()
        self._state = "call"

    def _new_call(self) -> _ObjectCall | _NamedCall:
        return _NamedCall(self.names) if self.format.named else _ObjectCall(self.names)

    def _take(self, size: int) -> None:
        """Read `size` characters of the buffer into the block."""
        if not self._open:
            self._undecided += self._buffer[:size]
        self._buffer = self._buffer[size:]

    def _call_id(self) -> str:
        return mistral_call_id() if self.format.short_ids else openai_call_id()


_MATCH, _PARTIAL, _NO = "match", "partial", "no"
# What a call reader says of its call.
_DONE, _BROKEN, _MORE = "done", "broken", "more"
# (a function's name when its call starts, else None; a piece of its arguments)
CallEvent = tuple[str | None, str]


def _match(literal: str, text: str) -> tuple[str, int]:
    """Whether `text` starts with `literal`, blanks aside (blanks may come before any of its
    characters): (_MATCH, the length of text it takes), (_PARTIAL, 0) while `text` may still
    become it, or (_NO, 0)."""
    at = 0
    for char in literal:
        if char.isspace():
            continue
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return _PARTIAL, 0
        if text[at] != char:
            return _NO, 0
        at += 1
    return _MATCH, at


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


# Within a string, the characters that matter: its end and escapes.
_STRING_STOPS = re.compile(r'["\\]')
# The characters of JSON numbers, true, false and null.
_SCALAR = frozenset("-+.0123456789eEtruefalsn")


class _JsonValue:
    """Finds where one JSON value ends, a piece of text at a time: by its brackets, outside
    its strings (escapes followed). Whether it is valid JSON is json's to judge."""

    def __init__(self) -> None:
        self._closers: list[str] = []
        self._in_string = False
        self._escaped = False
        self._scalar = False
        self.started = False
        self.done = False
        self.broken = False

    def scan(self, text: str, final: bool) -> int:
        """Reads `text` (what follows the text read before) up to the value's end; how much
        of it was read."""
        at = 0
        while at < len(text) and not (self.done or self.broken):
            if self._in_string:
                at = self._in_string_scan(text, at)
                continue
            char = text[at]
            if self._scalar:
                if char not in _SCALAR:
                    self.done = True
                    break
            elif not self.started:
                self.started = True
                self._open(char)
            elif char in "{[":
                self._closers.append("}" if char == "{" else "]")
            elif char in "}]":
                if not self._closers or self._closers.pop() != char:
                    self.broken = True
                    break
                self.done = not self._closers
            elif char == '"':
                self._in_string = True
            at += 1
        if final and self._scalar:
            self.done = True
        return at

    def _open(self, char: str) -> None:
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._closers.append("}" if char == "{" else "]")
        elif char in _SCALAR:
            self._scalar = True
        else:
            self.broken = True

    def _in_string_scan(self, text: str, at: int) -> int:
        if self._escaped:
            self._escaped = False
            return at + 1
        stop = _STRING_STOPS.search(text, at)
        if stop is None:
            return len(text)
        if stop.group() == "\\":
            self._escaped = True
            return stop.end()
        self._in_string = False
        self.done = not self._closers
        return stop.end()


def _loads(text: str) -> Any:
    """`text`'s JSON value, or None (also for JSON nested past the parser's depth: an answer
    is the model's text)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _arguments_text(value: str) -> str | None:
    """The JSON text of a call's arguments written as `value`: an object, or (some models
    write them so) a string holding one; None for anything else."""
    arguments = _loads(value)
    if isinstance(arguments, str):
        text = arguments.strip()
        return text if isinstance(_loads(text), dict) else None
    return value if isinstance(arguments, dict) else None


class _ObjectCall:
    """One call written as a JSON object, `{"name": ..., "arguments": {...}}` (or
    "parameters"), read as it arrives: its arguments stream once its name is read before them
    (as the grammar writes it); otherwise they are read whole when the object closes."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._phase = "open"
        self._value = _JsonValue()  # the key or value being read
        self._kept: list[str] = []  # the key or value being read, when it is kept
        self._key: str | None = None
        self._name: str | None = None
        self._arguments: str | None = None  # read whole
        self._streaming = False

    def read(self, text: str, final: bool) -> tuple[int, list[CallEvent], str]:
        """(how much of `text` it read, what it found, _DONE / _BROKEN / _MORE)."""
        events: list[CallEvent] = []
        at = 0
        while True:
            if self._phase in ("key", "value"):
                size = self._value.scan(text[at:], final)
                piece, at = text[at:at + size], at + size
                if self._streaming and self._phase == "value":
                    events.append((None, piece))
                else:
                    self._kept.append(piece)
                if self._value.broken:
                    return at, events, _BROKEN
                if not self._value.done:
                    return at, events, _MORE
                status = self._read_token()
                if status != _MORE:
                    return at, events, status
                continue
            at = _skip_blanks(text, at)
            if at == len(text):
                return at, events, _MORE
            char = text[at]
            if self._phase == "value_start" and self._starts_streaming(char):
                events.append((self._name, ""))
            status = self._punctuation(char)
            if status == _BROKEN:
                return at, events, _BROKEN
            if status == _DONE:
                return at + 1, events, self._finished(events)
            if self._phase not in ("key", "value"):
                at += 1

    def _starts_streaming(self, char: str) -> bool:
        self._streaming = (char == "{" and self._key in self.ARGUMENT_KEYS
                           and self._name in self._names and self._arguments is None)
        return self._streaming

    def _punctuation(self, char: str) -> str:
        """The next character outside a key or value: it opens the object, a key, a value,
        or ends the object."""
        phase = self._phase
        if phase == "open" and char == "{":
            self._phase = "first_key"
        elif phase in ("first_key", "next_key") and char == '"':
            self._phase = "key"
            self._value = _JsonValue()
        elif phase == "first_key" and char == "}":
            return _DONE
        elif phase == "colon" and char == ":":
            self._phase = "value_start"
        elif phase == "value_start":
            self._phase = "value"
            self._value = _JsonValue()
        elif phase == "comma" and char == ",":
            self._phase = "next_key"
        elif phase == "comma" and char == "}":
            return _DONE
        else:
            return _BROKEN
        return _MORE

    def _read_token(self) -> str:
        """A key or value has been read whole."""
        text = "".join(self._kept)
        self._kept = []
        if self._phase == "key":
            key = _loads(text)
            self._key = key if isinstance(key, str) else None
            self._phase = "colon"
            return _MORE
        self._phase = "comma"
        if self._streaming:
            self._streaming = False
            self._arguments = ""  # streamed
        elif self._key == "name":
            name = _loads(text)
            self._name = name if isinstance(name, str) else None
        elif self._key in self.ARGUMENT_KEYS and self._arguments is None:
            self._arguments = text
        return _MORE

    def _finished(self, events: list[CallEvent]) -> str:
        """The object closed: a call whose arguments streamed is done; one read whole is a
        call if it names a known function with object arguments."""
        if self._arguments == "":
            return _DONE
        if self._name not in self._names or self._arguments is None:
            return _BROKEN
        arguments = _arguments_text(self._arguments)
        if arguments is None:
            return _BROKEN
        events += [(self._name, arguments)]
        return _DONE


class _NamedCall:
    """One call written as its function's name, an optional `[CALL_ID]id`, `[ARGS]` and its
    arguments' JSON object (Mistral), read as it arrives: its arguments stream."""

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._phase = "name"
        self._name = ""
        self._value = _JsonValue()

    def read(self, text: str, final: bool) -> tuple[int, list[CallEvent], str]:
        """(how much of `text` it read, what it found, _DONE / _BROKEN / _MORE)."""
        at = 0
        if self._phase == "name":
            at = _skip_blanks(text, 0) if not self._name else 0
            end = at
            while end < len(text) and (text[end].isalnum() or text[end] in "_-"):
                end += 1
            self._name += text[at:end]
            at = end
            if at == len(text):
                return at, [], _MORE
            if self._name not in self._names:
                return at, [], _BROKEN
            self._phase = "marker"
        if self._phase in ("marker", "call_id", "args"):
            status, at = self._markers(text, at)
            if status != _MORE or self._phase != "value":
                return at, [], status
        events: list[CallEvent] = []
        if not self._value.started:
            at = _skip_blanks(text, at)
            if at == len(text):
                return at, [], _MORE
            if text[at] != "{":
                return at, [], _BROKEN
            events.append((self._name, ""))
        size = self._value.scan(text[at:], final)
        events.append((None, text[at:at + size]))
        at += size
        if self._value.broken:
            return at, events, _BROKEN
        return at, events, _DONE if self._value.done else _MORE

    def _markers(self, text: str, at: int) -> tuple[str, int]:
        """Past the name: `[CALL_ID]` and the id (skipped), then `[ARGS]`."""
        while True:
            if self._phase == "call_id":
                end = at
                while end < len(text) and text[end].isalnum():
                    end += 1
                if end == len(text):
                    return _MORE, end
                at, self._phase = end, "args"
            found, size = _match(MISTRAL_ARGS, text[at:])
            if found == _MATCH:
                self._phase = "value"
                return _MORE, at + size
            if self._phase == "marker":
                found_id, size_id = _match(MISTRAL_CALL_ID, text[at:])
                if found_id == _MATCH:
                    at, self._phase = at + size_id, "call_id"
                    continue
                found = _PARTIAL if _PARTIAL in (found, found_id) else _NO
            return (_MORE if found == _PARTIAL else _BROKEN), at
