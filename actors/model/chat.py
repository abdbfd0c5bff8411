"""Chat templates: a model's `tokenizer.chat_template` (Jinja) rendered like transformers does.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox (llama-cpp-python's CVE-2024-34359 came from rendering them unsandboxed), and any
attempt to reach an unsafe attribute (`__class__`, `__globals__`, ...) fails at once instead of
rendering as an empty string. Every failure is a `TemplateError` saying what went wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from actors.errors import InvalidRequest, TemplateError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute raises instead of becoming undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders
    its body unchanged, as transformers does when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(f"chat template refused the conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike Jinja's own `tojson`, no HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> _StrictSandbox:
    environment = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """A compiled chat template; `render(messages)` gives the prompt text."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the chat template is empty")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise TemplateError(
                f"chat template has a syntax error at line {error.lineno}: {error.message}"
            ) from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

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

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (dicts with at least a string `role`)."""
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as error:
            raise TemplateError(f"chat template tried to leave its sandbox: {error}") from None
        except Exception as error:  # untrusted code: whatever it raises is the template's fault
            raise TemplateError(
                f"chat template failed to render: {type(error).__name__}: {error}"
            ) from None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of dicts", field="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{index}] must be a dict with a string 'role'", field="messages"
            )


def _token_text(metadata: Mapping[str, Any], key: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens")
    token = metadata.get(key)
    if not isinstance(tokens, list) or not isinstance(token, int) or not 0 <= token < len(tokens):
        return ""
    return tokens[token]
