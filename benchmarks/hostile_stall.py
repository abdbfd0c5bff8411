"""The worst event-loop stall while the engine handles hostile inputs, one at a time, with a
normal stream running beside them: runaway and huge chat templates, templates whose
operations would build gigabytes inside one C call (%-formatting and str.format widths, `~`
chains, str.translate, tojson indent, str() of containers), prompts of megabytes, ten million
token ids, two million chat messages, self-inconsistent model files opened by a second engine
(special tokens of 1 MiB, of placeholder code points, hundreds of long ones; millions of
metadata keys, tensors or nested arrays), model paths of the wrong type, a log stream that
fails mid-run, hostile HTTP requests to `q4k serve`'s app and connection limits running on
the same loop (deep JSON, bodies too large, slow or abandoned bodies, wrong content types, no
API key, a rebinding Host, a million-id prompt, 60,000 tools, 250,000 messages, 120,000 text
parts, heads of 100 MB, 3,000 silent connections), and
hostile structured-output constraints (deep $ref chains, long Lark and GBNF rule chains,
megabyte regex literals alone and eight at once, constraints that force long text or cost
milliseconds a mask beside the stream, a schema nested 1,000 deep, blank-line grammars, and
storms of slow compiles against small admission limits, cancelled, or cut by close). A ticker
task records the longest gap in the loop during each input (actors.loop_stall); the goal is
under 100 ms. The same is measured with no hostile input first, as the baseline the engine's
own work sets. The process's peak memory is printed after each input and last (the goal:
under 2 GB).

    python benchmarks/hostile_stall.py                    # gemma-3-270m
    python benchmarks/hostile_stall.py --model smollm2.gguf
"""

from __future__ import annotations

import argparse
import io
import json
import random
import resource
import socket
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import anyio
import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors import Engine, SamplingParams, StructuredOutput  # noqa: E402
from actors.errors import Q4KError  # noqa: E402
from actors.loop_stall import watch_loop  # noqa: E402
from actors.messages import Chunk  # noqa: E402
from actors.serve.app import build_app, freeze_long_lived_objects  # noqa: E402
from actors.serve.connections import ACCEPT_BACKLOG, bounded_h11_protocol  # noqa: E402
from actors.serve.guard import ConnectionLimits, RequestLimits  # noqa: E402
from tests.conftest import TINY_MODELS  # noqa: E402
from tests.fuzz import constraints, gguf_counts, gguf_structure  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hello"}]
BIG = "{% set x = 'a' * 1000000 %}"
TEMPLATES = {
    "template: 10^9 empty loop turns":
        "{% for i in range(30000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}",
    "template: macro recursing twice a level":
        "{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "template: 'a' * 10**9": "{{ 'a' * 10**9 }}",
    "template: output of 10^10 characters":
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "template: 25 nested for": "{% for a in x %}" * 25 + "{% endfor %}" * 25,
    "template: '%999999999s' % 'x'": "{{ '%999999999s' % 'x' }}",
    "template: '%*s' % (10**9, 'x')": "{{ '%*s' % (999999999, 'x') }}",
    "template: str.format, width from a variable":
        "{% set w = 1000000 %}{{ ('{:{w}}' * 1000).format(*range(1000), w=w) }}",
    # Values of 1 MB, each within gemma-3's limit (32,768 tokens x 48 bytes: 1.5 M characters).
    "template: 1,000-long ~ chain of 1 MB": BIG + "{{ x" + " ~ x" * 1000 + " }}",
    "template: str.translate, expanding table": "{{ ('a' * 1000000).translate({97: 'b' * 1000}) }}",
    "template: tojson(indent=10**6)": "{{ messages|tojson(indent=1000000) }}",
    "template: str() of 1,000 x 1 MB": BIG + "{% set many = [x] * 1000 %}{{ many }}",
    "template: |join, |tojson of 1,000 x 1 MB":
        BIG + "{% set many = [x] * 1000 %}{{ many|join }}{{ many|tojson }}",
    "template: 1 MB values piled in a list (memory ceiling)": BIG
        + "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
        "{% set ns.l = ns.l + [x ~ i] %}{% endfor %}",
}  # fmt: skip
# Hostile HTTP requests: (path, headers, body parts), each posted to the server; bodies are
# made in the sending thread, as they are sent (not held by this process).
KEY = "bench-key"
JSON = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
SMALL = '{"model": "m", "prompt": "hi"}'
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _chat_body(messages: str, extra: str = "") -> Callable[[], Iterator[bytes]]:
    """A chat body of `messages` (JSON text), `max_tokens` 2."""
    return lambda: iter([f'{{"model": "m", "max_tokens": 2{extra}, "messages": {messages}}}'
                         .encode()])


def _tools(count: int) -> str:
    return json.dumps([{"type": "function", "function": {
        "name": f"f{i}", "parameters": {"type": "object", "properties": {}}}}
        for i in range(count)])


USER = '{"role": "user", "content": "hi"}'
TEXT_PART = '{"type": "text", "text": "hi"}'
REQUESTS = {
    "http: JSON nested 1,000,000 deep (2 MB)":
        (COMPLETIONS, JSON, lambda: iter([b'{"x": ', b"[" * 10**6, b"]" * 10**6, b"}"])),
    "http: a 100 MB body (Content-Length)":
        (COMPLETIONS, {**JSON, "content-length": str(100 << 20)},
         lambda: (b" " * (1 << 20) for _ in range(100))),
    "http: a 100 MB body (chunked)":
        (COMPLETIONS, JSON, lambda: (b" " * (1 << 20) for _ in range(100))),
    "http: text/plain body":
        (COMPLETIONS, {**JSON, "content-type": "text/plain"}, lambda: iter([SMALL.encode()])),
    "http: no API key":
        (COMPLETIONS, {"content-type": "application/json", "content-length": str(len(SMALL))},
         lambda: iter([SMALL.encode()])),
    "http: DNS rebinding (Host: attacker.example)":
        (COMPLETIONS, {**JSON, "host": "attacker.example"}, lambda: iter([SMALL.encode()])),
    "http: a prompt of 1 million token ids":
        (COMPLETIONS, JSON, lambda: iter([b'{"model": "m", "max_tokens": 2, "prompt": [',
                                          b"1," * (10**6 - 1), b"1]}"])),
    "http: 60,000 tools, tool_choice none (5 MB)":
        (CHAT, JSON,
         _chat_body(f"[{USER}]", f', "tool_choice": "none", "tools": {_tools(60_000)}')),
    "http: 129 tools (past the bound)":
        (CHAT, JSON, _chat_body(f"[{USER}]", f', "tools": {_tools(129)}')),
    "http: 250,000 messages (8 MB)":
        (CHAT, JSON, _chat_body("[" + ", ".join([USER] * 250_000) + "]")),
    "http: 120,000 text parts in one message":
        (CHAT, JSON, _chat_body('[{"role": "user", "content": ['
                                + ", ".join([TEXT_PART] * 120_000) + "]}]")),
}  # fmt: skip
BAD_FILES = {
    "model file: 512 embedding rows, 1,024 tokens":
        gguf_structure.Mutation("tensor_rows", "token_embd.weight", size=512),
    "model file: 3,000-character special token":
        gguf_structure.Mutation("token", index=5, text="<" + "x" * 3000 + ">", token_type=3),
    "model file: 256 KiB user-defined token":
        gguf_structure.Mutation("token", index=5, text="<" + "x" * 2**18 + ">", token_type=4),
    "model file: 1 MiB user-defined token":
        gguf_structure.Mutation("token", index=5, text="<" + "x" * 2**20 + ">", token_type=4),
}  # fmt: skip
# Special tokens that open: the old splitter's placeholders as texts; 400 of 1,000 characters
# (merges dropped, so the merged tokens they replace are free).
PLACEHOLDER_SPECIALS = [
    gguf_structure.Mutation("token", index=index, text=text, token_type=4)
    for index, text in zip(range(3, 6), ("\x00", "\uffff", "\U0010fffe"))
]
LONG_SPECIALS = [
    gguf_structure.Mutation(
        "set", "tokenizer.ggml.merges",
        gguf_structure.Value(gguf_structure.T.ARRAY, [], gguf_structure.T.STRING),
    ),
    *(gguf_structure.Mutation("token", index=i, text=f"<{i:04d}" + "q" * 1000 + ">", token_type=4)
      for i in range(600, 1000)),
]  # fmt: skip
COUNT_FILES = {
    "model file: 2 million metadata keys": lambda: gguf_counts.many_keys(2_000_000),
    "model file: 2 million one-element tensors": lambda: gguf_counts.many_tensors(2_000_000),
    "model file: 2 million nested arrays": lambda: gguf_counts.nested_arrays(2_000_000),
}


async def outcome_of(action: Callable[[], Awaitable[object]]) -> str:
    """The project error's name, what the action says it came to (an HTTP status, a count
    of outcomes), or "ok"."""
    try:
        result = await action()
    except Q4KError as exc:
        return type(exc).__name__
    return result if isinstance(result, str) else "ok"


async def drain(chunks: AsyncIterator[Chunk]) -> None:
    async with aclosing(chunks):
        async for _ in chunks:
            pass


def hostile_inputs(engine: Engine, folder: Path) -> dict[str, Callable[[], Awaitable[object]]]:
    inputs: dict[str, Callable[[], Awaitable[object]]] = {
        name: (lambda source=source: drain(engine.chat(MESSAGES, SamplingParams(max_tokens=2), source)))
        for name, source in TEMPLATES.items()
    }
    for megabytes in (1, 10):
        text = "The quick brown fox. " * (megabytes * 2**20 // 21)
        inputs[f"prompt: {megabytes} MB of text"] = lambda text=text: drain(
            engine.generate(text, SamplingParams(max_tokens=2))
        )
    ids, messages = [1] * 10_000_000, MESSAGES * 2_000_000
    inputs["prompt: 10 million token ids"] = lambda: drain(
        engine.generate(ids, SamplingParams(max_tokens=2))
    )
    inputs["chat: 2 million messages"] = lambda: drain(
        engine.chat(messages, SamplingParams(max_tokens=2))
    )
    tiny = gguf_structure.seed_parts("llama-q4k-tiny")
    for name, mutations, text in (
        *((name, [mutation], "hello") for name, mutation in BAD_FILES.items()),
        ("model file: placeholder code points as special texts", PLACEHOLDER_SPECIALS,
         "a\x00b\uffff\U0010fffe"),
        ("model file: 400 special tokens of 1,000 characters", LONG_SPECIALS, "hello <0600"),
    ):  # fmt: skip
        path = folder / f"{len(inputs)}.gguf"
        parts = tiny
        for mutation in mutations:
            parts = gguf_structure.apply(parts, mutation)
        gguf_structure.write_gguf(parts, path)
        inputs[name] = lambda path=path, text=text: _open_and_use(path, text)
    for name, make in COUNT_FILES.items():
        path = folder / f"{len(inputs)}.gguf"
        path.write_bytes(make())
        inputs[name] = lambda path=path: _open_and_use(path)
    for source in (b"model.gguf", 42, ["model.gguf"]):
        inputs[f"Engine.open({source!r})"] = lambda source=source: _open_and_use(source)
    inputs["log stream failing mid-run (disk full), 3 requests"] = _with_failing_log
    return inputs | constraint_inputs(engine)


def constraint_inputs(engine: Engine) -> dict[str, Callable[[], Awaitable[object]]]:
    """Hostile structured-output constraints, each run on `engine` beside the stream; the
    compile storms on a tiny engine with small admission limits (4 running + 4 queued)."""
    literal = "".join(random.Random(0).choice("abcdefghij ") for _ in range((1 << 20) - 1))
    single = {
        "$ref chain 1,000 objects deep": {"json_schema": constraints.ref_chain(1_000, "items")},
        "$ref chain 5,000 deep (past the bound)":
            {"json_schema": constraints.ref_chain(5_000, "properties")},
        "$ref chain 85, each 45 objects deep (near the bound)": {
            "json_schema": constraints.ref_chain(85, "required-property", "$defs", 45)},
        "Lark chain of 4,000 rules": {"grammar": constraints.lark_rule_chain(4_000)},
        "GBNF chain of 3,000 rules (80 KB)": {"grammar": constraints.gbnf_rule_chain(3_000)},
        "GBNF chain of 300 rules (near its work bound)":
            {"grammar": constraints.gbnf_rule_chain(300)},
        "1 MiB regex literal": {"regex": literal},
        "x{100000}": {"regex": "x{100000}"},
        "a 100 KB const after a free integer": {"json_schema": {
            "type": "object", "required": ["n", "tail"],
            "properties": {"n": {"type": "integer"}, "tail": {"const": "yz" * 50_000}}}},
        "1 MiB of blank lines as a grammar": {"grammar": "\n" * (1 << 20) + "x"},
    }
    inputs: dict[str, Callable[[], Awaitable[object]]] = {
        f"constraint: {name}": (lambda fields=fields: _constrained(engine, fields))
        for name, fields in single.items()
    }
    inputs["constraint: 8 x 1 MiB regex literals at once"] = lambda: _outcomes(
        [_constrained(engine, {"regex": literal}) for _ in range(8)])
    inputs["constraint: 8 rows of x{40000} (a costly mask each step)"] = lambda: _outcomes(
        [_constrained(engine, {"regex": "x{40000}", "fast_forward": False}, 24)
         for _ in range(8)])
    inputs["constraint: a schema nested 1,000 deep"] = lambda: _constrained(
        engine, {"json_schema": constraints.nested_schema(1_000)})
    inputs["constraint: 60 slow compiles, limits 4 + 4"] = _compile_storm
    inputs["constraint: 40 slow compiles cancelled"] = _cancelled_compiles
    inputs["constraint: close() with 8 compiles waiting"] = _closed_during_compiles
    return inputs


async def _constrained(engine: Engine, fields: dict[str, object], max_tokens: int = 8) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0,
                            structured=StructuredOutput(**fields))  # type: ignore[arg-type]
    await engine.complete("Answer:", params)


async def _outcomes(requests: list[Awaitable[object]]) -> str:
    """Run `requests` at once: how many ended how."""
    ended: Counter[str] = Counter()

    async def one(request: Awaitable[object]) -> None:
        ended[await outcome_of(lambda: request)] += 1

    async with anyio.create_task_group() as tasks:
        for request in requests:
            tasks.start_soon(one, request)
    return ", ".join(f"{count} {name}" for name, count in ended.most_common())


# A compile of a second or more (llguidance's own work, mostly without the GIL), and small
# limits.
SLOW_GRAMMAR = {"json_schema": constraints.ref_chain(80, "required-property", "$defs", 45)}
SMALL_LIMITS = {"max_sequences": 4, "max_queued": 4}


async def _compile_storm() -> str:
    async with Engine.open(TINY_MODELS["llama-q4k-tiny"], **SMALL_LIMITS) as small:
        return await _outcomes([_constrained(small, SLOW_GRAMMAR) for _ in range(60)])


async def _cancelled_compiles() -> str:
    async with Engine.open(TINY_MODELS["llama-q4k-tiny"]) as small:
        before = _threads()
        with anyio.move_on_after(0.5):
            await _outcomes([_constrained(small, SLOW_GRAMMAR) for _ in range(40)])
        during = _threads()
        await anyio.sleep(3.0)  # the compiles that had started end on their own
        return f"threads {before} -> {during} when cancelled -> {_threads()} 3 s later"


def _threads() -> int:
    """The process's threads, as the kernel counts them (compile threads are bare ones)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("Threads:")[1].split()[0])


async def _closed_during_compiles() -> str:
    async with Engine.open(TINY_MODELS["llama-q4k-tiny"]) as small:

        async def close_soon() -> None:
            await anyio.sleep(0.3)
            small.close()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(close_soon)
            return await _outcomes([_constrained(small, SLOW_GRAMMAR) for _ in range(8)])


async def _open_and_use(path: object, text: str = "hello") -> None:
    async with Engine.open(path) as other:  # type: ignore[arg-type]
        await other.complete(text, SamplingParams(max_tokens=2))


class _DiskFull(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


async def _with_failing_log() -> None:
    tiny = TINY_MODELS["llama-q4k-tiny"]
    async with Engine.open(tiny, log_level="debug", log_file=_DiskFull()) as other:
        for _ in range(3):
            await other.complete("hello", SamplingParams(max_tokens=2))


def _reset_peak_rss() -> None:
    """Start the kernel's peak-RSS count afresh (Linux: 5 > /proc/self/clear_refs), so the
    peak leaves out what building the inputs took."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        print("(cannot reset the peak RSS here: the peak includes building the inputs)")


def _status_mib(field: str) -> float:
    """A memory figure of /proc/self/status (VmRSS, VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[str]:
    """`q4k serve`'s app and connection limits over `engine`, on this event loop (bodies and
    heads time out after 1 s here): its base URL."""

    @asynccontextmanager
    async def the_engine() -> AsyncIterator[Engine]:
        freeze_long_lived_objects()  # as q4k serve does once its engine is open
        yield engine

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    limits = RequestLimits(body_timeout_s=1.0, api_key=KEY)
    app = build_app(the_engine, "m", limits=limits)
    connections = ConnectionLimits(head_timeout_s=1.0)
    server = uvicorn.Server(uvicorn.Config(app, http=bounded_h11_protocol(connections),
                                           backlog=ACCEPT_BACKLOG, log_config=None,
                                           access_log=False))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(server.serve, [listener])
        while not server.started:
            await anyio.sleep(0.01)
        yield "http://127.0.0.1:%d" % listener.getsockname()[1]
        server.should_exit = True


def http_inputs(url: str) -> dict[str, Callable[[], Awaitable[object]]]:
    """Each request sent from a worker thread (the client's own work stays off the loop)."""
    host, port = url.removeprefix("http://").split(":")

    def send(path: str, headers: dict[str, str], body: Callable[[], Iterator[bytes]]) -> str:
        with httpx.Client(base_url=url, timeout=60) as client:
            response = client.post(path, headers=headers, content=body())
            return f"HTTP {response.status_code}"

    def head(fields: dict[str, str]) -> bytes:  # a request line and header fields, unended
        return "".join([f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                        *(f"{name}: {value}\r\n" for name, value in fields.items())]).encode()

    def slow_body() -> str:  # a body that never finishes, then one abandoned mid-way
        request = head({**JSON, "content-length": "1000"}) + b"\r\n{"
        with socket.create_connection((host, int(port))) as slow:
            slow.sendall(request)
            status = slow.recv(100).split(b" ")[1].decode()
        with socket.create_connection((host, int(port))) as leaving:
            leaving.sendall(request)
        return f"HTTP {status}"

    def header_flood() -> str:  # 8 connections each sending 100 MB of one unfinished head
        def flood(_: int) -> str:
            line = b"X-Pad: " + b"a" * (1 << 20) + b"\r\n"
            with socket.create_connection((host, int(port))) as connection:
                try:
                    connection.sendall(head(JSON))
                    for _ in range(100):
                        connection.sendall(line)
                except OSError:  # the server answered and closed: read its answer
                    pass
                return connection.recv(100).split(b" ")[1].decode() or "closed"

        with ThreadPoolExecutor(8) as pool:
            statuses = Counter(pool.map(flood, range(8)))
        return ", ".join(f"{count} HTTP {status}" for status, count in statuses.items())

    def half_open(count: int = 3_000) -> str:  # connections that send nothing, then a request
        silent = [socket.create_connection((host, int(port))) for _ in range(count)]
        try:
            status = send(COMPLETIONS, JSON, lambda: iter([SMALL.encode()]))
        finally:
            for connection in silent:
                connection.close()
        return f"then {status}"

    inputs: dict[str, Callable[[], Awaitable[object]]] = {
        name: (lambda request=request: anyio.to_thread.run_sync(send, *request))
        for name, request in REQUESTS.items()
    }
    inputs["http: a slow body (1 s limit), then one abandoned"] = (
        lambda: anyio.to_thread.run_sync(slow_body))
    inputs["http: 8 heads of 100 MB, unfinished"] = lambda: anyio.to_thread.run_sync(header_flood)
    inputs["http: 3,000 connections that send nothing"] = (
        lambda: anyio.to_thread.run_sync(half_open))
    return inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: gemma-3-270m)")
    parser.add_argument("--only", default="", help="run only the inputs whose name holds this")
    args = parser.parse_args()

    async def run() -> None:
        async with Engine.open(args.model, log_level="critical") as engine:
            tokens = [0]

            async def bystander() -> None:
                params = SamplingParams(max_tokens=100_000, temperature=0.8, seed=1, ignore_eos=True)
                async with aclosing(engine.generate("Once upon a time", params)) as chunks:
                    async for _ in chunks:
                        tokens[0] += 1

            with tempfile.TemporaryDirectory() as folder:
                inputs = hostile_inputs(engine, Path(folder))
                async with serving(engine) as url, anyio.create_task_group() as tasks:
                    inputs |= http_inputs(url)
                    tasks.start_soon(bystander)
                    await anyio.sleep(2.0)  # past the prefill: a steady decode
                    async with watch_loop() as watch:
                        await anyio.sleep(3.0)
                    print(f"{'baseline: a decoding stream alone (3 s)':<48} {'-':<22} "
                          f"{watch.worst_stall_ms:8.1f} ms")
                    print(f"memory (RSS) before the hostile inputs: "
                          f"{_status_mib('VmRSS'):,.0f} MiB")
                    worst = 0.0
                    chosen = {name: act for name, act in inputs.items() if args.only in name}
                    _reset_peak_rss()  # the peak below is the engine's while inputs run
                    for name, action in chosen.items():
                        before, started = tokens[0], time.perf_counter()
                        async with watch_loop() as watch:
                            result = await outcome_of(action)
                        worst = max(worst, watch.worst_stall_ms)
                        print(f"{name:<48} {result:<22} {watch.worst_stall_ms:8.1f} ms  "
                              f"({time.perf_counter() - started:5.2f} s, the stream got "
                              f"{tokens[0] - before} tokens meanwhile; peak RSS so far "
                              f"{_status_mib('VmHWM'):,.0f} MiB)", flush=True)
                    print(f"worst loop stall over the hostile inputs: {worst:.1f} ms")
                    print(f"peak memory (RSS) of the process while they ran: "
                          f"{_status_mib('VmHWM'):,.0f} MiB")
                    tasks.cancel_scope.cancel()

    anyio.run(run)


if __name__ == "__main__":
    main()
