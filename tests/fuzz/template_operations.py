"""Chat template operations that build their result in one C call (`%`-formatting, `str.format`
with literal, nested and variable widths, `~` chains, joins, `str.translate`, `tojson`, `str()`
of containers, captured blocks), over values of every size, alone and chained. Each renders
or fails with TemplateError, and the render's traced memory stays under its ceiling plus one
value of the size limit: a C call that allocated past it would show in the peak."""

from __future__ import annotations

import tracemalloc

from hypothesis import strategies as st

from actors.model.text.chat import ChatTemplate
from actors.model.text.sandbox import RenderLimits
from tests.fuzz.target import Escape, Target, hang_guard, only_project_errors

LIMITS = RenderLimits(seconds=0.5, chars=100_000, memory=4 << 20)
# The ceiling, one value of the limit's size (4 bytes a character at most), its Python copy
# and jinja's own working memory.
PEAK_BYTES = LIMITS.memory + 3 * 4 * LIMITS.chars + (2 << 20)
MESSAGES = [{"role": "user", "content": "hi"}]

numbers = st.sampled_from([0, 1, 7, 1000, 99_999, 100_001, 10**6, 10**9, 2**40])
# Values bound to `v` before the operation: texts, containers of them, numbers.
values = st.one_of(
    st.builds(lambda n: f"'ab' * {n}", numbers),
    st.builds(lambda n, k: f"['x' * {n}] * {k}", numbers, numbers),
    st.builds(lambda n: f"{{'k': 'y' * {n}}}", numbers),
    st.builds(lambda n: f"namespace(s='z' * {n})", numbers),
    st.builds(lambda n: f"range({n})|list", numbers),
    numbers.map(str),
    st.just("messages"),
)
operations = st.one_of(
    st.builds(lambda n: f"'%{n}s' % v", numbers),
    st.builds(lambda n: f"'%.{n}f' % 1.5", numbers),
    st.builds(lambda n: f"'%*s' % ({n}, v)", numbers),
    st.builds(lambda k: f"('%s' * {k}) % ((v,) * {k})", numbers),
    st.builds(lambda n: f"'%{n}d'|format(1)", numbers),
    st.builds(lambda n: f"'{{:{n}}}'.format(v)", numbers),
    st.builds(lambda n: f"'{{:{{w}}}}'.format(v, w={n})", numbers),
    st.builds(lambda n: f"'{{:{{}}}}'.format(v, '{n}')", numbers),
    st.builds(lambda k: f"('{{}}' * {k}).format(*([v] * {k}))", numbers),
    st.builds(lambda n: f"'{{a:{n}}}'.format_map({{'a': v}})", numbers),
    st.builds(lambda k: "v" + " ~ v" * k, st.integers(0, 400)),
    st.builds(lambda n: f"('a' * {n}).translate({{97: v}})", numbers),
    st.builds(lambda n, k: f"('a' * {n}).translate([v] * {k})", numbers, numbers),
    st.builds(lambda i: f"v|tojson(indent={i})", numbers),
    st.builds(lambda i: f"v|tojson(indent='x' * {i})", numbers),
    st.builds(lambda k: f"([v] * {k})|tojson", numbers),
    st.builds(lambda k: f"([v] * {k})|join", numbers),
    st.builds(lambda k: f"([v] * {k})|map('string')|join('-')", numbers),
    st.builds(lambda k: f"''.join(([v] * {k})|map('string'))", numbers),
    st.builds(lambda k, f: f"([v] * {k})|{f}", numbers,
              st.sampled_from(["string", "pprint", "e", "urlencode", "upper", "center(9)"])),
    st.builds(lambda n: f"('\\t' * {n}).expandtabs(v if v is number else 8)", numbers),
    st.builds(lambda k: f"([[v]] * {k})|sum(start=[])", numbers),
    st.just("v"),
)  # fmt: skip


def _template(value: str, operation: str, wrapper: str, repeats: int) -> str:
    expression = "{{ " + operation + " }}"
    body = {
        "output": expression,
        "length": "{{ (" + operation + ")|string|length }}",
        "macro": "{% macro m() %}" + expression + "{% endmacro %}{{ m() }}",
        "block": "{% set b %}" + expression + "{% endset %}{{ b|length }}",
        "loop": "{% for i in range(" + str(repeats) + ") %}" + expression + "{% endfor %}",
        "accumulate": "{% set ns = namespace(l=[]) %}{% for i in range(" + str(repeats) + ") %}"
        "{% set ns.l = ns.l + [(" + operation + ") ~ i] %}{% endfor %}{{ ns.l|length }}",
    }[wrapper]
    return "{% set v = " + value + " %}" + body


cases = st.builds(
    _template,
    values,
    operations,
    st.sampled_from(["output", "length", "macro", "block", "loop", "accumulate"]),
    st.sampled_from([1, 3, 100, 10_000]),
)


def check(source: str) -> str:
    tracemalloc.start()
    try:
        with hang_guard(source), only_project_errors(source) as outcome:
            ChatTemplate(source, bos_token="", eos_token="").render(MESSAGES, limits=LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if peak > PEAK_BYTES:
        raise Escape(f"the render peaked at {peak:,} bytes (ceiling {PEAK_BYTES:,}) <- {source!r}")
    return outcome[0]


TARGET = Target("chat template operations (sized before C builds them)", cases, check)
