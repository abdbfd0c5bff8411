"""OpenAI's Responses API, `POST /v1/responses`: stateless, over the chat path.

A Responses request is a chat request in another shape. Its `instructions` and `input` items
become chat messages (a `function_call` item an assistant's tool call, a `function_call_output`
item a `tool` message), its flat function tools the chat's `tools`, `text.format` the chat's
`response_format` and `max_output_tokens` its `max_completion_tokens`; `chat_generation` then
checks the whole as it checks a chat, and its errors are renamed to the fields the client sent.
The answer is read as a chat answer is (`ToolCallReader`) and written as output items, a
`message` with one `output_text` part and a `function_call` item per call: whole, or as the
typed events OpenAI streams (`response.created` ... `response.completed`), numbered in order.

The server keeps nothing between requests: `store` is accepted and every response says
`"store": false`; what needs a kept response or conversation (`previous_response_id`,
`conversation`, `background`, a stored `prompt`, `item_reference` items) is refused, saying so.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from functools import partial
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.errors import InvalidRequest, Q4KError, TemplateError
from actors.messages import Chunk, Usage
from actors.serve.app import (
    CLIENT_LEFT,
    EventStream,
    OpenAIServer,
    as_asked,
    cancel_on_disconnect,
    error_response,
    error_status,
    json_response,
)
from actors.serve.metrics import outcome_of
from actors.serve.protocol import (
    SAMPLING_FIELDS,
    Generation,
    chat_generation,
    decode_body,
    with_tool_grammar,
)
from actors.serve.replies import FINISH_REASONS, CountOutcome, answer_text, counting_failures
from actors.serve.tools import CallArguments, CallStart, Piece, ToolCallReader

STATELESS = ("this server keeps no responses or conversations (it is stateless: every "
             "response has store false)")
SEND_IT_ALL = ("send the whole conversation in input: the earlier input items, the earlier "
               "response's output items, then the new ones")
# The one `include` value that asks for something this endpoint could return but does not.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Content parts read as text: a message's own (input_text) and an earlier answer's (output_text).
TEXT_PARTS = ("input_text", "output_text")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TOOL_CHOICE_WORDS = ("auto", "none", "required")
# The fields the chat path names, as the client sent them here (the engine names a chat's
# rendered prompt `prompt`, a field of its own on this endpoint).
SENT_FIELDS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "messages": "input", "prompt": "input"}
# Words of the chat's error messages, as the client sent them here (`messages` is left out:
# it is also a word of other messages, e.g. a template variable's).
SENT_WORDS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
# The chat's tools nest a function's fields in `function`; a Responses tool has them flat.
NESTED_TOOL_FIELD = re.compile(r"(tools\[\d+\])\.function\.")


class TextConfig(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """A /v1/responses body (None = not given); unknown fields are ignored, as on the chat
    endpoint (`service_tier`, `prompt_cache_key`, `safety_identifier`, ... change nothing
    here)."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # The chat endpoint's extensions (vLLM's Responses endpoint takes them too).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused when they ask for something (`_refuse_unsupported` says why).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None


def responses_generation(
    body: bytes, context_length: int, max_tokens_limit: int | None = None,
) -> tuple[ResponsesRequest, Generation]:
    """A /v1/responses body, and the chat generation it asks for (errors name the fields
    sent here); as for `chat_generation`, an enforced call's grammar is added later."""
    request = decode_body(body, ResponsesRequest)
    _refuse_unsupported(request)
    chat_body = msgspec.json.encode(_chat_body(request))
    try:
        generation = chat_generation(chat_body, context_length, max_tokens_limit)
    except InvalidRequest as error:
        raise as_sent(error) from None
    return request, msgspec.structs.replace(
        generation,
        max_tokens_field=_sent_field(generation.max_tokens_field),
        structured_field=_sent_field(generation.structured_field))


def as_sent(error: Q4KError) -> Q4KError:
    """`error` naming the Responses fields where the chat path named its own."""
    if not isinstance(error, InvalidRequest):
        return error
    message = NESTED_TOOL_FIELD.sub(r"\1.", str(error))
    for chat, sent in SENT_WORDS.items():
        message = message.replace(chat, sent)
    field = _sent_field(error.field)
    if (message, field) == (str(error), error.field):
        return error
    return type(error)(message, field=field)


def _sent_field(field: str | None) -> str | None:
    return SENT_FIELDS.get(field, field) if field is not None else None


def _refuse_unsupported(request: ResponsesRequest) -> None:
    """InvalidRequest naming the first field that asks for kept state or for what this
    server does not do, and what to send instead."""
    if request.previous_response_id is not None:
        raise InvalidRequest(f"previous_response_id is not supported: {STATELESS}; "
                             f"{SEND_IT_ALL}", field="previous_response_id")
    if request.conversation is not None:
        raise InvalidRequest(f"conversation is not supported: {STATELESS}; {SEND_IT_ALL}",
                             field="conversation")
    if request.background:
        raise InvalidRequest(f"background is not supported: {STATELESS}, so there would be no "
                             "response to poll; stream the answer (stream: true) instead",
                             field="background")
    if request.prompt is not None:
        raise InvalidRequest(f"prompt (a prompt template kept by OpenAI) is not supported: "
                             f"{STATELESS}; send instructions and input", field="prompt")
    if request.truncation not in (None, "disabled"):
        raise InvalidRequest(f"truncation {request.truncation!r} is not supported: this server "
                             "never drops input to make it fit; input that does not fit the "
                             "context is refused (context_length_exceeded)"[:300],
                             field="truncation")
    if request.reasoning and any(value is not None for value in request.reasoning.values()):
        raise InvalidRequest("reasoning is not supported: this server takes no reasoning effort "
                             "and writes no reasoning summary", field="reasoning")
    if request.top_logprobs or LOGPROBS_INCLUDE in (request.include or ()):
        raise InvalidRequest("logprobs are not returned on /v1/responses; /v1/chat/completions "
                             "returns them (logprobs, top_logprobs)",
                             field="top_logprobs" if request.top_logprobs else "include")


def _chat_body(request: ResponsesRequest) -> dict[str, Any]:
    """The chat request `request` is, as JSON (fields not given left out)."""
    body = {
        "model": request.model,
        "messages": _messages(request.instructions, request.input),
        "stream": request.stream,
        "max_completion_tokens": request.max_output_tokens,
        "tools": _chat_tools(request.tools),
        "tool_choice": _chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request.text),
        "chat_template_kwargs": request.chat_template_kwargs,
        **{name: getattr(request, name) for name in SAMPLING_FIELDS},
    }
    return {field: value for field, value in body.items() if value is not None}


def _messages(instructions: str | None, input: str | list[Any]) -> list[dict[str, Any]]:
    """Chat messages: the instructions as the system message, then the input's items."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = [{"role": "user", "content": input}] if isinstance(input, str) else input
    for index, item in enumerate(items):
        _add_item(messages, f"input[{index}]", item)
    if not messages:
        raise InvalidRequest("input has no items: send a string or at least one message item",
                             field="input")
    return messages


def _add_item(messages: list[dict[str, Any]], where: str, item: Any) -> None:
    if not isinstance(item, Mapping):
        raise InvalidRequest(f"{where} must be an object (an input item)", field=where)
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_message(where, item))
    elif kind == "function_call":
        _add_call(messages, where, item)
    elif kind == "function_call_output":
        messages.append(_call_output(where, item))
    elif kind == "item_reference":
        raise InvalidRequest(f"{where} is an item_reference, which is not supported: "
                             f"{STATELESS}; send the item itself", field=where)
    else:
        raise InvalidRequest(f"{where} has the type {kind!r}; this server reads message, "
                             "function_call and function_call_output items"[:300], field=where)


def _message(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidRequest(f"{where} has the role {role!r}; a message's role is "
                             f"{', '.join(MESSAGE_ROLES)} (a function's result is a "
                             "function_call_output item)"[:300], field=f"{where}.role")
    return {"role": role, "content": _text_content(f"{where}.content", item.get("content"))}


def _add_call(messages: list[dict[str, Any]], where: str, item: Mapping[str, Any]) -> None:
    """A function_call item as an assistant's tool call: on the assistant message before it
    (the calls and text of one answer are one message to a chat template), else a new one."""
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise InvalidRequest(f'{where} must be {{"type": "function_call", "call_id": ..., '
                             '"name": ..., "arguments": "<JSON>"}', field=where)
    arguments = item.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.arguments must be a JSON object, as text",
                             field=f"{where}.arguments")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise InvalidRequest(f"{where}.call_id must be the call_id of the function_call it "
                             "answers", field=f"{where}.call_id")
    return {"role": "tool", "tool_call_id": call_id,
            "content": _text_content(f"{where}.output", item.get("output"))}


def _text_content(where: str, content: Any) -> str:
    """A string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, Mapping) and part.get("type") in TEXT_PARTS
        and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise InvalidRequest(f"{where} must be a string or a list of input_text (or output_text) "
                         "parts: this server reads text only", field=where)


def _chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", ...}`) in the chat's shape
    (`{"type": "function", "function": {"name", ...}}`), which the chat path checks."""
    if tools is None:
        return None
    chat_tools = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise InvalidRequest(f"tools[{index}] has the type {kind!r}; this server has "
                                 'function tools only ("type": "function"; hosted tools such '
                                 "as web_search or file_search run at OpenAI)"[:300],
                                 field="tools")
        # `strict` is left out: as on the chat endpoint, a call is held to its schema when
        # it is enforced (tool_choice required or naming it).
        function = {field: tool[field] for field in ("name", "description", "parameters")
                    if tool.get(field) is not None}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in TOOL_CHOICE_WORDS:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest('tool_choice must be "auto", "none", "required" or {"type": '
                         '"function", "name": ...}', field="tool_choice")


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as the chat's `response_format`."""
    text_format = text.format if text is not None else None
    if text_format is None:
        return None
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(text_format.get("schema"), Mapping):
            raise InvalidRequest('text.format of type "json_schema" needs "schema": a JSON '
                                 "schema object", field="text.format")
        return {"type": "json_schema", "json_schema": {"schema": text_format["schema"]}}
    raise InvalidRequest(f"text.format.type must be text, json_object or json_schema, got "
                         f"{kind!r}"[:200], field="text.format")


def _echo(request: ResponsesRequest, generation: Generation) -> dict[str, Any]:
    """What a Response repeats of its request: settings as they were applied."""
    text_format = request.text.format if request.text is not None else None
    return {
        "model": request.model,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": generation.params.temperature,
        "top_p": generation.params.top_p,
        "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto",
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": {"format": text_format or {"type": "text"}},
        "truncation": "disabled",
        "metadata": request.metadata or {},
        "user": request.user,
        "previous_response_id": None,
        "background": False,
        "store": False,
    }


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseWriter:
    """One response's output, built as the answer settles (text, function calls): the
    events OpenAI streams for it, numbered, and the Response object they end with
    (`response()`, also the whole reply). Text goes into an open `message` item, which a call
    or the end closes; a call is a `function_call` item, its arguments streamed in pieces as
    the model writes them."""

    def __init__(self, echo: dict[str, Any], calls: ToolCallReader | None) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.status = "in_progress"
        self._created_at = int(time.time())
        self._echo = echo
        self._calls = calls
        self._output: list[dict[str, Any]] = []  # the items done
        self._message_id: str | None = None  # the open message's
        self._message_texts: list[str] = []
        self._call: dict[str, Any] | None = None  # the open function_call item
        self._call_arguments: list[str] = []
        self._usage: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None
        self._sequence = 0

    def response(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self._created_at,
            "status": self.status,
            "error": self._error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if self.status == "incomplete" else None),
            "output": list(self._output),
            "usage": self._usage,
            **self._echo,
        }

    def started(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def settle(self, chunk: Chunk, final: bool) -> list[dict[str, Any]]:
        """The events of the answer's next chunk (`final`: the answer ends with it): text
        that may still become a call waits until it is decided."""
        text = answer_text(chunk, self._calls)
        if self._calls is None:
            pieces: list[Piece] = [text] if text else []
        else:
            pieces = self._calls.feed_pieces(text) + (self._calls.end_pieces() if final else [])
        events: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, str):
                events += self._write_text(piece)
            elif isinstance(piece, CallStart):
                events += self._open_call(piece)
            elif isinstance(piece, CallArguments):
                events += self._write_arguments(piece.text)
            else:
                events += self._close_call()
        return events

    def finished(self, finish: str, usage: Usage) -> list[dict[str, Any]]:
        """The last events: the open message closed (an answer of nothing is one empty
        message), then `response.completed`, or `response.incomplete` when the answer ran
        out of tokens (`finish` "length")."""
        complete = finish != "length"
        events = self._open_message() if self._message_id is None and not self._output else []
        if self._message_id is not None:
            events += self._close_message("completed" if complete else "incomplete")
        self.status = "completed" if complete else "incomplete"
        self._usage = _usage(usage)
        return events + [self._event(f"response.{self.status}", response=self.response())]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An answer that failed midway: an `error` event (OpenAI's error object's fields),
        then `response.failed` with what was done."""
        self.status = "failed"
        self._error = {"code": "server_error", "message": error["message"]}
        return [self._event("error", code=error["code"], message=error["message"],
                            param=error["param"]),
                self._event("response.failed", response=self.response())]

    def _write_text(self, text: str) -> list[dict[str, Any]]:
        events = self._open_message() if self._message_id is None else []
        self._message_texts.append(text)
        return events + [self._event("response.output_text.delta", **self._in_message(),
                                     delta=text, logprobs=[])]

    def _open_message(self) -> list[dict[str, Any]]:
        self._message_id = "msg_" + uuid.uuid4().hex
        self._message_texts = []
        return [
            self._event("response.output_item.added", output_index=len(self._output),
                        item=self._message_item("in_progress", None)),
            self._event("response.content_part.added", **self._in_message(),
                        part=_text_part("")),
        ]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        text = "".join(self._message_texts)
        item = self._message_item(status, text)
        events = [
            self._event("response.output_text.done", **self._in_message(), text=text,
                        logprobs=[]),
            self._event("response.content_part.done", **self._in_message(),
                        part=_text_part(text)),
            self._event("response.output_item.done", output_index=len(self._output), item=item),
        ]
        self._output.append(item)
        self._message_id = None
        return events

    def _message_item(self, status: str, text: str | None) -> dict[str, Any]:
        return {"id": self._message_id, "type": "message", "status": status,
                "role": "assistant", "content": [] if text is None else [_text_part(text)]}

    def _in_message(self) -> dict[str, Any]:
        """Where a message event points: the open message's one text part."""
        return {"item_id": self._message_id, "output_index": len(self._output),
                "content_index": 0}

    def _open_call(self, start: CallStart) -> list[dict[str, Any]]:
        """A call begins (its id and function known): the message before it is closed."""
        events = self._close_message("completed") if self._message_id is not None else []
        self._call = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call",
                      "status": "in_progress", "arguments": "", "call_id": start.id,
                      "name": start.name}
        self._call_arguments = []
        return events + [self._event("response.output_item.added",
                                     output_index=len(self._output), item=dict(self._call))]

    def _write_arguments(self, text: str) -> list[dict[str, Any]]:
        self._call_arguments.append(text)
        return [self._event("response.function_call_arguments.delta", **self._in_call(),
                            delta=text)]

    def _close_call(self) -> list[dict[str, Any]]:
        arguments = "".join(self._call_arguments)
        item = {**self._call, "status": "completed", "arguments": arguments}
        events = [
            self._event("response.function_call_arguments.done", **self._in_call(),
                        arguments=arguments),
            self._event("response.output_item.done", output_index=len(self._output), item=item),
        ]
        self._output.append(item)
        self._call = None
        return events

    def _in_call(self) -> dict[str, Any]:
        """Where a call's events point: the open function_call item."""
        return {"item_id": self._call["id"], "output_index": len(self._output)}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def response_event(event: dict[str, Any]) -> bytes:
    """A server-sent event as OpenAI sends Responses events: named by its type."""
    return (b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event)
            + b"\n\n")


class ResponsesEndpoint:
    """`POST /v1/responses` on an `OpenAIServer`: its engine, chat template, tool-call format
    and metrics, as its chat endpoint uses them."""

    def __init__(self, server: OpenAIServer) -> None:
        self._server = server

    async def create(self, request: Request) -> Response | EventStream:
        server = self._server
        generation = None
        try:
            engine = server.ready_engine()
            if not server.options.chat_available:
                raise TemplateError(
                    f"the model {server.model_name!r} has no chat template, so this server "
                    "cannot answer /v1/responses: restart `q4k serve` with --template FILE (a "
                    "Jinja chat template for this model), or send plain text to /v1/completions")
            asked, generation = await server.converted(await request.body(), partial(
                responses_generation, context_length=engine.context_length,
                max_tokens_limit=server.options.max_tokens_limit))
            if generation.model != server.model_name:
                raise server.unknown_model(generation.model)
            calls = None
            if generation.tools is not None:
                tool_format = await server.tool_call_format(engine)
                generation = with_tool_grammar(generation, tool_format)
                calls = tool_format.reader(generation.tools.names,
                                           generation.tools.parallel)
            chunks = server.start(engine, generation)
        except Q4KError as exc:
            server.metrics.count(outcome_of(exc))
            # Before there is a generation, errors already name the fields sent here.
            return _refusal(exc if generation is None else _engine_error(exc, generation))
        answer = _Answer(ResponseWriter(_echo(asked, generation), calls), chunks,
                         server.metrics.count)
        try:
            if generation.stream:
                first = await cancel_on_disconnect(request.receive, answer.first)
                return CLIENT_LEFT if first is None else EventStream(answer.stream(first))
            whole = await cancel_on_disconnect(request.receive, answer.whole)
        except Q4KError as exc:  # the answer counted it
            await chunks.aclose()
            return _refusal(_engine_error(exc, generation))
        return CLIENT_LEFT if whole is None else json_response(whole)


class _Answer:
    """One request's answer written by `writer`: `whole()`, or `first()` then `stream(...)`.
    Its outcome is counted once, as a chat answer's is."""

    def __init__(self, writer: ResponseWriter, chunks: AsyncIterator[Chunk],
                 count: CountOutcome) -> None:
        self._writer = writer
        self._chunks = chunks
        self._count = count

    async def first(self) -> Chunk:
        """The first chunk, taken before a stream answers 200 (so that admission and compute
        errors still get their own status codes)."""
        with counting_failures(self._count):
            return await anext(self._chunks)

    async def whole(self) -> dict[str, Any]:
        """The Response object, once the answer is complete."""
        async for _ in self._events(await self.first()):
            pass
        return self._writer.response()

    async def stream(self, first: Chunk) -> AsyncIterator[bytes]:
        """The events as sent; a failure midway ends them with `error` and `response.failed`."""
        try:
            async for event in self._events(first):
                yield response_event(event)
        except Q4KError as exc:
            for event in self._writer.failed(error_status(as_sent(exc))[1]["error"]):
                yield response_event(event)

    async def _events(self, first: Chunk) -> AsyncIterator[dict[str, Any]]:
        writer = self._writer
        chunk = first
        with counting_failures(self._count):
            async with aclosing(self._chunks):
                for event in writer.started():
                    yield event
                while True:
                    finish = FINISH_REASONS.get(chunk.finish_reason or "")
                    for event in writer.settle(chunk, final=finish is not None):
                        yield event
                    if finish:
                        break
                    chunk = await anext(self._chunks)
        self._count(finish, chunk.usage)
        for event in writer.finished(finish, chunk.usage):
            yield event


def _engine_error(exc: Q4KError, generation: Generation) -> Q4KError:
    """An error of the engine's, naming the fields sent here."""
    return as_sent(as_asked(exc, generation))


def _refusal(exc: Q4KError) -> Response:
    """The error response; a template's refusal names `input` (the chat's names `messages`)."""
    if not isinstance(exc, TemplateError):
        return error_response(exc)
    status, body = error_status(exc)
    body["error"]["param"] = "input"
    return json_response(body, status)
