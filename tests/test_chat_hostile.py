"""Chat template operations that build their result inside one C call:
each is sized before it runs and refused past the limits, in milliseconds and without the
memory it asked for; the same operations within bounds render as Python renders them; a
hostile template embedded in a model file is refused the same way, with the loop live."""

from __future__ import annotations

import json
import time
import tracemalloc
from contextlib import aclosing
from pathlib import Path

import pytest

from actors import Engine, SamplingParams
from actors.errors import TemplateError
from actors.loop_stall import watch_loop
from actors.model.text.chat import ChatTemplate
from actors.model.text.sandbox import RenderLimits
from tests.fuzz import gguf_structure

USER = [{"role": "user", "content": "hi"}]
LIMITS = RenderLimits(seconds=2.0, chars=1_000_000, memory=64 << 20)
BIG = "{% set x = 'a' * 900000 %}"  # one value within the limit; many of them are not
MANY = "{% set many = ['a' * 900000] * 1000 %}"  # 1,000 references to one such value

HOSTILE = {
    "% with a huge width": "{{ '%999999999s' % 'x' }}",
    "% with a huge precision": "{{ '%.999999999f' % 1.5 }}",
    "% with a width from the values (*)": "{{ '%*s' % (999999999, 'x') }}",
    "% of many big values": BIG + "{{ ('%s' * 100) % ((x,) * 100) }}",
    "% of a container": MANY + "{{ '%s' % (many,) }}",
    "|format with a huge width": "{{ '%999999999d'|format(1) }}",
    "str.format with a width from a variable": "{% set w = 999999 %}"
    "{{ ('{:{w}}' * 100).format(*range(100), w=w) }}",
    "str.format with a width from a string": "{{ '{:{}}'.format('x', '999999999') }}",
    "str.format_map with a huge width": "{{ '{a:999999999}'.format_map({'a': 1}) }}",
    "a long ~ chain": BIG + "{{ x" + " ~ x" * 300 + " }}",
    "~ of a container": MANY + "{{ many ~ '' }}",
    "str.translate with an expanding table": "{{ ('a' * 100000).translate({97: 'b' * 1000}) }}",
    "str.translate with a list table": "{{ ('a' * 100000).translate(['b' * 1000] * 200) }}",
    "tojson with a huge indent": "{{ messages|tojson(indent=999999) }}",
    "tojson with a long indent text": "{{ messages|tojson(indent='x' * 1000) }}",
    "tojson of many big values": MANY + "{{ many|tojson }}",
    "output of a container": MANY + "{{ many }}",
    "|string of a container": MANY + "{{ many|string|length }}",
    "|pprint of a container": MANY + "{{ many|pprint|length }}",
    "a namespace holding big values": "{% set ns = namespace(s='a' * 900000) %}{{ ns }}",
    "|join of big values": MANY + "{{ many|join|length }}",
    "|join of a generator": MANY + "{{ many|map('trim')|join|length }}",
    "str.join of a generator": MANY + "{{ ''.join(many|map('trim'))|length }}",
    "str.expandtabs of many tabs": "{{ ('\t' * 100000).expandtabs(1000) }}",
    "|sum of lists": "{{ ([[1] * 10000] * 1000)|sum(start=[])|length }}",
    "a macro's output, joined": "{% macro m(x) %}{% for i in range(100000) %}{{ x }}"
    "{% endfor %}{% endmacro %}{{ m('a' * 900000)|length }}",
    "a captured block": "{% set big %}{% for i in range(100000) %}{{ 'a' * 900000 }}"
    "{% endfor %}{% endset %}{{ big|length }}",
    "big values accumulated in a list": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
    "{% set ns.l = ns.l + ['a' * 900000 ~ i] %}{% endfor %}{{ ns.l|length }}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_an_operation_that_would_build_too_much_is_refused_before_it_builds_it(
    source: str,
) -> None:
    template = ChatTemplate(source, bos_token="", eos_token="")
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(TemplateError, match="would build|built values|indent|sums sequences"):
            template.render(USER, limits=LIMITS)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Refused by a size check (not by the deadline), holding at most the memory ceiling plus
    # one value of the limit's size (4 bytes a character at most).
    assert seconds < 1.5
    assert peak < LIMITS.memory + 8 * LIMITS.chars


WITHIN_BOUNDS = {
    "{{ '%5s|%-4d|%.2f|%*d' % ('x', 7, 1.234, 3, 9) }}": "    x|7   |1.23|  9",
    "{{ '%(a)s-%(b)03d' % {'a': 'p', 'b': 4} }}": "p-004",
    "{{ '%s and %s'|format('x', 'y') }}": "x and y",
    "{% set w = 6 %}{{ '{:>{w}}|{:.{p}f}'.format('ab', 2.5, w=w, p=2) }}": "    ab|2.50",
    "{{ '{a}:{b!r}'.format_map({'a': 1, 'b': 'z'}) }}": "1:'z'",
    "{{ 'a' ~ 1 ~ [2] ~ none }}": "a1[2]None",
    "{{ 'abc'.translate({97: 'xy', 98: none}) }}": "xyc",
    "{{ [1, 'two', {'k': 3}] }}|{{ ['é']|string }}": "[1, 'two', {'k': 3}]|['é']",
    "{{ ['a', 'b']|map('upper')|join('-') }}|{{ ''.join(['x', 'y']|map('upper')) }}": "A-B|XY",
    "{{ [{'n': 'a'}, {'n': 'b'}]|join(',', attribute='n') }}": "a,b",
    "{{ 'a\tb'.expandtabs(4) }}": "a   b",
    "{{ [1, 2, 3]|sum }}": "6",
    "{% macro m(x) %}<{{ x }}>{% endmacro %}{{ m(1) }}{% set b %}[{{ 2 }}]{% endset %}{{ b }}":
        "<1>[2]",
}  # fmt: skip


@pytest.mark.parametrize(("source", "expected"), WITHIN_BOUNDS.items())
def test_the_same_operations_within_bounds_render_as_python_does(
    source: str, expected: str
) -> None:
    assert ChatTemplate(source, bos_token="", eos_token="").render(USER) == expected


def test_tojson_matches_json_dumps_piece_by_piece() -> None:
    messages = [{"role": "user", "content": 'é "q"\n', "n": [1, 2.5, None, True]}]
    for arguments, options in (
        ("", {}),
        ("indent=2", {"indent": 2}),
        ("indent='\\t', sort_keys=true", {"indent": "\t", "sort_keys": True}),
        ("ensure_ascii=true, separators=(',', ':')",
         {"ensure_ascii": True, "separators": (",", ":")}),
    ):  # fmt: skip
        source = "{{ messages|tojson(" + arguments + ") }}"
        rendered = ChatTemplate(source, bos_token="", eos_token="").render(messages)
        assert rendered == json.dumps(messages, **{"ensure_ascii": False, **options})


def test_renders_in_flight_share_one_memory_ceiling(monkeypatch) -> None:
    """Each render's values count against all renders' ceiling while it runs, and give it back
    when it ends: a render past the shared ceiling fails, the next one (alone) succeeds."""
    import actors.model.text.chat as chat

    shared = chat._SharedMemory(ceiling=8 << 20)
    monkeypatch.setattr(chat, "_ALL_RENDERS", shared)
    other = object()
    shared.take(other, 6 << 20)  # another render in flight holds 6 MB
    source = "{% set x = 'a' * 3000000 %}{{ x|length }}"
    template = ChatTemplate(source, bos_token="", eos_token="")
    with pytest.raises(TemplateError, match="rendering now have built"):
        template.render(USER)
    assert shared.used == 6 << 20  # the failed render gave back what it had counted
    shared.give_back(other)
    assert template.render(USER) == "3000000"
    assert shared.used == 0


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_hostile_template_in_the_model_file_is_refused_with_the_loop_live(
    tmp_path: Path,
) -> None:
    source = "{% set x = 'a' * 100000 %}{{ ('%s' * 100000) % ((x,) * 100000) }}"
    parts = gguf_structure.apply(
        gguf_structure.seed_parts("llama-q4k-tiny"),
        gguf_structure.Mutation(
            "set",
            "tokenizer.chat_template",
            gguf_structure.Value(gguf_structure.T.STRING, source),
        ),
    )
    path = tmp_path / "hostile-template.gguf"
    gguf_structure.write_gguf(parts, path)
    async with Engine.open(path, backend="cpu") as engine, watch_loop() as watch:
        with pytest.raises(TemplateError, match="would build"):
            params = SamplingParams(max_tokens=2, temperature=0)
            async with aclosing(engine.chat(USER, params)) as chunks:
                async for _ in chunks:
                    pass
    assert watch.worst_stall_ms < 100
