"""The ASGI app of `q4k serve`: the OpenAI HTTP API over one engine (Starlette).

The engine opens in the background once the server runs, so `/health` answers 503 while the
model loads and 200 after. Each generation request runs in its HTTP request's task and races
the client's disconnect: a client that goes away cancels its request at once, which drops its
sequence from the next step. Errors are OpenAI's JSON error objects, never a traceback.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors.errors import (
    ContextLengthExceeded,
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
    Q4KError,
    TemplateError,
)
from actors.logs import get_logger
from actors.messages import Chunk
from actors.serve.fingerprint import name_digest, system_fingerprint
from actors.serve.guard import RequestGuard, RequestLimits
from actors.serve.metrics import Metrics, outcome_of
from actors.serve.protocol import (
    Generation,
    chat_generation,
    completion_generation,
    with_tool_grammar,
)
from actors.serve.replies import (
    ChatShape,
    CompletionsShape,
    Reply,
    error_body,
    error_event,
)
from actors.serve.tools import ToolCallFormat, ToolChoice, generic_chat

if TYPE_CHECKING:
    from actors.engine import Engine

T = TypeVar("T")
# What a client should wait before retrying an overloaded or still-loading server.
RETRY_AFTER_S = 1
# What a request whose client disconnected answers (nginx's 499; nobody reads it).
CLIENT_LEFT = Response(status_code=499)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Bodies up to this size are read into a request on the event loop (well under a millisecond);
# larger ones in a worker thread, as the engine tokenizes long prompts: reading a body
# (decoding it, its messages, tools, schema texts, token ids) takes time linear in its size.
CONVERT_ON_LOOP_BYTES = 64 << 10
# Large bodies are read one at a time, with the garbage collector paused (see `converted`).
CONVERSIONS_AT_ONCE = 1

OpenEngine = Callable[[], AbstractAsyncContextManager["Engine"]]


class EngineHost:
    """Opens the engine in the background and holds it until the app stops; a load that fails
    is logged and handed to `on_failure` (the CLI stops the server with it)."""

    def __init__(self, open_engine: OpenEngine,
                 on_failure: Callable[[Q4KError], None] | None = None) -> None:
        self.engine: Engine | None = None
        self._open_engine = open_engine
        self._on_failure = on_failure
        self._stopped = anyio.Event()
        self._log = get_logger("actors.server")

    async def run(self) -> None:
        try:
            async with self._open_engine() as engine:
                self.engine = engine
                await self._stopped.wait()
        except Q4KError as exc:
            self._log.error("engine_failed", error=str(exc))
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            self.engine = None

    def stop(self) -> None:
        self._stopped.set()


class _NotReady(EngineClosed):
    """The model is still loading (or failed to load): the engine is not open yet."""


class _UnknownModel(InvalidRequest):
    """The request names a model this server does not serve."""


def error_status(exc: Q4KError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error object for a project error."""
    param = getattr(exc, "field", None)
    if isinstance(exc, ContextLengthExceeded):
        return 400, error_body(str(exc), "invalid_request_error", param,
                               "context_length_exceeded")
    if isinstance(exc, _UnknownModel):
        return 404, error_body(str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, InvalidRequest):
        return 400, error_body(str(exc), "invalid_request_error", param)
    if isinstance(exc, TemplateError):
        return 400, error_body(str(exc), "invalid_request_error", "messages",
                               "template_error")
    if isinstance(exc, EngineOverloaded):
        return 429, error_body(str(exc), "rate_limit_error", None, "engine_overloaded")
    if isinstance(exc, EngineClosed):
        return 503, error_body(str(exc), "server_error", None, "model_not_ready")
    return 500, error_body(str(exc), "server_error", None, "compute_error")


def error_response(exc: Q4KError) -> Response:
    status, body = error_status(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return json_response(body, status, headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


async def cancel_on_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work` until it ends, or until the client disconnects: then cancel it and return
    None. Call it once the request body has been read (later messages can only be the end)."""
    results: list[T] = []
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tasks:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        try:
            results.append(await work())
        except Exception as exc:  # re-raised bare below, not inside an ExceptionGroup
            errors.append(exc)
        tasks.cancel_scope.cancel()
    if errors:
        raise errors[0]
    return results[0] if results else None


class EventStream:
    """A server-sent-events response that stops (closing `events`) when the client leaves,
    whatever the ASGI server's spec version; a project error mid-stream becomes an error event."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def pump() -> None:
            async with aclosing(self._events) as events:
                try:
                    async for event in events:
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                except Q4KError as exc:
                    event = error_event(error_status(exc)[1])
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await cancel_on_disconnect(receive, pump)


class AccessLog:
    """One `http_request` log line per request: method, path, status, duration."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._log = get_logger("actors.server")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            client = scope.get("client") or ("", 0)
            self._log.info("http_request", method=scope["method"], path=scope["path"],
                           status=status or 500, client=f"{client[0]}:{client[1]}",
                           ms=round((time.perf_counter() - started) * 1000.0, 3))


class _NoChat(TemplateError):
    """The model has no chat template and the server was given none."""


class ServerOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How `q4k serve` was started: the chat template (None = the model's own), whether there
    is one at all, the most tokens one request may ask for (None = up to the context), and
    the model file's digest (`fingerprint.model_digest`; None: the served name's stands in)."""

    chat_template: str | None = None
    chat_available: bool = True
    max_tokens_limit: int | None = None
    model_digest: str | None = None


class OpenAIServer:
    """The endpoints, over one `EngineHost`."""

    def __init__(self, host: EngineHost, model_name: str, options: ServerOptions) -> None:
        self.host = host
        self.model_name = model_name
        self.options = options
        self.metrics = Metrics()
        self.started = int(time.time())
        # How the chat template's model writes tool calls: read from its source on first use.
        self._tool_format: ToolCallFormat | None = None
        self._model_digest = options.model_digest or name_digest(model_name)
        self._conversions = anyio.CapacityLimiter(CONVERSIONS_AT_ONCE)

    async def health(self, request: Request) -> Response:
        if self.host.engine is None:
            return error_response(_NotReady("the model is loading"))
        return json_response({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's `models.retrieve`)."""
        asked = request.path_params["model_id"]
        if asked != self.model_name:
            return error_response(self.unknown_model(asked))
        return json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.started,
                "owned_by": "q4k-actors"}

    def unknown_model(self, asked: str) -> _UnknownModel:
        """The refusal of a request for a model this server does not serve (404)."""
        return _UnknownModel(f"the model {asked!r} does not exist here; this server serves "
                             f"{self.model_name!r} (GET /v1/models)", field="model")

    async def metrics_text(self, request: Request) -> Response:
        engine = self.host.engine
        text = self.metrics.render(engine.stats() if engine is not None else None)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        if not self.options.chat_available:
            refusal = _NoChat(
                f"the model {self.model_name!r} has no chat template, so this server cannot "
                "answer /v1/chat/completions: restart `q4k serve` with --template FILE (a Jinja "
                "chat template for this model), or send plain text to /v1/completions")
            self.metrics.count(outcome_of(refusal))
            return error_response(refusal)
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response | EventStream:
        generation = None
        try:
            engine = self.ready_engine()
            generation = await self._generation(request, chat, engine)
            chunks = self.start(engine, generation)  # refuses an n past the engine's bound
            # Each answer reads its own text (its own tool calls).
            shapes = [await self._shape(generation, engine) if chat else CompletionsShape()
                      for _ in range(generation.n)]
        except Q4KError as exc:
            self.metrics.count(outcome_of(exc))
            return error_response(as_asked(exc, generation))
        reply = Reply(shapes, model=self.model_name, fingerprint=self.fingerprint(engine),
                      want_logprobs=generation.params.logprobs is not None,
                      include_usage=generation.include_usage,
                      token_text=lambda token: engine.detokenize([token]),
                      count=self.metrics.count)
        try:
            if generation.stream:
                first = await cancel_on_disconnect(request.receive, lambda: reply.first(chunks))
                return CLIENT_LEFT if first is None else EventStream(reply.events(first, chunks))
            whole = await cancel_on_disconnect(request.receive, lambda: reply.whole(chunks))
        except Q4KError as exc:  # the reply counted it
            await chunks.aclose()
            return error_response(as_asked(exc, generation))
        return CLIENT_LEFT if whole is None else json_response(whole)

    async def converted(self, body: bytes, convert: Callable[[bytes], T]) -> T:
        """`convert(body)`, on the event loop for a small body and in a worker thread past
        CONVERT_ON_LOOP_BYTES, so that no body holds the loop while it is read."""
        if len(body) <= CONVERT_ON_LOOP_BYTES:
            return convert(body)
        # Abandoned on cancel: the thread only computes, and ends on its own.
        return await anyio.to_thread.run_sync(_without_collections, convert, body,
                                              limiter=self._conversions, abandon_on_cancel=True)

    async def _generation(self, request: Request, chat: bool, engine: Engine) -> Generation:
        limit = self.options.max_tokens_limit
        if chat:
            convert = partial(chat_generation, context_length=engine.context_length,
                              max_tokens_limit=limit)
        else:
            convert = partial(completion_generation, max_tokens_limit=limit)
        generation = await self.converted(await request.body(), convert)
        if generation.model != self.model_name:
            raise self.unknown_model(generation.model)
        if generation.tools is not None:
            generation = with_tool_grammar(generation, await self.tool_call_format(engine))
        return generation

    async def _shape(self, generation: Generation, engine: Engine) -> ChatShape:
        """A chat reply; one that reads the answer's tool calls when the request has tools."""
        if generation.tools is None:
            return ChatShape()
        tool_format = await self.tool_call_format(engine)
        return ChatShape(tool_format.reader(generation.tools.names, generation.tools.parallel))

    async def tool_call_format(self, engine: Engine) -> ToolCallFormat:
        """How the chat template's model writes tool calls (read once, off the loop)."""
        if self._tool_format is None:
            self._tool_format = await anyio.to_thread.run_sync(self._read_tool_format, engine)
        return self._tool_format

    def _read_tool_format(self, engine: Engine) -> ToolCallFormat:
        """The format the chat template writes calls in, for this model's tokenizer."""
        template = engine.chat_template(self.options.chat_template)
        return ToolCallFormat.of_template(template).with_vocabulary(
            lambda text, special: engine.tokenize(text, add_bos=False, parse_special=special),
            engine.detokenize)

    def start(self, engine: Engine, generation: Generation) -> AsyncIterator[Chunk]:
        """The engine's answer to `generation`: its chat (through the template, with the
        tools as the template takes them) or its prompt."""
        # A max_tokens the client gave must fit beside the prompt (OpenAI's rule); without one
        # the answer runs at most to the end of the context.
        must_fit = generation.max_tokens_field is not None
        if generation.messages is not None:
            messages, tools = self._template_input(generation.messages, generation.tools)
            return engine.chat(messages, generation.params, self.options.chat_template,
                               tools=tools, chat_template_kwargs=generation.chat_template_kwargs,
                               strict_max_tokens=must_fit, n=generation.n,
                               reasoning_budget=generation.reasoning_budget)
        return engine.generate(generation.prompt, generation.params, strict_max_tokens=must_fit,
                               n=generation.n)

    def _template_input(self, messages: list[dict[str, Any]], choice: ToolChoice | None,
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The chat and the tools its template gets: the tools as its `tools` variable, or
        for a template that renders none (the generic format) described in the chat."""
        if choice is None:
            return messages, None
        # A request with tools has read the format first, for its grammar and its reader.
        if self._tool_format is None or self._tool_format.renders_tools:
            return messages, list(choice.tools)
        return generic_chat(messages, choice), None

    def fingerprint(self, engine: Engine) -> str:
        """The replies' `system_fingerprint`: this engine's version and backend, this model."""
        return system_fingerprint(self._model_digest, engine.info.on_gpu)

    def ready_engine(self) -> Engine:
        """The open engine; `_NotReady` (503) while the model loads."""
        engine = self.host.engine
        if engine is None:
            raise _NotReady("the model is still loading; retry shortly (GET /health says when)")
        return engine


def freeze_long_lived_objects() -> None:
    """Keep the objects alive now (a just-opened engine's: its vocabulary's tables, the
    grammar tokenizer) out of every later garbage collection, for a process that serves one
    engine for its life (`q4k serve`, a Ray replica). A full collection walks every tracked
    object holding the GIL: with gemma-3-270m open, about 100 ms of event loop each time a
    request's objects set one off; frozen, only the objects made since are walked."""
    gc.collect()
    gc.freeze()


def _without_collections(convert: Callable[[bytes], T], body: bytes) -> T:
    """`convert(body)` with automatic garbage collection paused. A body builds up to some
    hundred thousand objects; each full collection their growth sets off walks every object of
    the process, holding every thread, the event loop's too (a 1 MiB schema: three passes, 128
    ms; paused, 20 ms and one young pass later, 11 ms). One conversion runs at a time
    (CONVERSIONS_AT_ONCE), so a pause ends with it and the collector runs between them."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return convert(body)
    finally:
        if was_enabled:
            gc.enable()


def as_asked(exc: Q4KError, generation: Generation | None) -> Q4KError:
    """`exc` naming the request field the client used: its max_tokens field, or the field
    that asked for structured output (the engine names `structured.<kind>`)."""
    if generation is None or not isinstance(exc, InvalidRequest):
        return exc
    field = exc.field or ""
    if field.startswith("structured.") and generation.structured_field is not None:
        asked = generation.structured_field
        return InvalidRequest(f"{asked}: {exc}", field=asked)
    asked = generation.max_tokens_field
    if not isinstance(exc, ContextLengthExceeded) or field != "max_tokens" or asked is None:
        return exc
    return ContextLengthExceeded(str(exc).replace("max_tokens", asked), field=asked)


async def _not_found(request: Request, exc: HTTPException) -> Response:
    return json_response(error_body(f"{request.method} {request.url.path}: "
                                    f"{exc.detail}", "invalid_request_error"), exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    get_logger("actors.server").exception("server_error", path=request.url.path)
    return json_response(error_body("internal server error (logged)", "server_error"), 500)


def build_app(open_engine: OpenEngine, model_name: str,
              on_failure: Callable[[Q4KError], None] | None = None,
              options: ServerOptions = ServerOptions(),
              limits: RequestLimits | None = None) -> ASGIApp:
    """The server's ASGI app: `open_engine()` is entered once the server starts; every request
    passes `limits` (RequestGuard) first."""
    # Imported here: the Responses endpoint builds on this module's server and helpers.
    from actors.serve.responses import ResponsesEndpoint

    host = EngineHost(open_engine, on_failure)
    server = OpenAIServer(host, model_name, options)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(host.run)
            try:
                yield
            finally:
                host.stop()

    app = Starlette(
        routes=[
            Route("/health", server.health),
            Route("/metrics", server.metrics_text),
            Route("/v1/models", server.models),
            Route("/v1/models/{model_id:path}", server.model),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/responses", ResponsesEndpoint(server).create, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _not_found, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.server = server
    return AccessLog(RequestGuard(app, limits or RequestLimits()))
