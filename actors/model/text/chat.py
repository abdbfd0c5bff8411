"""Chat templates: a model's `tokenizer.chat_template` (Jinja) rendered like transformers does.

Templates come from model files, so they are untrusted code: they run in the counting sandbox
of `sandbox`. Every failure is a `TemplateError` saying what went wrong.

A render is also bounded (`RenderLimits`): in time, by a watchdog that raises inside the
rendering thread once the deadline passes (a pure-Python loop without any call cannot be
stopped otherwise), and in size and memory, by the sandbox that counts what it builds.
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2

from actors.errors import InvalidRequest, TemplateError
from actors.model.gguf.string_array import StringArray
from actors.model.text.sandbox import (
    GLOBAL_NAMES,
    RenderLimits,
    _Budget,
    _RenderTimeout,
    _SharedMemory,
    _environment,
)

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# Real chat templates are a few KB; the largest known are ~20 KB.
MAX_TEMPLATE_CHARS = 1 << 18
# All renders in flight together (each in its own worker thread) build at most this many bytes.
ALL_RENDERS_MEMORY = 1 << 29

_ALL_RENDERS = _SharedMemory(ALL_RENDERS_MEMORY)

# The variables every render passes itself (transformers' apply_chat_template names).
RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
# Names extra template variables may not take: the render's own, and the template's functions.
RESERVED_TEMPLATE_NAMES = frozenset(RENDER_VARIABLES) | GLOBAL_NAMES
# Extra template variables are a few switches (enable_thinking, a date, a persona): as JSON
# they may take about this many characters, nested this deep.
MAX_TEMPLATE_KWARGS_CHARS = 1 << 16
MAX_TEMPLATE_KWARGS_DEPTH = 32
TEMPLATE_KWARGS_FIELD = "chat_template_kwargs"


class ChatTemplate:
    """A compiled chat template; `render(messages)` gives the prompt text. `now` is the clock
    the template's `strftime_now` reads (the local time; tests pin it)."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str,
                 now: Callable[[], datetime] = datetime.now) -> None:
        if not isinstance(source, str):
            raise TemplateError(f"the chat template must be a string, not {type(source).__name__}")
        if not source.strip():
            raise TemplateError("the chat template is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(
                f"the chat template has {len(source):,} characters; at most "
                f"{MAX_TEMPLATE_CHARS:,} are allowed"
            )
        self._environment = _environment(now)
        try:
            self._template = self._environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise TemplateError(
                f"chat template has a syntax error at line {error.lineno}: {error.message}"
            ) from None
        except TemplateError:
            raise
        except Exception as error:  # the compiler's own limits: nesting, recursion, memory
            raise TemplateError(
                f"chat template cannot be compiled: {type(error).__name__}: {error}"[:500]
            ) from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Templates written for tools read a `tools` variable; one that never names it would
        # drop the tools silently.
        self.renders_tools = _TOOLS_VARIABLE.search(source) is not None

    @classmethod
    def from_model_metadata(cls, gguf_file: Any, override: str | None = None) -> ChatTemplate:
        """The model's own template (metadata `tokenizer.chat_template`), or `override`."""
        metadata: Mapping[str, Any] = gguf_file.metadata
        source = override if override is not None else metadata.get(CHAT_TEMPLATE_KEY)
        if source is None:
            raise TemplateError(
                f"the model has no chat template (no {CHAT_TEMPLATE_KEY!r} in its metadata; "
                "base models usually have none): pass one explicitly, e.g. "
                "ChatTemplate.from_model_metadata(gguf, override=template_text), or prompt it "
                "with plain text instead"
            )
        return cls(
            source,
            bos_token=_token_text(metadata, "tokenizer.ggml.bos_token_id"),
            eos_token=_token_text(metadata, "tokenizer.ggml.eos_token_id"),
        )

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        limits: RenderLimits = RenderLimits(),
        tools: list[dict] | None = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for `messages` (dicts with at least a string `role`), within `limits`;
        `tools` (OpenAI function tools) are the template's `tools` variable (None, as
        transformers passes it, when there are none). `chat_template_kwargs` are more
        variables, as transformers' apply_chat_template passes its **kwargs (e.g. Qwen3's
        `enable_thinking`); `check_template_kwargs` says which are taken. It blocks its thread
        for up to `limits.seconds`: async code runs it in a worker."""
        check_messages(messages)
        variables = check_template_kwargs(chat_template_kwargs)
        if tools and not self.renders_tools:
            raise InvalidRequest(
                "this model's chat template does not render tools (it never reads a `tools` "
                "variable); pass a template that does, e.g. examples/chat_templates/"
                "chatml_tools.jinja for ChatML models",
                field="tools",
            )
        budget = _Budget(limits, _ALL_RENDERS)
        self._environment.set_budget(budget)
        try:
            return _with_deadline(
                budget.seconds,
                lambda: self._render(messages, add_generation_prompt, tools, variables, budget),
            )
        except _RenderTimeout:
            raise TemplateError(
                f"chat template ran past its time limit of {limits.seconds:g} s"
            ) from None
        finally:
            self._environment.set_budget(None)
            budget.release()

    def _render(self, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None, variables: dict[str, Any], budget: _Budget) -> str:
        pieces: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(
                **variables,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            ):
                budget.check_time()
                size += len(piece)
                if size > budget.chars:
                    raise TemplateError(
                        f"chat template output passed {budget.chars:,} characters (the longest "
                        "prompt this context can hold)"
                    )
                pieces.append(piece)
            return "".join(pieces)
        except (TemplateError, _RenderTimeout):
            raise
        except jinja2.exceptions.SecurityError as error:
            raise TemplateError(f"chat template tried to leave its sandbox: {error}") from None
        except Exception as error:  # untrusted code: whatever it raises is the template's fault
            raise TemplateError(
                f"chat template failed to render: {type(error).__name__}: {error}"
            ) from None


def _with_deadline(seconds: float, run: Callable[[], str]) -> str:
    """`run()` in this thread; past `seconds`, a watchdog raises `_RenderTimeout` inside it.

    The watchdog injects the exception only while `run` has not returned (both sides hold the
    lock), and the thread passes a Python call after `run` returns, where a pending injection
    is raised, inside this function's caller's `try`. It injects again only while the first
    has not been raised yet (the thread was in C code): once raised, the thread is unwinding,
    and another would land in whatever cleanup runs meanwhile. If one is swallowed (raised in
    a GC callback), the sandbox's hooks still raise at their next check: past the deadline
    every hook does. C code (one huge allocation) cannot be interrupted: the counting
    sandbox refuses those before they start."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    running = [True]
    returned = threading.Event()
    raised = threading.Event()

    class _ThisRenderTimeout(_RenderTimeout):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            raised.set()  # runs in the render thread, as the injection is raised

    def watch() -> None:
        wait = seconds
        while not returned.wait(wait) and not raised.is_set():
            with lock:
                if running[0]:
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(
                        ctypes.c_ulong(thread_id), ctypes.py_object(_ThisRenderTimeout)
                    )
            wait = _REINJECT_S

    threading.Thread(target=watch, name="chat-template-watchdog", daemon=True).start()
    try:
        return run()
    finally:
        with lock:
            running[0] = False
        returned.set()
        _checkpoint()


# While an injection has not been raised yet (the thread is in C code), try again this often.
_REINJECT_S = 0.05


def _checkpoint() -> None:
    """A Python-level call: the interpreter raises a pending injected exception on entry."""


# A template that renders tools names its `tools` variable.
_TOOLS_VARIABLE = re.compile(r"\btools\b")

# The roles chat templates know; any other is most likely a typo the template would render.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any) -> None:
    """Raise `InvalidRequest` unless `messages` is a non-empty list of dicts, each with one of
    CHAT_ROLES; `tool_calls` only on an assistant's, as a list of calls naming a function."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of dicts", field="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{index}] must be a dict with a string 'role'", field="messages"
            )
        if message["role"] not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{index}] has the role {message['role']!r}; the roles are "
                f"{', '.join(CHAT_ROLES)}",
                field="messages",
            )
        if message.get("tool_calls") is not None:
            _check_tool_calls(index, message)


def _check_tool_calls(index: int, message: Mapping[str, Any]) -> None:
    calls = message["tool_calls"]
    if message["role"] != "assistant" or not isinstance(calls, list) or not all(
        isinstance(call, Mapping) and isinstance(call.get("function"), Mapping)
        and isinstance(call["function"].get("name"), str)
        for call in calls
    ):
        raise InvalidRequest(
            f"messages[{index}].tool_calls: only an assistant message has tool calls, a list "
            'of {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}',
            field="messages",
        )


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`kwargs` as a template's extra variables (none for None); else `InvalidRequest` (field
    chat_template_kwargs) unless it maps identifiers, none of RESERVED_TEMPLATE_NAMES, to JSON
    values (null, booleans, finite numbers, strings, lists, objects with string keys) of at
    most MAX_TEMPLATE_KWARGS_CHARS characters as JSON, nested at most
    MAX_TEMPLATE_KWARGS_DEPTH deep."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise _kwargs_error(f"{TEMPLATE_KWARGS_FIELD} must be an object mapping names to JSON "
                            f"values, not {type(kwargs).__name__}")
    _check_json_value(kwargs)  # first: it bounds the number of keys the loop below reads
    for key in kwargs:
        if not key.isidentifier():
            raise _kwargs_error(f"{TEMPLATE_KWARGS_FIELD} has the key {_shown(key)}; a template "
                                "reads only names (letters, digits and _, not first a digit)")
        if key in RESERVED_TEMPLATE_NAMES:
            raise _kwargs_error(
                f"{TEMPLATE_KWARGS_FIELD} may not set {key!r}: the renderer gives every template "
                f"that name (reserved: {', '.join(sorted(RESERVED_TEMPLATE_NAMES))})")
    return dict(kwargs)


def _check_json_value(value: Any) -> None:
    """InvalidRequest unless `value` is JSON within the size and depth bounds. A container's
    items are read only once its own size (at least one character an item) is in bounds, so a
    huge value costs no more than a small one."""
    chars = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_TEMPLATE_KWARGS_DEPTH:
            raise _kwargs_error(f"{TEMPLATE_KWARGS_FIELD} nests deeper than "
                                f"{MAX_TEMPLATE_KWARGS_DEPTH} levels")
        chars += _json_chars(item)
        if chars > MAX_TEMPLATE_KWARGS_CHARS:
            raise _kwargs_error(f"{TEMPLATE_KWARGS_FIELD} is larger than "
                                f"{MAX_TEMPLATE_KWARGS_CHARS:,} characters as JSON")
        if isinstance(item, list | tuple):
            pending.extend((member, depth + 1) for member in item)
        elif isinstance(item, Mapping):
            for key, member in item.items():
                if not isinstance(key, str):
                    raise _kwargs_error(f"{TEMPLATE_KWARGS_FIELD} has a key that is not a "
                                        f"string: {_shown(key)}")
                pending.extend(((key, depth + 1), (member, depth + 1)))


def _json_chars(item: Any) -> int:
    """At least the characters `item` takes as JSON, a container's items not included;
    InvalidRequest for a value JSON has no form for."""
    if isinstance(item, str):
        return len(item) + 2
    if item is None or isinstance(item, bool):
        return 5
    if isinstance(item, int):
        return item.bit_length() // 3 + 1  # at least its decimal digits
    if isinstance(item, float) and math.isfinite(item):
        return 24
    if isinstance(item, list | tuple | Mapping):
        return len(item) + 2  # brackets and separators
    raise _kwargs_error(f"{TEMPLATE_KWARGS_FIELD} holds {_shown(item)}; its values are JSON: "
                        "null, booleans, finite numbers, strings, lists and objects")


def _kwargs_error(message: str) -> InvalidRequest:
    return InvalidRequest(message, field=TEMPLATE_KWARGS_FIELD)


def _shown(value: Any) -> str:
    """A short repr of a value a request sent (which may be huge)."""
    huge_int = isinstance(value, int) and value.bit_length() > 64  # its repr takes long
    if huge_int or not isinstance(value, str | int | float):
        return f"a value of type {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _token_text(metadata: Mapping[str, Any], key: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens")
    token = metadata.get(key)
    if (not isinstance(tokens, StringArray | list) or not isinstance(token, int)
            or not 0 <= token < len(tokens)):
        return ""
    return tokens[token]
