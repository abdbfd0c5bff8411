"""The OpenAI HTTP API's request bodies, read into what the engine takes.

`/v1/completions` and `/v1/chat/completions` bodies are decoded into msgspec Structs (a wrong
type names its field), then checked the way the OpenAI API checks them: each field within the
range OpenAI takes it in (`temperature` in [0, 2]...), no features the engine lacks (`echo`,
`suffix`...). `n` answers share the prompt (the engine bounds it); `logit_bias` maps token
ids, as strings, to biases in [-100, 100]. Unknown fields are ignored,
as OpenAI-compatible servers do, so newer clients keep working.

What a body builds is bounded before it is built. Unknown fields are skipped unread; fields
that may be large or nested (the prompt, the messages, the tools, schemas, template variables)
stay undecoded (`msgspec.Raw`) until their length or size is checked, and are then read a
piece at a time: a list longer than the context has tokens, or a schema past its size, is
refused having built nothing (a few MB of nested JSON would otherwise build millions of Python
objects, and the garbage collector's passes over them would hold every thread).

A chat request may pass its template more variables in vLLM's `chat_template_kwargs` (e.g.
`{"enable_thinking": false}` for Qwen3), as transformers' apply_chat_template takes them, and
cap a thinking model's reasoning with `reasoning_budget` (tokens; then the reasoning's end
marker is forced: actors.reasoning).

Structured output comes as OpenAI's `response_format` or vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`; one request takes one of them (or an
enforced tool call), and its errors name the field the client used. A JSON schema's numbers
are bounded in length where it gives no bounds (`actors.serve.schemas`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from actors.errors import ContextLengthExceeded, InvalidRequest
from actors.model.text.chat import (
    CHAT_ROLES,
    MAX_TEMPLATE_KWARGS_CHARS,
    TEMPLATE_KWARGS_FIELD,
    check_template_kwargs,
)
from actors.params import (
    LOGIT_BIAS_RANGE,
    MAX_CONSTRAINT_CHARS,
    SamplingParams,
    StructuredOutput,
    field_of,
)
from actors.serve.schemas import bounded_numbers
from actors.serve.tools import (
    MAX_TOOLS_JSON_BYTES,
    ToolCallFormat,
    ToolChoice,
    check_tool_count,
    tool_choice,
)

# OpenAI's default for /v1/completions; chat answers run to the end of the context instead.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Request fields that are SamplingParams fields of the same name and meaning.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "ignore_eos",
)
# The request fields that ask for structured output, in the order a conflict names them.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
# The ranges the OpenAI API takes its fields in: a value outside is a 400 naming the field here,
# before the library's own checks (SamplingParams), which are wider where the engine can do more.
OPENAI_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0),
                 "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
MAX_TOP_LOGPROBS = 20
# A token id as logit_bias spells it: more digits than any vocabulary's ids is no token.
MAX_TOKEN_ID_DIGITS = 10
# OpenAI's newer clients send `developer` for what chat templates call `system`.
ROLE_ALIASES = {"developer": "system"}
# The roles a request may send, as its role error lists them.
ROLES_TEXT = ", ".join([*CHAT_ROLES, *(f"{alias} (read as {role})"
                                       for alias, role in ROLE_ALIASES.items())])
# The most JSON a field may take as sent before it is read: twice what its value may take
# compact (a schema MAX_CONSTRAINT_CHARS, template variables MAX_TEMPLATE_KWARGS_CHARS, the
# tools MAX_TOOLS_JSON_BYTES), for indentation and spaces.
AS_SENT = 2
# tool_choice names one function: {"type": "function", "function": {"name": <64 characters>}}.
MAX_TOOL_CHOICE_JSON_BYTES = 1 << 10
# A tool call's arguments, as JSON: a megabyte of JSON is some 300k tokens, more than the
# contexts this engine runs hold.
MAX_ARGUMENTS_JSON_BYTES = 1 << 20
# JSON is read into Python objects at most this much in one call (one call holds every thread
# while it builds; 256 KiB of nested arrays, some 10 ms); a larger array or object is read an
# item at a time, down to this many levels.
JSON_PIECE_BYTES = 256 << 10
JSON_PIECE_LEVELS = 8


RequestT = TypeVar("RequestT", bound="_Request")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class _Request(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (None, or an empty Raw, = not given)."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    # Extensions other OpenAI-compatible servers (vLLM, llama.cpp) accept too.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    # Structured output: OpenAI's field, and vLLM's.
    response_format: msgspec.Raw = msgspec.Raw()
    guided_json: msgspec.Raw = msgspec.Raw()
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Request):
    prompt: msgspec.Raw
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_Request):
    messages: list[msgspec.Raw]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[msgspec.Raw] | None = None
    tool_choice: msgspec.Raw = msgspec.Raw()
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    # At most this many reasoning tokens, then the reasoning's end marker is forced.
    reasoning_budget: int | None = None


class _Message(msgspec.Struct, gc=False):
    """A chat message as sent: what this server reads of it (the rest is skipped unread;
    what may be large stays undecoded until its length is checked)."""

    role: str | None = None
    content: msgspec.Raw = msgspec.Raw()
    tool_calls: msgspec.Raw = msgspec.Raw()
    tool_call_id: msgspec.Raw = msgspec.Raw()


class _TextPart(msgspec.Struct, gc=False):
    type: str | None = None
    text: str | None = None


class _CalledFunction(msgspec.Struct, gc=False):
    name: str
    arguments: msgspec.Raw = msgspec.Raw()


class _SentToolCall(msgspec.Struct, gc=False):
    function: _CalledFunction
    id: str | int | None = None


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """One request, ready for the engine: a prompt (text or token ids) or chat messages.
    `max_tokens_field` names the field that set `params.max_tokens` (None: the client set none,
    so the server's default applies)."""

    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_field: str | None = None
    # The request field that asked for `params.structured` (its errors name it).
    structured_field: str | None = None
    # The request's tools (None: none, or tool_choice "none": the template does not see them).
    tools: ToolChoice | None = None
    # A chat's more variables for its template (checked: names, JSON values).
    chat_template_kwargs: dict[str, Any] | None = None
    # A chat's budget of reasoning tokens (None: none).
    reasoning_budget: int | None = None
    # How many answers to the prompt (the engine bounds it).
    n: int = 1


def decode_body(body: bytes, kind: type[RequestT]) -> RequestT:
    """The request body as `kind`; malformed JSON or a wrongly typed field is InvalidRequest."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        raise InvalidRequest(str(error), field=field_of(error)) from None
    except msgspec.DecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None
    except RecursionError:  # msgspec's depth limit, even in a field that would be ignored
        raise InvalidRequest("the request body nests JSON deeper than this server reads") from None


def completion_generation(body: bytes, max_tokens_limit: int | None = None) -> Generation:
    """A /v1/completions body; `max_tokens_limit`: the most tokens one request may ask for."""
    request = decode_body(body, CompletionRequest)
    _refuse_set(request, echo=bool(request.echo), suffix=request.suffix is not None,
                best_of=request.best_of not in (None, 1))
    max_tokens, field = _max_tokens({"max_tokens": request.max_tokens},
                                    COMPLETIONS_DEFAULT_MAX_TOKENS, max_tokens_limit)
    return _generation(request, max_tokens, field, request.logprobs,
                       prompt=one_prompt(request.prompt))


def chat_generation(body: bytes, context_length: int,
                    max_tokens_limit: int | None = None) -> Generation:
    """A /v1/chat/completions body; without a limit asked, the answer may run to the end of
    the context (`context_length`), as OpenAI's does. An enforced tool call's grammar is not
    in its params yet: it depends on the chat template (`with_tool_grammar`)."""
    request = decode_body(body, ChatRequest)
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got "
                             f"{request.top_logprobs}", field="top_logprobs")
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", field="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens, field = _max_tokens({"max_completion_tokens": request.max_completion_tokens,
                                     "max_tokens": request.max_tokens},
                                    context_length, max_tokens_limit)
    # A bad value is named as the client spelled it.
    renamed = {"logprobs": "top_logprobs", "max_tokens": field or "max_tokens"}
    tools = _tool_choice(request)
    generation = _generation(request, max_tokens, field, logprobs,
                             messages=chat_messages(request.messages, context_length),
                             renamed=renamed,
                             tools=tools if tools is not None and tools.mode != "none" else None,
                             chat_template_kwargs=template_kwargs(request))
    return msgspec.structs.replace(generation, reasoning_budget=request.reasoning_budget)


def template_kwargs(request: ChatRequest) -> dict[str, Any]:
    """The request's chat_template_kwargs, checked (empty where it has none)."""
    return check_template_kwargs(_read_field(
        request.chat_template_kwargs, TEMPLATE_KWARGS_FIELD,
        AS_SENT * MAX_TEMPLATE_KWARGS_CHARS))


def _tool_choice(request: ChatRequest) -> ToolChoice | None:
    """The request's tools, counted and sized before any is read, and its tool_choice."""
    choice = _read_field(request.tool_choice, "tool_choice", MAX_TOOL_CHOICE_JSON_BYTES)
    if request.tools is None:
        return tool_choice(None, choice, request.parallel_tool_calls)
    check_tool_count(len(request.tools))
    _check_json_size("tools", sum(map(len, request.tools)), AS_SENT * MAX_TOOLS_JSON_BYTES,
                     field="tools")
    return tool_choice([read_json(tool) for tool in request.tools], choice,
                       request.parallel_tool_calls)


def _read_field(raw: msgspec.Raw, field: str, max_bytes: int) -> Any:
    """A field left undecoded (None where it is absent), read once its JSON is known to take
    at most `max_bytes`: a larger one is refused having built nothing."""
    if not raw:
        return None
    _check_json_size(field, len(raw), max_bytes, field=field)
    return read_json(raw)


def read_json(data: bytes | msgspec.Raw, levels: int = JSON_PIECE_LEVELS) -> Any:
    """JSON `data` (valid) as Python objects, as msgspec.json.decode reads it, but an array or
    object larger than JSON_PIECE_BYTES an item at a time, each item a call of its own: no
    single call holds the GIL while it builds hundreds of thousands of objects."""
    if len(data) <= JSON_PIECE_BYTES or not levels:
        return msgspec.json.decode(data)
    try:
        items = msgspec.json.decode(data, type=list[msgspec.Raw])
    except msgspec.ValidationError:
        pass
    else:
        return [read_json(item, levels - 1) for item in items]
    try:
        members = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        return msgspec.json.decode(data)  # a string or a number: one copy
    return {key: read_json(value, levels - 1) for key, value in members.items()}


def _check_json_size(what: str, size: int, max_bytes: int, field: str) -> None:
    if size > max_bytes:
        raise InvalidRequest(f"{what}: {size:,} bytes of JSON; this server reads at most "
                             f"{max_bytes:,}", field=field)


def with_tool_grammar(generation: Generation, tool_format: ToolCallFormat) -> Generation:
    """`generation`, its answer held to what its tools allow as `tool_format` writes calls
    (`ToolCallFormat.constraint`: the calls, where tool_choice is "required" or names a
    function), unless another field already constrains it."""
    tools = generation.tools
    if tools is None or generation.params.structured is not None:
        return generation
    structured = tool_format.constraint(tools)
    if structured is None:
        return generation
    params = msgspec.structs.replace(generation.params, structured=structured)
    return msgspec.structs.replace(generation, params=params, structured_field="tools")


def _max_tokens(asked: dict[str, int | None], default: int,
                limit: int | None) -> tuple[int, str | None]:
    """(max_tokens, the field that set it): the first of `asked` the client gave, else `default`
    (within `limit`, and None for the field). A value past `limit` is refused, naming its field."""
    for field, value in asked.items():
        if value is None:
            continue
        if value < 1:
            raise InvalidRequest(f"{field} must be at least 1, got {value}", field=field)
        if limit is not None and value > limit:
            raise InvalidRequest(
                f"{field} is {value}, more than this server allows one request ({limit}; "
                "q4k serve --max-tokens-limit)", field=field)
        return value, field
    return (default if limit is None else min(default, limit)), None


def _generation(
    request: _Request,
    max_tokens: int,
    max_tokens_field: str | None,
    logprobs: int | None,
    *,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    renamed: dict[str, str] | None = None,
    tools: ToolChoice | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Generation:
    _check_ranges(request)
    structured, structured_field = _structured(request)
    if structured is not None and tools is not None and tools.enforced:
        raise InvalidRequest(f"tool_choice {tools.mode!r} and {structured_field} both constrain "
                             "the answer; send one", field="tool_choice")
    given = {name: getattr(request, name) for name in SAMPLING_FIELDS}
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    try:
        params = SamplingParams(
            **{name: value for name, value in given.items() if value is not None},
            max_tokens=max_tokens,
            stop=tuple(stop),
            logprobs=logprobs,
            structured=structured,
            logit_bias={int(token): bias for token, bias in request.logit_bias.items()}
            if request.logit_bias else None,
        )
    except InvalidRequest as error:
        field = (renamed or {}).get(error.field, error.field)
        if field == error.field:
            raise
        raise InvalidRequest(f"{field}: {error}", field=field) from None
    options = request.stream_options
    return Generation(
        model=request.model,
        prompt=prompt,
        messages=messages,
        params=params,
        stream=bool(request.stream),
        include_usage=bool(options and options.include_usage),
        max_tokens_field=max_tokens_field,
        structured_field=structured_field,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        n=request.n or 1,
    )


def _check_ranges(request: _Request) -> None:
    """InvalidRequest naming the first field outside the range the OpenAI API takes it in."""
    for field, (low, high) in OPENAI_RANGES.items():
        value = getattr(request, field)
        if value is not None and not low <= value <= high:
            raise InvalidRequest(f"{field} must be in [{low:g}, {high:g}], got {value:g}",
                                 field=field)
    if request.n is not None and request.n < 1:
        raise InvalidRequest(f"n must be at least 1, got {request.n}", field="n")
    low, high = LOGIT_BIAS_RANGE
    for token, bias in (request.logit_bias or {}).items():
        if not (token.isascii() and token.isdigit() and len(token) <= MAX_TOKEN_ID_DIGITS):
            raise InvalidRequest(f"logit_bias maps token ids to biases; {token[:40]!r} is not a "
                                 "token id", field="logit_bias")
        if not low <= bias <= high:
            raise InvalidRequest(f"logit_bias of token {token} must be in [{low:g}, {high:g}], "
                                 f"got {bias:g}", field="logit_bias")


def _structured(request: _Request) -> tuple[StructuredOutput | None, str | None]:
    """The request's structured output and the field that asked for it; two fields asking at
    once are refused, naming the second."""
    asked = [(field, constraint) for field in STRUCTURED_FIELDS
             if (constraint := _constraint(field, _structured_value(request, field))) is not None]
    if not asked:
        return None, None
    if len(asked) > 1:
        (first, _), (second, _) = asked[:2]
        raise InvalidRequest(f"{first} and {second} both constrain the answer; send one",
                             field=second)
    field, constraint = asked[0]
    try:
        return StructuredOutput(**constraint), field
    except InvalidRequest as error:
        raise InvalidRequest(f"{field}: {error}", field=field) from None


def _structured_value(request: _Request, field: str) -> Any:
    """A structured-output field's value; a schema is read once its size is checked."""
    if field == "response_format":
        return _read_field(request.response_format, field, AS_SENT * MAX_CONSTRAINT_CHARS)
    if field == "guided_json":
        return _read_field(request.guided_json, field, AS_SENT * MAX_CONSTRAINT_CHARS)
    return getattr(request, field)


def _constraint(field: str, value: Any) -> dict[str, Any] | None:
    """StructuredOutput's arguments for one request field (None: it asks for nothing)."""
    if value is None:
        return None
    if field == "response_format":
        return _response_format(value)
    if field == "guided_json":
        return {"json_schema": bounded_numbers(_json_object(field, value))}
    if field == "guided_choice":
        return {"choice": tuple(value)}
    return {{"guided_regex": "regex", "guided_grammar": "grammar"}[field]: value}


def _response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping):
        raise InvalidRequest('response_format must be an object: {"type": "text"}, {"type": '
                             '"json_object"} or {"type": "json_schema", ...}',
                             field="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        described = value.get("json_schema")
        schema = described.get("schema") if isinstance(described, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidRequest('response_format of type "json_schema" needs "json_schema": '
                                 '{"name": ..., "schema": {...}}', field="response_format")
        return {"json_schema": bounded_numbers(schema)}
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got "
                         f"{kind!r}"[:200], field="response_format")


def _json_object(field: str, value: Any) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = _read_json_text(value)
        except (ValueError, RecursionError) as error:
            raise InvalidRequest(f"{field} is not JSON: {error}", field=field) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must be a JSON schema object", field=field)
    return value


def _refuse_set(request: _Request, **unsupported: bool) -> None:
    """InvalidRequest naming the first field that asks for something the engine lacks."""
    for field, asked in unsupported.items():
        if asked:
            raise InvalidRequest(f"{field} is not supported by this server", field=field)


def one_prompt(raw: msgspec.Raw) -> str | list[int]:
    """A completion's prompt: a text or token ids; a batch of one is unwrapped, larger batches
    are refused. Each level is read as a text or ids first, else only as far as its length."""
    while True:
        try:
            return msgspec.json.decode(raw, type=str | list[int])
        except msgspec.ValidationError:
            pass
        try:
            batch = msgspec.json.decode(raw, type=list[msgspec.Raw])
        except msgspec.ValidationError:
            batch = []
        if len(batch) != 1:
            raise InvalidRequest("prompt must be a string or a list of token ids (one prompt "
                                 "per request)", field="prompt")
        raw = batch[0]


def chat_messages(messages: Sequence[msgspec.Raw], context_length: int) -> list[dict[str, Any]]:
    """Messages as chat templates take them: role and text content, an assistant's tool calls
    (their arguments as objects, as templates write them back) and a tool result's call id.
    A list in the chat (the messages, a message's text parts or tool calls) longer than the
    context has tokens is refused from its length, unread: a message or a call writes at least
    one token, and no chat has more text parts than that."""
    _check_length(len(messages), "messages", context_length)
    return [_chat_message(index, message, context_length)
            for index, message in enumerate(messages)]


def _check_length(count: int, field: str, context_length: int) -> None:
    if count >= context_length:
        raise ContextLengthExceeded(
            f"{field} has {count:,} items; the context holds {context_length:,} tokens, and a "
            "chat's lists may hold at most one item a token", field=field)


def _chat_message(index: int, raw: msgspec.Raw, context_length: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    try:
        message = msgspec.json.decode(raw, type=_Message)
    except msgspec.ValidationError:
        message = None
    if message is None or message.role is None:
        raise InvalidRequest(f"{where} must be an object with a string role", field="messages")
    if message.role not in (*CHAT_ROLES, *ROLE_ALIASES):
        raise InvalidRequest(
            f"{where} has the role {message.role!r}; the roles are {ROLES_TEXT}",
            field="messages")
    role = ROLE_ALIASES.get(message.role, message.role)
    checked: dict[str, Any] = {"role": role,
                               "content": _text_content(where, message.content, context_length)}
    calls = _tool_calls(where, message.tool_calls, context_length) if role == "assistant" else []
    if calls:
        checked["tool_calls"] = calls
    call_id = _string_or_none(message.tool_call_id)
    if role == "tool" and call_id is not None:
        checked["tool_call_id"] = call_id
    return checked


def _string_or_none(raw: msgspec.Raw) -> str | None:
    try:
        return msgspec.json.decode(raw, type=str) if raw else None
    except msgspec.ValidationError:
        return None


def _tool_calls(where: str, raw: msgspec.Raw, context_length: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, each function's arguments read from their JSON."""
    field = f"{where}.tool_calls"
    try:
        calls = (msgspec.json.decode(raw, type=list[msgspec.Raw] | None) if raw else None) or []
    except msgspec.ValidationError:
        raise InvalidRequest(f"{field} must be a list of tool calls", field=field) from None
    _check_length(len(calls), field, context_length)
    return [_tool_call(field, call) for call in calls]


def _tool_call(field: str, raw: msgspec.Raw) -> dict[str, Any]:
    try:
        call = msgspec.json.decode(raw, type=_SentToolCall)
    except msgspec.ValidationError:
        raise InvalidRequest(f'{field}: each call must be {{"id": ..., "type": "function", '
                             '"function": {"name": ..., "arguments": "<JSON>"}}',
                             field=field) from None
    name = call.function.name
    arguments = _arguments(f"{field}: the arguments of {name!r}", call.function.arguments, field)
    return {"id": "" if call.id is None else str(call.id), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(what: str, raw: msgspec.Raw, field: str) -> dict[str, Any]:
    """A call's arguments: a JSON object, or its JSON text (as OpenAI sends them)."""
    if not raw:
        return {}
    _check_json_size(what, len(raw), MAX_ARGUMENTS_JSON_BYTES, field=field)
    arguments = read_json(raw)
    try:
        arguments = _read_json_text(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{what} must be a JSON object (as text)", field=field)
    return arguments


def _read_json_text(text: str) -> Any:
    """The value JSON `text` holds, read as `read_json` reads it; ValueError (or, nested too
    deep, RecursionError) where it is not JSON."""
    data = text.encode("utf-8", errors="surrogatepass")
    msgspec.json.decode(data, type=msgspec.Raw)  # checked whole before anything is built
    return read_json(data)


def _text_content(where: str, raw: msgspec.Raw, context_length: int) -> str:
    """A message's text: a string, null, or a list of text parts (joined)."""
    field = f"{where}.content"
    try:
        content = msgspec.json.decode(raw, type=str | list[msgspec.Raw] | None) if raw else None
    except msgspec.ValidationError:
        raise _not_text(field) from None
    if not isinstance(content, list):
        return content or ""
    _check_length(len(content), field, context_length)
    texts = []
    for part in content:
        try:
            text = msgspec.json.decode(part, type=_TextPart)
        except msgspec.ValidationError:
            raise _not_text(field) from None
        if text.type != "text" or text.text is None:
            raise _not_text(field)
        texts.append(text.text)
    return "".join(texts)


def _not_text(field: str) -> InvalidRequest:
    return InvalidRequest(f"{field} must be a string or a list of text parts (this server "
                          "reads text only)", field=field)
