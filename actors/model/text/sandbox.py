"""The sandbox chat templates render in: Jinja's immutable sandbox (llama-cpp-python's
CVE-2024-34359 came from rendering templates unsandboxed), where any attempt to reach an unsafe
attribute (`__class__`, `__globals__`, ...) fails at once instead of rendering as an empty
string, and which counts: every call, filter, attribute and operator it sees checks the render's
deadline and refuses values and size arguments past the limit before they are built, and the
output is counted as it streams out. The operations that build their result in one C call
(which neither the deadline nor a count can stop once it runs) are sized before they start:
`%`-formatting and `str.format` (widths, precisions, `*` and nested widths, the values' own
text), `~` chains, joins, `str.translate`, `str()` of containers (the output of `{{ }}` and the
filters that make a string), `tojson` (indent bounded, encoded in pieces). Memory has a ceiling
too: the bytes of every value a render builds are counted, per render and over all renders in
flight, so that no series of such values, each in bounds, adds up past it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sized
from datetime import datetime
from functools import update_wrapper, wraps
from typing import Any, NamedTuple, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.defaults import DEFAULT_NAMESPACE
from jinja2.ext import Extension, loopcontrols
from jinja2.filters import do_join, make_attrgetter
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import pass_environment, pass_eval_context
from markupsafe import EscapeFormatter, Markup

from actors.errors import TemplateError
from actors.model.text.template_sizes import format_field_size, percent_format_size, text_size

# Exponents past this make numbers no prompt needs, and take unbounded time to compute.
_MAX_INT_BITS = 4096
# `tojson(indent=...)`: real templates indent by 2 or 4; each line of the output gets the
# indent times its depth.
MAX_JSON_INDENT = 16


class RenderLimits(NamedTuple):
    """How long one render may take, how many characters any value or the output may have,
    and how many bytes all the values it builds may take together. The engine sets `chars`
    from the context: a longer prompt could not fit anyway."""

    seconds: float = 2.0
    chars: int = 1 << 22
    memory: int = 1 << 27


class _RenderTimeout(TemplateError):
    """Raised inside the rendering thread by the watchdog; `render` turns it into a plain
    TemplateError (a project error even if one slipped out)."""


class _SharedMemory:
    """The bytes that all renders in flight have built, against one ceiling. Each render's
    count changes in one store (the watchdog's injected timeout can land between any two), and
    goes away whole when the render ends."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self._built: dict[object, int] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return sum(self._built.values())

    def take(self, render: object, size: int) -> None:
        with self._lock:
            used = self.used
            if used + size > self.ceiling:
                raise TemplateError(
                    f"chat templates rendering now have built {used:,} bytes; together they "
                    f"may build at most {self.ceiling:,}"
                )
            self._built[render] = self._built.get(render, 0) + size

    def give_back(self, render: object) -> None:
        with self._lock:
            self._built.pop(render, None)


class _Budget:
    """One render's limits, checked by every hook of the counting sandbox."""

    def __init__(self, limits: RenderLimits, shared: _SharedMemory | None = None) -> None:
        self.deadline = time.monotonic() + limits.seconds
        self.seconds = limits.seconds
        self.chars = limits.chars
        self.memory = limits.memory
        self.built = 0
        self._shared = shared

    def count_built(self, value: Any) -> Any:
        """`value`, counted as built by this render, unless the render's or all renders' bytes
        pass their ceiling."""
        size = _built_bytes(value)
        if self.built + size > self.memory:
            raise TemplateError(
                f"chat template built values of {self.built + size:,} bytes in all; the limit "
                f"is {self.memory:,}"
            )
        if self._shared is not None:
            self._shared.take(self, size)
        self.built += size
        return value

    def release(self) -> None:
        """The render ended: its values no longer count against all renders' ceiling."""
        if self._shared is not None:
            self._shared.give_back(self)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _RenderTimeout

    def check_size(self, value: Any) -> Any:
        """`value`, unless it is a string or container past the size limit."""
        if isinstance(value, str | bytes | list | tuple | dict) and len(value) > self.chars:
            raise TemplateError(
                f"chat template built a value of {len(value):,} items; the limit is "
                f"{self.chars:,} (the longest prompt this context can hold)"
            )
        return value

    def check_arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse a size argument (a width, a count, a repeat) past the limit before the call
        builds its result."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.chars:
                raise TemplateError(
                    f"chat template passed the number {_short_int(value)} to a function; "
                    f"sizes past {self.chars:,} are refused"
                )
            self.check_size(value)

    def check_growth(self, parts: int, part_chars: int) -> None:
        """Refuse an operation that would make `parts` copies of `part_chars` characters."""
        if parts * part_chars > self.chars:
            raise TemplateError(
                f"chat template would build a value of {parts * part_chars:,} characters; the "
                f"limit is {self.chars:,}"
            )


def _built_bytes(value: Any) -> int:
    """The bytes a new value takes: a string's own, a container's slots and (as if new) its
    items' objects."""
    if isinstance(value, str | bytes):
        return sys.getsizeof(value)
    if isinstance(value, list | tuple | dict | set | frozenset):
        return sys.getsizeof(value) + 32 * len(value)
    return 0


def _short_int(value: int) -> str:
    return f"{value:,}" if value.bit_length() <= 64 else f"of {value.bit_length()} bits"


class _SizedConcat(CodeGenerator):
    """Compiles `a ~ b ~ c` to a call of the sandbox's `sized_join`, which sizes the result
    before one C call builds it."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        try:  # constant folding, as jinja's own generator does (the source bounds constants)
            self.write(repr(node.as_const(frame.eval_ctx)))
            return
        except nodes.Impossible:
            pass
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.sized_join({join}, (")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class _CountingSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute raises instead of becoming undefined, and
    every call, filter, attribute, item, operator, `~`, output and captured block checks the
    render's budget."""

    intercepted_binops = frozenset(("*", "**", "%", "+"))
    code_generator_class = _SizedConcat

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._sized_output, **options)
        self._renders = threading.local()
        # Compile-time constant folding runs filters too: it gets the default budget.
        self._compile_budget = _Budget(RenderLimits(seconds=float("inf")))
        # Macros, `{% set %}` blocks and filter blocks join their captured output with this.
        self.concat = self._sized_concat
        self.filters = {
            name: self._bounded(function, stringifies=name in _STRINGIFYING_FILTERS)
            for name, function in self.filters.items()
        }

    def budget(self) -> _Budget:
        return getattr(self._renders, "budget", None) or self._compile_budget

    def set_budget(self, budget: _Budget | None) -> None:
        self._renders.budget = budget

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __self.budget()
        budget.check_time()
        if _str_method(__obj, "join") and args and not isinstance(args[0], list | tuple):
            args = (_listed(args[0]), *args[1:])  # a generator's items, sized before the join
        budget.check_arguments(args, kwargs)
        _check_multiplying_call(budget, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.count_built(budget.check_size(result))

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = self.budget()
        budget.check_time()
        return budget.check_size(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = self.budget()
        budget.check_time()
        item = budget.check_size(super().getitem(obj, argument))
        return budget.count_built(item) if isinstance(argument, slice) else item

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        budget = self.budget()
        budget.check_time()
        _check_binop(budget, operator_, left, right)
        result = super().call_binop(context, operator_, left, right)
        return budget.count_built(budget.check_size(result))

    def sized_join(self, join: Callable[[Iterable[Any]], str], parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...`: every part becomes text, so the parts' text together is the size."""
        budget = self.budget()
        budget.check_time()
        budget.check_growth(1, sum(text_size(part, budget.chars) for part in parts))
        return budget.count_built(join(parts))

    def _sized_concat(self, pieces: Iterable[str]) -> str:
        budget = self.budget()
        budget.check_time()
        pieces = _listed(pieces)
        budget.check_growth(1, sum(map(len, pieces)))
        return budget.count_built("".join(pieces))

    def _sized_output(self, value: Any) -> Any:
        """Each `{{ }}` value, sized before jinja makes it a string."""
        if not isinstance(value, str):
            budget = self.budget()
            budget.check_growth(1, text_size(value, budget.chars))
        return value

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format` and `str.format_map` through a formatter that sizes every field (its
        width and precision, nested ones filled in, and its value's text) before formatting."""
        method_types = types.MethodType | types.BuiltinMethodType
        if not isinstance(value, method_types) or value.__name__ not in ("format", "format_map"):
            return None
        if not isinstance(value.__self__, str):
            return None
        text: str = value.__self__
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            formatter = (
                _SizedEscapeFormatter(self, escape=text.escape)
                if isinstance(text, Markup)
                else _SizedFormatter(self)
            )
            return type(text)(formatter.vformat(text, args, kwargs))

        return update_wrapper(wrapper, value)

    def _bounded(self, function: Callable[..., Any], stringifies: bool) -> Callable[..., Any]:
        """A filter that checks the budget before and after it runs (filters are called
        directly by compiled templates, not through `call`). One that makes its value a string
        sizes that string first."""

        @wraps(function)  # keeps jinja's pass_context / pass_environment marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            budget = self.budget()
            budget.check_time()
            budget.check_arguments(args, kwargs)
            data = _data_arguments(args)
            if stringifies and data and not isinstance(data[0], str):
                budget.check_growth(1, text_size(data[0], budget.chars))
            _check_multiplying_call(budget, function, args, kwargs)
            return budget.count_built(budget.check_size(function(*args, **kwargs)))

        return bounded


class _SizedFormatter(SandboxedFormatter):
    """The sandbox's `str.format` formatter, refusing a result past the limit before each
    field is formatted (one `{:999999999}` is one C call)."""

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = self._env.budget()
        budget.check_time()
        self._size += format_field_size(value, format_spec, budget.chars)
        budget.check_growth(1, self._size)
        return super().format_field(value, format_spec)


class _SizedEscapeFormatter(_SizedFormatter, EscapeFormatter):
    pass


# Filters that make their (first) value a string: a container is sized first.
_STRINGIFYING_FILTERS = frozenset(
    ("string", "pprint", "e", "escape", "forceescape", "safe", "urlencode", "xmlattr", "upper",
     "lower", "title", "capitalize", "trim", "center", "indent", "wordwrap", "truncate",
     "striptags", "wordcount", "replace", "format", "urlize")
)  # fmt: skip


def _data_arguments(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A filter's arguments without the context jinja passes first to some."""
    skip = 0
    while skip < len(args) and isinstance(args[skip], EvalContext | Context | jinja2.Environment):
        skip += 1
    return args[skip:]


def _listed(values: Any) -> list[Any]:
    return values if isinstance(values, list) else list(values)


def _str_method(function: Any, name: str) -> bool:
    return isinstance(getattr(function, "__self__", None), str) and getattr(
        function, "__name__", ""
    ) == name


def _check_binop(budget: _Budget, operator_: str, left: Any, right: Any) -> None:
    """Refuse an operator whose result would be past the limit, before it is computed."""
    sized = (str, bytes, list, tuple)
    if operator_ == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(times, int):
                budget.check_growth(max(times, 0), len(seq))
        if isinstance(left, int) and isinstance(right, int):
            _check_int_bits(left.bit_length() + right.bit_length())
    elif operator_ == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _check_int_bits(left.bit_length() * right)
    elif operator_ == "%" and isinstance(left, str):
        budget.check_growth(1, percent_format_size(left, right, budget.chars))
    elif operator_ == "+" and isinstance(left, sized) and isinstance(right, sized):
        budget.check_growth(1, len(left) + len(right))


def _check_int_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise TemplateError(
            f"chat template computed a number of about {bits:,} bits; no prompt needs one"
        )


def _check_multiplying_call(
    budget: _Budget, function: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Calls whose result grows with the product of their arguments (the checks on each
    argument alone do not bound these)."""
    name = getattr(function, "__name__", "")
    # A bound str method (or the sandbox's wrapper around `str.format`): its string first.
    owner = getattr(getattr(function, "__wrapped__", function), "__self__", None)
    args = _data_arguments(args)
    if isinstance(owner, str):
        args = (owner, *args)
    strings = [value for value in args if isinstance(value, str)]
    if name in ("replace", "do_replace") and len(strings) >= 3:
        text, old, new = strings[-3:]
        budget.check_growth(len(text) // max(len(old), 1) + 1, max(len(new), 1))
    elif name == "join" and isinstance(owner, str) and len(args) > 1:
        _check_join(budget, args[1], owner)
    elif name == "translate" and isinstance(owner, str) and len(args) > 1:
        budget.check_growth(len(owner), _longest_translation(args[1], budget.chars))
    elif name == "expandtabs" and isinstance(owner, str):
        tab = next((value for value in (*args[1:], *kwargs.values()) if isinstance(value, int)), 8)
        budget.check_growth(owner.count("\t") + 1, max(tab, 0) + 1)
    elif name in _WIDTH_FUNCTIONS:
        text = strings[0] if strings else ""
        sizes = (*args[1:], *kwargs.values())
        width = sum(
            value if isinstance(value, int) else len(value)
            for value in sizes
            if isinstance(value, int | str) and not isinstance(value, bool)
        )
        budget.check_growth(text.count("\n") + 2, width + 1)
    elif name == "do_format" and args and isinstance(args[0], str):
        values = dict(kwargs) if kwargs else tuple(args[1:])
        budget.check_growth(1, percent_format_size(args[0], values, budget.chars))
    elif name == "do_sum" and not isinstance(
        kwargs.get("start", args[2] if len(args) > 2 else 0), int | float
    ):
        # Sums of lists or strings copy the running total at every step, inside one C call.
        raise TemplateError("chat template sums sequences (|sum with a start that is not a number)")


def _check_join(budget: _Budget, items: Any, separator: str) -> None:
    """Every item becomes text, with the separator between them."""
    if isinstance(items, Sized):
        size = sum(text_size(item, budget.chars) for item in items)
        budget.check_growth(1, size + len(separator) * len(items))


def _longest_translation(table: Any, limit: int) -> int:
    """The most characters `str.translate(table)` makes of one character."""
    replacements = table.values() if isinstance(table, Mapping) else table
    if not isinstance(replacements, Iterable) or isinstance(replacements, str):
        return 1
    return max((len(value) for value in replacements if isinstance(value, str)), default=1)


# Functions that pad or indent every line of a text by a width argument.
_WIDTH_FUNCTIONS = frozenset(
    ("indent", "do_indent", "center", "do_center", "ljust", "rjust", "zfill", "wordwrap",
     "do_wordwrap")
)  # fmt: skip


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


@pass_environment
def _tojson(
    environment: _CountingSandbox,
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' filter (unlike Jinja's own `tojson`, no HTML escaping), encoded piece by
    piece (json's Python encoder) and counted as the pieces come: one C call never builds more
    than one piece."""
    indent_chars = len(indent) if isinstance(indent, str) else abs(indent or 0)
    if indent_chars > MAX_JSON_INDENT:
        raise TemplateError(
            f"chat template asked tojson for an indent of {str(indent)[:20]!r}; at most "
            f"{MAX_JSON_INDENT} is allowed"
        )
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    budget = environment.budget()
    pieces: list[str] = []
    size = 0
    for piece in encoder.iterencode(value):
        budget.check_time()
        size += len(piece)
        budget.check_growth(1, size)
        pieces.append(piece)
    return "".join(pieces)


@pass_eval_context
def _join(eval_context: EvalContext, value: Any, d: str = "", attribute: Any = None) -> str:
    """Jinja's `join`, its items (a generator's too) sized before the one C call joins them."""
    items = _listed(value)
    if attribute is not None:
        items = list(map(make_attrgetter(eval_context.environment, attribute), items))
    _check_join(eval_context.environment.budget(), items, d if isinstance(d, str) else "")
    return do_join(eval_context, items, d)


def _transformers_functions(now: Callable[[], datetime]) -> dict[str, Callable[..., str]]:
    """The functions transformers gives every template; `strftime_now` formats `now()`."""

    def strftime_now(format: str) -> str:
        return now().strftime(format)

    return {"raise_exception": _raise_exception, "strftime_now": strftime_now}


# Every name a template finds without being passed it: Jinja's functions and transformers'.
GLOBAL_NAMES = frozenset(DEFAULT_NAMESPACE) | frozenset(_transformers_functions(datetime.now))


def _environment(now: Callable[[], datetime] = datetime.now) -> _CountingSandbox:
    """A sandbox whose `strftime_now` reads the clock `now` (the local time by default)."""
    environment = _CountingSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = environment._bounded(_tojson, stringifies=False)
    environment.filters["join"] = environment._bounded(_join, stringifies=False)
    environment.globals.update(_transformers_functions(now))
    return environment
