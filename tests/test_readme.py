"""The README's first library example asks for few tokens: each call that generates sets
max_tokens to a handful, so a first run answers in seconds rather than waiting for the default
256 tokens of a CPU decode."""

from __future__ import annotations

import ast
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"
# The most tokens a call of the first example may ask for.
FEW_TOKENS = 64


def first_python_example() -> ast.Module:
    section = README.read_text().split("## Use it from async code", 1)[1]
    return ast.parse(section.split("```python\n", 1)[1].split("```", 1)[0])


def test_every_sampling_params_of_the_first_example_asks_for_few_tokens() -> None:
    calls = [node for node in ast.walk(first_python_example()) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "SamplingParams"]
    assert len(calls) >= 2  # generate()'s and complete()'s
    for call in calls:
        (max_tokens,) = [keyword.value for keyword in call.keywords if keyword.arg == "max_tokens"]
        assert 0 < ast.literal_eval(max_tokens) <= FEW_TOKENS, ast.unparse(call)
