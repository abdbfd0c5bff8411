"""Several answers a request (`n`) and `logit_bias`, through `q4k serve` (a subprocess, as
tests/test_server.py starts it) on SmolLM2-135M-Instruct with the official `openai` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from actors.model.loaded import open_model
from test_cli_logs import CALL_TIMEOUT_S
from test_server import (  # noqa: F401 (client, server: the fixtures)
    LONG_ANSWER,
    QUESTION,
    Server,
    _until_idle,
    client,
    server,
)

pytestmark = pytest.mark.slow
SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 12}


@pytest.fixture(scope="module")
def token_id(smollm2_model_path: Path) -> Iterator:
    """The id of a text that is one token of the model's vocabulary."""
    model = open_model(smollm2_model_path)
    try:
        def one_token(text: str) -> int:
            (token,) = model.tokenizer.encode(text, add_bos=False)
            return token

        yield one_token
    finally:
        model.gguf.close()


def test_three_chat_answers_whole_each_finished_and_reproducible(
        server: Server, client: openai.OpenAI) -> None:
    def ask() -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model=server.model, messages=QUESTION, n=3,
                                              logprobs=True, **SAMPLED)

    answer = ask()
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
        # Each choice's logprobs are its own answer's tokens.
        assert "".join(entry.token for entry in choice.logprobs.content) \
            == choice.message.content
    texts = [choice.message.content for choice in answer.choices]
    assert len(set(texts)) == 3
    assert [choice.message.content for choice in ask().choices] == texts
    alone = client.chat.completions.create(model=server.model, messages=QUESTION, **SAMPLED)
    assert alone.choices[0].message.content == texts[0]
    # The prompt counted once, every answer's tokens counted.
    assert answer.usage.prompt_tokens == alone.usage.prompt_tokens
    assert answer.usage.completion_tokens > alone.usage.completion_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_three_completions_streamed_carry_their_index_and_finish_each(
        server: Server, client: openai.OpenAI) -> None:
    prompt = "My favourite food is"
    stream = client.completions.create(model=server.model, prompt=prompt, n=3, stream=True,
                                       stream_options={"include_usage": True}, **SAMPLED)
    texts = {0: "", 1: "", 2: ""}
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(reasons) == 1 and reasons[0] in ("stop", "length")
               for reasons in finishes.values())
    assert len(set(texts.values())) == 3
    whole = client.completions.create(model=server.model, prompt=prompt, n=3, **SAMPLED)
    assert [choice.text for choice in whole.choices] == [texts[0], texts[1], texts[2]]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_a_chat_stream_of_three_answers_ends_each_with_its_finish_reason(
        server: Server, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=server.model, messages=QUESTION, n=3,
                                            stream=True, **SAMPLED)
    contents = {0: "", 1: "", 2: ""}
    ended: list[int] = []
    for chunk in stream:
        (choice,) = chunk.choices
        assert choice.index not in ended  # nothing of an answer follows its finish
        if choice.finish_reason is not None:
            ended.append(choice.index)
        else:
            contents[choice.index] += choice.delta.content or ""
    assert sorted(ended) == [0, 1, 2]
    whole = client.chat.completions.create(model=server.model, messages=QUESTION, n=3,
                                           **SAMPLED)
    assert [contents[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_each_answer_is_held_to_its_own_constraint(server: Server,
                                                   client: openai.OpenAI) -> None:
    options = ["Paris", "London", "Rome", "Madrid"]
    answer = client.chat.completions.create(
        model=server.model, messages=QUESTION, n=4, temperature=1.5, seed=3, max_tokens=8,
        extra_body={"guided_choice": options})
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    assert all(choice.message.content in options for choice in answer.choices)


def test_logit_bias_plus_100_forces_a_token(server: Server, client: openai.OpenAI,
                                            token_id) -> None:
    banana = token_id(" banana")
    answer = client.completions.create(model=server.model, prompt="The capital of France is",
                                       logit_bias={str(banana): 100}, max_tokens=5,
                                       temperature=1.0, seed=1)
    assert answer.choices[0].text == " banana" * 5


def test_logit_bias_minus_100_bans_the_greedy_token(server: Server, client: openai.OpenAI,
                                                    token_id) -> None:
    paris = token_id(" Paris")

    def ask(**fields: object) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model=server.model, messages=QUESTION,
                                              temperature=0, max_tokens=24, logprobs=True,
                                              **fields)

    def tokens(answer: openai.types.chat.ChatCompletion) -> list[str]:
        return [entry.token for entry in answer.choices[0].logprobs.content]

    assert " Paris" in tokens(ask())
    banned = ask(logit_bias={str(paris): -100})
    assert " Paris" not in tokens(banned) and banned.choices[0].message.content


def test_n_and_logit_bias_out_of_bounds_are_400s_naming_them(
        server: Server, client: openai.OpenAI) -> None:
    for fields, param in (({"n": 129}, "n"), ({"n": 0}, "n"),
                          ({"logit_bias": {"49152": 5}}, "logit_bias"),
                          ({"logit_bias": {"5": 100.5}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2,
                                           **fields)
        assert caught.value.body["param"] == param
        assert param in caught.value.body["message"]


def test_a_client_that_leaves_cancels_every_answer(server: Server) -> None:
    def cancelled() -> int:
        return sum(json.loads(line)["event"] == "request_cancelled"
                   for line in server.log.read_text().splitlines())

    with httpx.Client(base_url=server.url, timeout=CALL_TIMEOUT_S) as http:
        request = http.build_request("POST", "/v1/completions", json={
            "model": server.model, "prompt": "Tell me a story.", "stream": True, "n": 3,
            **LONG_ANSWER})
        response = http.send(request, stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()
        running: set[int] = set()
        while len(running) < 3:  # every answer has streamed a chunk
            line = next(lines)
            if line.startswith("data: {"):
                running.add(json.loads(line.removeprefix("data: "))["choices"][0]["index"])
        before = cancelled()
        response.close()
        metrics = _until_idle(http)
    assert metrics['q4k_kv_blocks{state="used"}'] == 0
    assert cancelled() - before == 3
