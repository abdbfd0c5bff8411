"""Structured output: StructuredOutput's checks, the token masks, the llguidance constraint
built from the GGUF vocabulary, and constrained requests through the engine (the tiny llama
here; SmolLM2 and gemma-3 on 32 schemas, validated with jsonschema)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import anyio
import jsonschema
import msgspec
import numpy as np
import pytest
from structured_schemas import SCHEMAS

from actors import Engine, InvalidRequest, SamplingParams, StructuredOutput
from actors.messages import Chunk
from actors.model.candidates import RowInputs, apply_token_masks
from actors.model.gguf.reader import open_gguf
from actors.model.text.tokenizer import Tokenizer
from actors.structured import GrammarCompiler, mask_words

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tiny_path(tiny_model_paths: dict[str, Path]) -> Path:
    return tiny_model_paths["llama-q4k-tiny"]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(tiny_path))


def greedy(structured: StructuredOutput | None = None, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=extra.pop("max_tokens", 96),
                          structured=structured, **extra)


def schema_prompt(schema: dict) -> str:
    return f"Reply with one JSON value that matches this JSON schema: {json.dumps(schema)}\nJSON:"


# --- the request field ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, "structured.json_schema"),
        ({"regex": "a", "choice": ["a"]}, "structured.choice"),
        ({"json_schema": [1]}, "structured.json_schema"),
        ({"regex": ""}, "structured.regex"),
        ({"grammar": 3}, "structured.grammar"),
        ({"choice": []}, "structured.choice"),
        ({"choice": ["a", ""]}, "structured.choice"),
        ({"json_object": "yes"}, "structured.json_object"),
        ({"regex": "a", "fast_forward": 1}, "structured.fast_forward"),
        ({"regex": "a" * (1 << 20 + 1)}, "structured.regex"),
        ({"regex": "a", "schema": {}}, "schema"),
    ],
)
def test_a_bad_constraint_names_its_field(fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        StructuredOutput(**fields)
    assert caught.value.field == field


def test_structured_output_arrives_as_json_too() -> None:
    params = SamplingParams.from_dict({"structured": {"choice": ["yes", "no"]}})
    assert params.structured == StructuredOutput(choice=("yes", "no"))
    assert params.structured.kind == "choice"
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.from_dict({"structured": {"regex": "a", "json_object": True}})
    assert caught.value.field == "structured.regex"  # the second of the two given


# --- masks ------------------------------------------------------------------------------------


def test_token_masks_forbid_exactly_the_cleared_bits() -> None:
    rng = np.random.default_rng(0)
    vocab = 70  # three words, the last one partly past the vocabulary
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    allowed = rng.random((2, vocab)) < 0.3
    words = np.packbits(np.pad(allowed, ((0, 0), (0, 26))), axis=1, bitorder="little")
    masks = words.view(np.int32)
    rows = [RowInputs(allowed=masks[0]), RowInputs(), RowInputs(allowed=masks[1])]
    masked = logits.copy()
    apply_token_masks(masked, rows)
    for row, allowed_row in ((0, allowed[0]), (2, allowed[1])):
        assert np.array_equal(masked[row, allowed_row], logits[row, allowed_row])
        assert np.all(masked[row, ~allowed_row] == -np.inf)
    assert np.array_equal(masked[1], logits[1])


def test_a_mask_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="2 words for a vocabulary of 70"):
        apply_token_masks(np.zeros((1, 70), np.float32),
                          [RowInputs(allowed=np.zeros(2, np.int32))])


# --- the constraint ---------------------------------------------------------------------------


def allowed_tokens(mask: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_a_constraint_walks_a_valid_answer_forcing_what_the_grammar_fixes(
    tiny_tokenizer: Tokenizer,
) -> None:
    compiler = GrammarCompiler(tiny_tokenizer)
    constraint = compiler.constraint(StructuredOutput(json_schema=PERSON), budget=64)
    assert constraint.allowed.size == mask_words(tiny_tokenizer.vocab_size)
    answer = tiny_tokenizer.encode('{"name": "Ann", "age": 7, "city": "Oslo"}', add_bos=False)
    # The first key is forced before any choice (up to where a token could still merge with
    # what follows): it joins the prompt's prefill.
    expected_forced = list(constraint.leading)
    assert tiny_tokenizer.decode(expected_forced).startswith('{"name":')
    forced_total = len(expected_forced)
    for token in answer:
        if expected_forced:  # the grammar forced it: it must be the model's own tokenization
            assert expected_forced.pop(0) == token
            continue
        assert token in allowed_tokens(constraint.allowed, tiny_tokenizer.vocab_size)
        advanced = constraint.advance(token)
        assert advanced.error is None
        expected_forced = list(advanced.forced)
        forced_total += len(advanced.forced)
    assert advanced.done and constraint.done
    assert forced_total > 0  # keys after the first are forced outright


def test_a_refused_token_is_an_error_of_that_constraint_only(tiny_tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tiny_tokenizer)
    digits, word = (compiler.constraint(StructuredOutput(regex=r"[0-9]{3}"), budget=64),
                    compiler.constraint(StructuredOutput(choice=["yes", "no"]), budget=64))
    letter = tiny_tokenizer.encode("x", add_bos=False)[-1]
    first_of_yes = tiny_tokenizer.encode("yes", add_bos=False)[0]
    refused, accepted = digits.advance(letter), word.advance(first_of_yes)
    assert refused.error is not None and "refused token" in refused.error
    assert "\n" not in refused.error
    assert accepted.error is None


@pytest.mark.parametrize(
    ("structured", "field"),
    [
        (StructuredOutput(regex="(unclosed"), "structured.regex"),
        (StructuredOutput(json_schema={"type": "no-such-type"}), "structured.json_schema"),
        (StructuredOutput(grammar="start: undefined_rule"), "structured.grammar"),
        (StructuredOutput(grammar='root ::= "a" | missing'), "structured.grammar"),
    ],
)
def test_what_does_not_compile_is_an_invalid_request(
    tiny_tokenizer: Tokenizer, structured: StructuredOutput, field: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        GrammarCompiler(tiny_tokenizer).constraint(structured, budget=64)
    assert caught.value.field == field
    assert "\n" not in str(caught.value)


def test_gbnf_is_converted(tiny_tokenizer: Tokenizer) -> None:
    constraint = GrammarCompiler(tiny_tokenizer).constraint(
        StructuredOutput(grammar='root ::= "ab" [0-9]'), budget=64
    )
    assert tiny_tokenizer.decode(list(constraint.leading)) == "ab"  # forced at once
    first = allowed_tokens(constraint.allowed, tiny_tokenizer.vocab_size)
    assert {tiny_tokenizer.decode([t]) for t in first} == set("0123456789")


# --- through the engine -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_regex_choice_json_and_grammar_answers_hold(tiny_path: Path) -> None:
    async with Engine.open(tiny_path, backend="cpu") as engine:
        date = await engine.complete("Date:", greedy(StructuredOutput(regex=r"[0-9]{4}-[0-9]{2}")))
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", date.text) and date.finish_reason == "stop"
        for seed in range(4):
            picked = await engine.complete("Pick:", SamplingParams(
                seed=seed, temperature=1.5, max_tokens=8,
                structured=StructuredOutput(choice=["red", "green", "blue"])))
            assert picked.text in ("red", "green", "blue") and picked.finish_reason == "stop"
        anything = await engine.complete("{", greedy(StructuredOutput(json_object=True)))
        assert isinstance(json.loads(anything.text), dict)
        lark = await engine.complete("Say:", greedy(StructuredOutput(
            grammar='start: "<" NAME ">"\nNAME: /[a-z]{2,5}/')))
        assert re.fullmatch(r"<[a-z]{2,5}>", lark.text)


@pytest.mark.anyio
async def test_a_grammar_cut_by_max_tokens_ends_with_length(tiny_path: Path) -> None:
    async with Engine.open(tiny_path, backend="cpu") as engine:
        cut = await engine.complete("x", greedy(StructuredOutput(regex="[a-z]{50,60}"),
                                                max_tokens=5))
        assert cut.finish_reason == "length" and cut.usage.completion_tokens == 5
        # Forced tokens count against the budget too: a budget met inside them cuts there.
        forced = await engine.complete("x", greedy(StructuredOutput(choice=["abcdefghijklmnop"]),
                                                   max_tokens=2))
        assert forced.finish_reason == "length" and len(forced.token_ids) == 2


@pytest.mark.anyio
async def test_streaming_and_logprobs_with_a_schema(tiny_path: Path) -> None:
    async with Engine.open(tiny_path, backend="cpu") as engine:
        params = greedy(StructuredOutput(json_schema=PERSON), logprobs=2)
        whole = await engine.complete(schema_prompt(PERSON), params)
        jsonschema.validate(json.loads(whole.text), PERSON)
        chunks = await drained(engine.generate(schema_prompt(PERSON), params))
        assert "".join(c.text for c in chunks) == whole.text
        tokens = [c for c in chunks if c.token_id is not None]
        # The grammar forced some tokens: logprob 0, the only token it allowed; the model
        # chose the others among what it allowed.
        forced = [c for c in tokens if c.top_logprobs == ((c.token_id, 0.0),)]
        chosen = [c for c in tokens if c not in forced]
        assert forced and chosen and all(c.logprob == 0.0 for c in forced)
        assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in chosen)


@pytest.mark.anyio
async def test_a_stop_string_that_cuts_a_constrained_answer_is_an_error(tiny_path: Path) -> None:
    async with Engine.open(tiny_path, backend="cpu") as engine:
        params = greedy(StructuredOutput(json_schema=PERSON))
        whole = await engine.complete(schema_prompt(PERSON), params)
        cut_params = msgspec.structs.replace(params, stop=('"age"',))
        with pytest.raises(InvalidRequest, match="does not match") as cut:
            await engine.complete(schema_prompt(PERSON), cut_params)
        assert cut.value.field == "stop"
        # A stream gets the text up to the stop string, then the error.
        chunks: list = []
        with pytest.raises(InvalidRequest):
            async with aclosing(engine.generate(schema_prompt(PERSON), cut_params)) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
        assert "".join(c.text for c in chunks) == whole.text.split('"age"')[0]
        assert all(c.finish_reason is None for c in chunks)
        # A stop token the grammar allows inside the answer cuts it too.
        digits = greedy(StructuredOutput(regex=r"[0-9]{6}"))
        third = (await engine.complete("Age:", digits)).token_ids[2]
        with pytest.raises(InvalidRequest) as by_token:
            await engine.complete("Age:", msgspec.structs.replace(digits, stop_token_ids=(third,)))
        assert by_token.value.field == "stop_token_ids"
        # A stop string the complete answer never reaches changes nothing.
        untouched = await engine.complete(schema_prompt(PERSON), msgspec.structs.replace(
            params, stop=("NEVER",)))
        assert untouched.text == whole.text and untouched.finish_reason == "stop"


async def drained(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    async with aclosing(chunks) as stream:
        return [chunk async for chunk in stream]


@pytest.mark.anyio
async def test_fast_forward_takes_fewer_steps_and_both_answers_are_valid(
    tiny_path: Path,
) -> None:
    prompt = schema_prompt(PERSON)
    answers = {}
    steps = {}
    async with Engine.open(tiny_path, backend="cpu") as engine:
        for fast_forward in (True, False):
            before = engine.stats().steps
            answers[fast_forward] = await engine.complete(prompt, greedy(
                StructuredOutput(json_schema=PERSON, fast_forward=fast_forward)))
            steps[fast_forward] = engine.stats().steps - before
    for answer in answers.values():
        jsonschema.validate(json.loads(answer.text), PERSON)
        assert answer.finish_reason == "stop"
    # Forced bytes may tokenize differently from the model's own choice, so the two answers
    # need not be the same; each is valid, and the forced one takes fewer decode steps.
    assert steps[True] < steps[False]
    assert steps[False] == answers[False].usage.completion_tokens


@pytest.mark.anyio
async def test_a_repeated_constrained_request_reuses_its_prompt_but_no_more(
    tiny_path: Path,
) -> None:
    params = greedy(StructuredOutput(json_schema=PERSON))
    prompt = schema_prompt(PERSON) * 3
    async with Engine.open(tiny_path, backend="cpu", block_size=4) as engine:
        first = await engine.complete(prompt, params)
        again = await engine.complete(prompt, params)
    assert first.token_ids == again.token_ids
    # The forced start was cached with the prompt; only the prompt counts as cached.
    assert 0 < again.usage.cached_tokens <= again.usage.prompt_tokens


@pytest.mark.anyio
async def test_a_forced_start_leaves_room_in_the_context_and_the_budget(
    tiny_path: Path,
) -> None:
    structured = StructuredOutput(json_schema=PERSON)  # forces `{"name":` before any choice
    async with Engine.open(tiny_path, backend="cpu") as engine:
        near_the_end = [5] * (engine.context_length - 2)
        at_the_end = await engine.complete(near_the_end, greedy(structured))
        assert at_the_end.finish_reason == "context"
        assert at_the_end.usage.completion_tokens == 2
        short = await engine.complete("x", greedy(structured, max_tokens=3))
        assert short.finish_reason == "length" and short.usage.completion_tokens == 3
        assert short.text.startswith("{")


@pytest.mark.anyio
async def test_seeded_constrained_sampling_repeats(tiny_path: Path) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=64,
                            structured=StructuredOutput(json_schema=PERSON))
    async with Engine.open(tiny_path, backend="cpu") as engine:
        first = await engine.complete(schema_prompt(PERSON), params)
        again = await engine.complete(schema_prompt(PERSON), params)
    assert first.token_ids == again.token_ids
    jsonschema.validate(json.loads(first.text), PERSON)


@pytest.mark.anyio
async def test_constrained_and_free_requests_together_get_what_they_get_alone(
    tiny_path: Path,
) -> None:
    requests = [
        ("Name a person:", greedy(StructuredOutput(json_schema=PERSON))),
        ("Once upon a time", greedy(max_tokens=24)),
        ("Date:", greedy(StructuredOutput(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))),
        ("The sea is", SamplingParams(temperature=0.8, seed=3, max_tokens=24)),
        ("Pick:", greedy(StructuredOutput(choice=["alpha", "beta"]))),
    ]
    async with Engine.open(tiny_path, backend="cpu") as engine:
        alone = [(await engine.complete(p, params)).token_ids for p, params in requests]
        together: list[tuple[int, ...]] = [()] * len(requests)

        async def one(index: int) -> None:
            prompt, params = requests[index]
            together[index] = (await engine.complete(prompt, params)).token_ids

        async with anyio.create_task_group() as group:
            for index in range(len(requests)):
                group.start_soon(one, index)
    assert together == alone


@pytest.mark.anyio
async def test_a_cancelled_constrained_request_frees_everything(tiny_path: Path) -> None:
    async with Engine.open(tiny_path, backend="cpu") as engine:
        params = greedy(StructuredOutput(regex="[a-z]{200}"), max_tokens=200)
        async with aclosing(engine.generate("x", params)) as stream:
            async for _ in stream:
                break
        with anyio.fail_after(10):
            while engine.stats().running or engine.stats().kv_blocks_used:
                await anyio.sleep(0.01)
        after = await engine.complete("Pick:", greedy(StructuredOutput(choice=["on", "off"])))
        assert after.text in ("on", "off")


@pytest.mark.anyio
async def test_a_schema_that_does_not_compile_fails_before_any_step(tiny_path: Path) -> None:
    async with Engine.open(tiny_path, backend="cpu") as engine:
        with pytest.raises(InvalidRequest) as caught:
            await engine.complete("x", greedy(StructuredOutput(json_schema={"type": "nope"})))
        assert caught.value.field == "structured.json_schema"
        assert engine.stats().steps == 0
        messages = [{"role": "user", "content": "hi"}]
        template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        with pytest.raises(InvalidRequest):
            async with aclosing(engine.chat(messages, greedy(StructuredOutput(regex="(")),
                                            template)) as stream:
                async for _ in stream:
                    pass
        assert engine.stats().steps == 0


async def answers_for_every_schema(path: Path) -> list[tuple[dict, str, str]]:
    async with Engine.open(path, backend="cpu") as engine:
        answers: list[tuple[dict, str, str]] = []

        async def one(schema: dict) -> None:
            done = await engine.complete(schema_prompt(schema), greedy(
                StructuredOutput(json_schema=schema), max_tokens=128))
            answers.append((schema, done.text, done.finish_reason))

        async with anyio.create_task_group() as group:
            for schema in SCHEMAS:
                group.start_soon(one, schema)
    return answers


def assert_every_answer_validates(answers: list[tuple[dict, str, str]]) -> None:
    assert len(answers) == len(SCHEMAS) >= 30
    for schema, text, finish in answers:
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.anyio
async def test_every_schema_holds_on_the_tiny_model(tiny_path: Path) -> None:
    assert_every_answer_validates(await answers_for_every_schema(tiny_path))


@pytest.mark.anyio
async def test_every_schema_holds_on_smollm2(smollm2_model_path: Path) -> None:
    assert_every_answer_validates(await answers_for_every_schema(smollm2_model_path))


@pytest.mark.anyio
async def test_every_schema_holds_on_gemma3(gemma3_model_path: Path) -> None:
    assert_every_answer_validates(await answers_for_every_schema(gemma3_model_path))
