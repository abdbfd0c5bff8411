"""Hostile chat templates: runaway loops and recursion, huge values built by operators,
filters and methods, deep nesting, sandbox escapes, broken syntax, in random combinations.
Each renders within its bounds or fails with TemplateError; nothing else, and no hang."""

from __future__ import annotations

from hypothesis import strategies as st

from actors.model.text.chat import ChatTemplate
from actors.model.text.sandbox import RenderLimits
from tests.fuzz.target import Target, hang_guard, only_project_errors

LIMITS = RenderLimits(seconds=0.3, chars=100_000)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " * 50}]

sizes = st.sampled_from([0, 3, 1000, 30_000, 100_000, 10**6, 10**9, 2**63])
small = st.integers(0, 5)
names = st.sampled_from(["x", "m", "ns", "messages", "loop", "range", "lipsum", "cycler", "joiner"])


def _loop(n: int, body: str) -> str:
    return f"{{% for i in range({n}) %}}{body}{{% endfor %}}"


expressions = st.one_of(
    sizes.map(str),
    st.builds(lambda n: f"'ab' * {n}", sizes),
    st.builds(lambda n: f"[1, 2] * {n}", sizes),
    st.builds(lambda a, b: f"{a} ** {b}", sizes, sizes),
    st.builds(lambda n: f"'%{n}s' % 'x'", sizes),
    st.builds(lambda n: f"'{{:{n}}}'.format(1)", sizes),
    st.builds(lambda n: f"'a'.ljust({n})", sizes),
    st.builds(lambda n: f"'a'|center({n})", sizes),
    st.builds(lambda n: f"('a\\n' * 1000)|indent({n})", sizes),
    st.builds(lambda n: f"('a' * {n})|replace('', 'bb')", sizes),
    st.builds(lambda n: f"range({n})|join('x' * 1000)", sizes),
    st.builds(lambda n: f"lipsum(n={n})", sizes),
    st.builds(lambda n: f"range({n})|list|tojson", sizes),
    st.builds(lambda n: f"messages[0].content * {n}", sizes),
    st.builds(lambda n: f"(10 ** {n})|string", sizes),
    st.builds(lambda d: "(" * d + "1" + ")" * d, st.integers(0, 1200)),
    st.sampled_from(["''.__class__.__mro__", "messages.__class__", "cycler.__init__.__globals__",
                     "self._TemplateReference__context", "range.__self__", "x.y.z",
                     "raise_exception('no')", "strftime_now('%Y')", "undefined_function()"]),
)  # fmt: skip


def _statements(expression: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.recursive(
        st.one_of(expression.map(lambda e: "{{ " + e + " }}"), st.text(max_size=8)),
        lambda inner: st.one_of(
            st.builds(_loop, sizes, inner),
            st.builds(lambda a, b: a + b, inner, inner),
            st.builds(lambda body: f"{{% if messages %}}{body}{{% endif %}}", inner),
            st.builds(
                lambda calls: "{% macro f(n) %}" + "{{ f(n + 1) }}" * calls
                + "{% endmacro %}{{ f(0) }}",
                st.integers(1, 3),
            ),
            st.builds(
                lambda n: "{% set ns = namespace(s='ab') %}" + _loop(n, "{% set ns.s = ns.s ~ ns.s %}")
                + "{{ ns.s|length }}",
                st.integers(1, 40),
            ),
            st.builds(lambda depth: "{% if 1 %}" * depth + "x" + "{% endif %}" * depth, st.integers(1, 500)),
            st.builds(lambda depth: "{% for a in x %}" * depth + "{% endfor %}" * depth, st.integers(1, 30)),
        ),
        max_leaves=6,
    )


broken = st.lists(
    st.sampled_from(["{%", "%}", "{{", "}}", "for", "endfor", "if", "endif", "macro", "(", ")",
                     "[", "]", "{#", "#}", "x", " ", "|", "set", "=", "raw", "endraw"]),
    max_size=30,
).map("".join)  # fmt: skip
cases = st.one_of(_statements(expressions), broken)


def check(source: str) -> str:
    with hang_guard(source), only_project_errors(source) as outcome:
        ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(MESSAGES, limits=LIMITS)
    return outcome[0]


TARGET = Target("chat templates (hostile)", cases, check)
