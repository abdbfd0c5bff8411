"""OpenAI function tools: the request's `tools` and `tool_choice` checked, the grammar that
enforces a call, and the calls read back out of the answer, whole or as it streams.

A model writes its calls in the shape its chat template taught it; the template's source says
which (`ToolCallFormat.of_template`): Hermes / Qwen templates wrap each call's JSON in
`<tool_call>...</tool_call>`, others (Llama 3.1) answer with the bare JSON object
`{"name": ..., "parameters": {...}}`. With `tool_choice` "required" or a named function, the
call is enforced token by token (a Lark grammar holding each function's JSON schema); with
"auto" the answer is free and read afterwards: calls found in it become `tool_calls`, anything
else stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from actors.errors import InvalidRequest
from actors.structured import JSON_LAYOUT

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
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
    call one), "none" (it answers in text; the template does not see the tools), "required"
    (it calls one of them, once: the grammar holds one call) or "function" (it calls
    `function`)."""

    tools: tuple[dict[str, Any], ...]
    mode: ChoiceMode
    function: str | None = None

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


def tool_choice(tools: Any, choice: Any) -> ToolChoice | None:
    """The request's `tools` and `tool_choice`, checked (None: no tools asked for)."""
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
        return ToolChoice(tools=checked, mode=choice or "auto")
    name = _named_function(choice)
    if name not in names:
        raise InvalidRequest(f"tool_choice names the function {name!r}, which tools does not "
                             f"declare (it declares {', '.join(names)})", field="tool_choice")
    return ToolChoice(tools=checked, mode="function", function=name)


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


class ToolCall(msgspec.Struct, frozen=True):
    """One call read from the answer; `arguments` is its JSON text."""

    name: str
    arguments: str
    id: str = msgspec.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallFormat(msgspec.Struct, frozen=True, kw_only=True):
    """How a model writes a call: its JSON (`{"name": ..., <arguments_key>: {...}}`) between
    `open` and `close` (Hermes: `<tool_call>` and `</tool_call>` on their own lines; Llama
    3.1: nothing, the answer is the JSON)."""

    open: str
    close: str
    arguments_key: str

    @classmethod
    def of_template(cls, source: str) -> ToolCallFormat:
        if HERMES_OPEN in source:
            return cls(open=HERMES_OPEN + "\n", close="\n" + HERMES_CLOSE,
                       arguments_key="arguments")
        # Llama 3.1's template writes calls back as {"name": ..., "parameters": ...}.
        key = "parameters" if '"parameters"' in source else "arguments"
        return cls(open="", close="", arguments_key=key)

    @property
    def tagged(self) -> bool:
        return bool(self.open)

    def grammar(self, tools: list[dict[str, Any]]) -> str:
        """llguidance's Lark grammar of one call to one of `tools`: each function's JSON,
        with its `parameters` schema, is one `%json` alternative."""
        rules = [f"fn{index}: %json {json.dumps(self._call_schema(tool['function']))}"
                 for index, tool in enumerate(tools)]
        call = " | ".join(f"fn{index}" for index in range(len(tools)))
        start = f"start: {json.dumps(self.open)} call {json.dumps(self.close)}" if self.tagged \
            else "start: call"
        return "\n".join([start, f"call: {call}", *rules])

    def _call_schema(self, function: dict[str, Any]) -> dict[str, Any]:
        # The parameters' definitions move to the root, where their `#/$defs/...` references
        # (pydantic writes them) point once the parameters are nested in the call.
        parameters = dict(function["parameters"])
        definitions = {key: parameters.pop(key) for key in DEFINITIONS if key in parameters}
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
            # Laid out as every JSON constraint is (a grammar's `%json` has no defaults).
            "x-guidance": JSON_LAYOUT,
            **definitions,
        }

    def reader(self, names: frozenset[str]) -> ToolCallReader:
        return ToolCallReader(self, names)


class ToolCallReader:
    """Reads the calls (to functions of `names`) out of an answer: whole with `parse`, or as it
    streams with `feed` then `end`, which hold back the text that may still become a call.
    A call that does not parse, or names an unknown function, stays text."""

    def __init__(self, format: ToolCallFormat, names: frozenset[str]) -> None:
        self.format = format
        self.names = names
        self._held = ""
        self._at_start = True  # a bare-JSON call is the whole answer: it must start it
        # Whitespace-only text beside a call is layout, not content: held until text follows.
        self._space = ""
        self._called = False

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside the calls, or None when there is none; the calls). A reader of
        its own reads it, so that this one's stream is left as it was."""
        whole = ToolCallReader(self.format, self.names)
        pieces = [*whole.feed(text), *whole.end()]
        content = "".join(piece for piece in pieces if isinstance(piece, str)).strip()
        calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
        return (content or None) if calls else text, calls

    def feed(self, text: str) -> list[str | ToolCall]:
        """The text and calls that `text`, following what came before, settles."""
        self._held += text
        return self._without_layout(self._settled(final=False), final=False)

    def end(self) -> list[str | ToolCall]:
        """The answer is complete: everything still held, settled."""
        return self._without_layout(self._settled(final=True), final=True)

    def _settled(self, final: bool) -> list[str | ToolCall]:
        if self.format.tagged:
            return self._settled_tagged(final)
        return self._settled_bare(final)

    def _without_layout(self, pieces: list[str | ToolCall], final: bool) -> list[str | ToolCall]:
        """`pieces` less the whitespace-only text between calls."""
        kept: list[str | ToolCall] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                self._space = ""
                self._called = True
            elif not piece.strip():
                self._space += piece
                continue
            else:
                piece, self._space = self._space + piece, ""
            kept.append(piece)
        if final and self._space and not self._called:
            kept.append(self._space)
            self._space = ""
        return kept

    def _settled_tagged(self, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
        while self._held:
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._held, HERMES_OPEN)
                pieces.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            if start:
                pieces.append(self._held[:start])
                self._held = self._held[start:]
            end = self._held.find(HERMES_CLOSE)
            if end < 0:
                if final:
                    pieces.append(self._held)
                    self._held = ""
                break
            block = self._held[:end + len(HERMES_CLOSE)]
            self._held = self._held[len(block):]
            call = self._call(block[len(HERMES_OPEN):-len(HERMES_CLOSE)])
            pieces.append(block if call is None else call)
        return [piece for piece in pieces if piece != ""]

    def _settled_bare(self, final: bool) -> list[str | ToolCall]:
        if self._at_start:
            if not self._held.strip() and not final:
                return []
            if not self._held.lstrip().startswith("{"):
                self._at_start = False
                text, self._held = self._held, ""
                return [text] if text else []
            if not final:
                return []  # an answer that starts with `{` may be a call: wait for all of it
        text, self._held = self._held, ""
        call = self._call(text) if self._at_start else None
        return [call if call is not None else text] if text else []

    def _call(self, text: str) -> ToolCall | None:
        """The call `text` holds (JSON with a known name and object arguments), else None
        (also for JSON nested past the parser's depth: an answer is the model's text)."""
        try:
            found = json.loads(text)
        except (ValueError, RecursionError):
            return None
        name = found.get("name") if isinstance(found, dict) else None
        if not isinstance(name, str) or name not in self.names:
            return None
        arguments = found.get("arguments", found.get("parameters"))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (so may become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
