"""The OpenAI HTTP API's request bodies, read into what the engine takes.

`/v1/completions` and `/v1/chat/completions` bodies are decoded into msgspec Structs (a wrong
type names its field), then checked the way the OpenAI API checks them: one choice only (`n`),
no features the engine lacks (`echo`, `suffix`, `logit_bias`...). Unknown fields are ignored,
as OpenAI-compatible servers do, so newer clients keep working.

A chat request may pass its template more variables in vLLM's `chat_template_kwargs` (e.g.
`{"enable_thinking": false}` for Qwen3), as transformers' apply_chat_template takes them.

Structured output comes as OpenAI's `response_format` or vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`; one request takes one of them (or an
enforced tool call), and its errors name the field the client used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from actors.errors import InvalidRequest
from actors.model.text.chat import CHAT_ROLES, check_template_kwargs
from actors.params import SamplingParams, StructuredOutput, field_of
from actors.serve.tools import ToolCallFormat, ToolChoice, tool_choice

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
# OpenAI's newer clients send `developer` for what chat templates call `system`.
ROLE_ALIASES = {"developer": "system"}
# The roles a request may send, as its role error lists them.
ROLES_TEXT = ", ".join([*CHAT_ROLES, *(f"{alias} (read as {role})"
                                       for alias, role in ROLE_ALIASES.items())])


RequestT = TypeVar("RequestT", bound="_Request")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class _Request(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (None = not given)."""

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
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_Request):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


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
                       prompt=_one_prompt(request.prompt))


def chat_generation(body: bytes, context_length: int,
                    max_tokens_limit: int | None = None) -> Generation:
    """A /v1/chat/completions body; without a limit asked, the answer may run to the end of
    the context (`context_length`), as OpenAI's does. An enforced tool call's grammar is not
    in its params yet: it depends on the chat template (`with_tool_grammar`)."""
    request = decode_body(body, ChatRequest)
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", field="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens, field = _max_tokens({"max_completion_tokens": request.max_completion_tokens,
                                     "max_tokens": request.max_tokens},
                                    context_length, max_tokens_limit)
    # A bad value is named as the client spelled it.
    renamed = {"logprobs": "top_logprobs", "max_tokens": field or "max_tokens"}
    tools = tool_choice(request.tools, request.tool_choice)
    return _generation(request, max_tokens, field, logprobs,
                       messages=chat_messages(request.messages), renamed=renamed,
                       tools=tools if tools is not None and tools.mode != "none" else None,
                       chat_template_kwargs=check_template_kwargs(request.chat_template_kwargs))


def with_tool_grammar(generation: Generation, tool_format: ToolCallFormat) -> Generation:
    """`generation`, its answer held to one call of its tools (as `tool_format` writes calls)
    when its tool_choice is "required" or names a function."""
    tools = generation.tools
    if tools is None or not tools.enforced:
        return generation
    grammar = tool_format.grammar(tools.callable_tools())
    params = msgspec.structs.replace(generation.params,
                                     structured=StructuredOutput(grammar=grammar))
    return msgspec.structs.replace(generation, params=params, structured_field="tools")


def _max_tokens(asked: dict[str, int | None], default: int,
                limit: int | None) -> tuple[int, str | None]:
    """(max_tokens, the field that set it): the first of `asked` the client gave, else `default`
    (within `limit`, and None for the field). A value past `limit` is refused, naming its field."""
    for field, value in asked.items():
        if value is None:
            continue
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
    if request.n not in (None, 1):
        raise InvalidRequest(f"n must be 1 (one choice per request), got {request.n}", field="n")
    if request.logit_bias:
        raise InvalidRequest("logit_bias is not supported", field="logit_bias")
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
    )


def _structured(request: _Request) -> tuple[StructuredOutput | None, str | None]:
    """The request's structured output and the field that asked for it; two fields asking at
    once are refused, naming the second."""
    asked = [(field, constraint) for field in STRUCTURED_FIELDS
             if (constraint := _constraint(field, getattr(request, field))) is not None]
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


def _constraint(field: str, value: Any) -> dict[str, Any] | None:
    """StructuredOutput's arguments for one request field (None: it asks for nothing)."""
    if value is None:
        return None
    if field == "response_format":
        return _response_format(value)
    if field == "guided_json":
        return {"json_schema": _json_object(field, value)}
    if field == "guided_choice":
        return {"choice": tuple(value)}
    return {{"guided_regex": "regex", "guided_grammar": "grammar"}[field]: value}


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
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
        return {"json_schema": dict(schema)}
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got "
                         f"{kind!r}"[:200], field="response_format")


def _json_object(field: str, value: dict[str, Any] | str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
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


def _one_prompt(prompt: str | list[Any]) -> str | list[int]:
    """A text or token-id prompt; a batch of one is unwrapped, larger batches are refused."""
    if isinstance(prompt, str) or all(_is_token_id(token) for token in prompt):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _one_prompt(prompt[0])
    raise InvalidRequest(
        "prompt must be a string or a list of token ids (one prompt per request)", field="prompt"
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: role and text content, an assistant's tool calls
    (their arguments as objects, as templates write them back) and a tool result's call id."""
    return [_chat_message(index, message) for index, message in enumerate(messages)]


def _chat_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise InvalidRequest(
            f"messages[{index}] must be an object with a string role", field="messages"
        )
    if message["role"] not in (*CHAT_ROLES, *ROLE_ALIASES):
        raise InvalidRequest(
            f"messages[{index}] has the role {message['role']!r}; the roles are {ROLES_TEXT}",
            field="messages")
    role = ROLE_ALIASES.get(message["role"], message["role"])
    checked: dict[str, Any] = {"role": role,
                               "content": _text_content(index, message.get("content"))}
    if role == "assistant" and message.get("tool_calls"):
        checked["tool_calls"] = _tool_calls(index, message["tool_calls"])
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        checked["tool_call_id"] = message["tool_call_id"]
    return checked


def _tool_calls(index: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, each function's arguments read from their JSON."""
    field = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequest(f"{field} must be a list of tool calls", field=field)
    checked = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f'{field}: each call must be {{"id": ..., "type": "function", '
                                 '"function": {"name": ..., "arguments": "<JSON>"}}', field=field)
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"{field}: the arguments of {function['name']!r} must be a JSON "
                                 "object (as text)", field=field)
        checked.append({"id": str(call.get("id", "")), "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


def _text_content(index: int, content: Any) -> str:
    """A message's text: a string, null, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(part, Mapping) and part.get("type") == "text"
        and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise InvalidRequest(
        f"messages[{index}].content must be a string or a list of text parts "
        "(this server reads text only)",
        field=f"messages[{index}].content",
    )
