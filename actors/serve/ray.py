"""Replicas of `q4k serve` on Ray Serve: one engine a replica behind one endpoint, the same
OpenAI app, prefix-affine routing (pip install 'q4k-actors[ray]').

One Serve application of two deployments:

- `EngineReplica` (N replicas, Ray Serve's autoscaling if asked): opens one `Engine` and runs
  the ASGI app of `q4k serve` (`actors.serve.app.build_app`) over it; each HTTP request reaches
  it whole, as a `ForwardedRequest`, and its response goes back as the app's ASGI messages.
- `OpenAIFront` (the HTTP ingress behind Ray Serve's proxy): reads a request's body, computes
  its prefix key and hands it to a replica chosen by `PrefixAffinityRouter`. The proxy alone
  cannot route on the prompt: it streams bodies to the replica it already chose.

The prefix key is the chain of block hashes of the rendered prompt's token ids, as the
engine's prefix cache names them (`actors.kv_manager`, `actors.kv_blocks.chain_hashes`): a
request goes to the replica that last served the longest run of its blocks, whose KV cache
likely holds them.

    serve run actors.serve.ray:application model=/models/model.gguf backend=cpu
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import uvicorn
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.types import Message, Receive, Scope, Send
from uvicorn.lifespan.on import LifespanOn

from actors.cli.common import has_chat_template
from actors.engine import Engine
from actors.errors import EngineClosed, EngineOverloaded, Q4KError
from actors.kv_blocks import chain_hashes
from actors.model.text.chat import ChatTemplate, RenderLimits
from actors.model.loaded import open_model
from actors.params import SamplingParams
from actors.serve.app import (
    ServerOptions,
    build_app,
    cancel_on_disconnect,
    freeze_long_lived_objects,
)
from actors.serve.fingerprint import model_digest
from actors.serve.guard import RequestGuard, RequestLimits, api_key_from_environment
from actors.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    decode_body,
    one_prompt,
    template_kwargs,
)
from actors.serve.replies import error_body, error_event

if TYPE_CHECKING:
    from ray.serve import Application

# The response header naming the replica that answered; as a request header, the replica
# that should (GET /metrics of one replica, say).
REPLICA_HEADER = "x-q4k-replica"
# Requests one front replica forwards at once: it only relays bytes.
FRONT_MAX_ONGOING = 10_000
# Tries of one request whose replica died before it answered anything (then nothing was
# generated for it, so another replica may start it afresh).
FORWARD_TRIES = 3
GENERATION_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
# The most of a prompt the front reads to key a request (`PromptKeys`): its first characters
# (about 4,000 tokens, 250 blocks: enough to tell the system prompts and turns requests share),
# a chat's first messages, a token-id prompt's first ids.
ROUTING_TEXT_CHARS = 16 << 10
ROUTING_MESSAGES = 64
ROUTING_TOKENS = 4096
# Seconds the front's render of those first messages may take (the replica's takes up to 2).
ROUTING_RENDER_S = 0.5


class ReplicaSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What every replica opens and serves: `q4k serve`'s flags as deployment arguments."""

    model: str
    backend: str = "auto"
    served_model_name: str | None = None
    chat_template: str | None = None  # a Jinja source replacing the model's own
    max_tokens_limit: int | None = None
    max_sequences: int = 64
    max_queued: int = 256
    kv_blocks: int | None = None
    block_size: int = 16
    limits: RequestLimits = RequestLimits()

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).stem

    def request_limits(self) -> RequestLimits:
        """`limits`, with the API key Q4K_API_KEY holds in this process's environment where
        they give none: on a cluster the nodes may hold the key, so that no config file (nor
        the deployment's arguments) need to."""
        if self.limits.api_key is not None:
            return self.limits
        return dataclasses.replace(self.limits, api_key=api_key_from_environment())

    def engine_options(self) -> dict[str, Any]:
        return {"backend": self.backend, "max_sequences": self.max_sequences,
                "max_queued": self.max_queued, "kv_blocks": self.kv_blocks,
                "block_size": self.block_size}


class ForwardedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One HTTP request, read whole by the front; `prefix` and `replica` are for the router."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    prefix: tuple[bytes, ...] = ()
    replica: str | None = None

    def scope(self) -> Scope:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                "http_version": "1.1", "method": self.method, "scheme": "http",
                "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                "query_string": self.query_string, "headers": self.headers,
                "client": self.client, "server": None}


class EngineReplica:
    """One engine and `q4k serve`'s app over it. The constructor returns once the model is
    loaded (a load that fails fails the replica, and Ray Serve starts another)."""

    async def __init__(self, settings: ReplicaSettings) -> None:
        self._settings = settings
        self._engine: Engine | None = None
        self._failure: Q4KError | None = None
        self._settled = anyio.Event()  # the engine opened, or failed to
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        options = ServerOptions(
            chat_template=settings.chat_template,
            chat_available=has_chat_template(Path(settings.model), settings.chat_template),
            max_tokens_limit=settings.max_tokens_limit,
            model_digest=model_digest(Path(settings.model)))
        self._app = build_app(self._open_engine, settings.model_name, on_failure=self._failed,
                              options=options, limits=settings.request_limits())
        self._lifespan = LifespanOn(uvicorn.Config(self._app, lifespan="on", log_config=None))
        await self._lifespan.startup()
        await self._settled.wait()
        if self._failure is not None:
            raise self._failure

    @asynccontextmanager
    async def _open_engine(self) -> AsyncIterator[Engine]:
        async with Engine.open(self._settings.model, **self._settings.engine_options()) as engine:
            freeze_long_lived_objects()
            self._engine = engine
            self._settled.set()
            try:
                yield engine
            finally:
                self._engine = None

    def _failed(self, exc: Q4KError) -> None:
        self._failure = exc
        self._settled.set()

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        """Run `request` through the app; yields its ASGI response messages as they come.
        Closing the generator (the client left) cancels the request."""
        messages: asyncio.Queue[Message | None] = asyncio.Queue()
        finished = asyncio.Event()
        unread = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive() -> Message:
            if unread:
                return unread.pop()
            await finished.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()),
                           (REPLICA_HEADER.encode(), self.replica_id.encode())]
                message = {**message, "headers": headers}
            await messages.put(message)

        app = asyncio.create_task(self._app(request.scope(), receive, send))
        app.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
            app.result()  # an error the app let out (it answers every error it knows)
        finally:
            finished.set()
            app.cancel()

    async def check_health(self) -> None:
        """Raise (Ray Serve then replaces this replica) once the engine cannot serve."""
        if self._engine is None:
            raise self._failure or EngineClosed("the engine of this replica has stopped")
        await check_engine(self._engine)

    async def __del__(self) -> None:
        await self._lifespan.shutdown()


async def check_engine(engine: Engine) -> None:
    """Raise what the engine's door raises once the engine cannot serve: ComputeError once its
    backend is lost, EngineClosed once it closed. A busy engine is healthy."""
    # The door refuses every request of a lost engine before any work; a probe it lets
    # through is closed unstarted, costing nothing.
    try:
        probe = engine.generate([0], SamplingParams(max_tokens=1))
    except EngineOverloaded:
        return
    await probe.aclose()


class PromptKeys:
    """The prefix key of a generation request: chain hashes of the full blocks of its prompt's
    token ids (the chat rendered with the replicas' template), as the prefix cache names them.

    The work is bounded whatever the prompt: a prompt that cannot fit the context (by the
    engine's own checks from its size: a text's bytes, a list's length) gets no key, and only
    its first ROUTING_TEXT_CHARS characters (a chat's first ROUTING_MESSAGES messages,
    rendered) or ROUTING_TOKENS ids are keyed. The replica reads the rest; requests that share
    a prefix share its first blocks, which is what routing needs."""

    def __init__(self, settings: ReplicaSettings) -> None:
        opened = open_model(settings.model)
        self._tokenizer = opened.tokenizer
        self._context_length = opened.spec.context_length
        has_template = settings.chat_template is not None or opened.chat_template is not None
        self._template = (ChatTemplate.from_model_metadata(opened.gguf, settings.chat_template)
                          if has_template else None)
        self._block_size = settings.block_size

    def of(self, path: str, body: bytes) -> tuple[bytes, ...]:
        """The key; empty for a request it cannot read (the replica will say what is wrong:
        a key only steers routing)."""
        try:
            ids = self._chat_ids(body) if path == "/v1/chat/completions" else self._ids(body)
        except Exception:  # whatever a hostile body makes the template or tokenizer raise
            return ()
        # The prefix cache keeps the last prompt token to compute, so never reuses its block.
        return tuple(chain_hashes(ids[:-1], self._block_size))

    def _ids(self, body: bytes) -> list[int]:
        prompt = one_prompt(decode_body(body, CompletionRequest).prompt)
        if isinstance(prompt, list):
            return prompt[:ROUTING_TOKENS] if len(prompt) < self._context_length else []
        if self._tokenizer.min_tokens(prompt) >= self._context_length:
            return []
        return self._text_ids(prompt, parse_special=False)

    def _chat_ids(self, body: bytes) -> list[int]:
        request = decode_body(body, ChatRequest)
        if self._template is None or len(request.messages) >= self._context_length:
            return []
        leading = _leading(chat_messages(request.messages[:ROUTING_MESSAGES],
                                         self._context_length))
        text = self._template.render(leading, limits=RenderLimits(seconds=ROUTING_RENDER_S),
                                     chat_template_kwargs=template_kwargs(request))
        ids = self._text_ids(text, parse_special=True)
        bos = self._tokenizer.bos_id
        # As the engine does: a template that writes the BOS itself gets no second one.
        return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids

    def _text_ids(self, text: str, parse_special: bool) -> list[int]:
        """The ids of `text`'s first ROUTING_TEXT_CHARS characters; where the text was cut, less
        the last block's worth, which the cut may have tokenized otherwise."""
        ids = self._tokenizer.encode(text[:ROUTING_TEXT_CHARS], parse_special=parse_special)
        return ids[:-self._block_size] if len(text) > ROUTING_TEXT_CHARS else ids


def _leading(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with their text cut where it passes ROUTING_TEXT_CHARS in all."""
    left = ROUTING_TEXT_CHARS
    kept = []
    for message in messages:
        kept.append({**message, "content": message["content"][:left]})
        left -= len(kept[-1]["content"])
        if left <= 0:
            break
    return kept


class Forwarder:
    """The front's ASGI app: every request, read whole, goes to a replica, and its answer
    back; a replica that dies mid-answer ends it with an OpenAI error, never a hang."""

    def __init__(self, replicas: DeploymentHandle, keys: PromptKeys) -> None:
        self._replicas = replicas.options(stream=True)
        self._keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _no_lifespan(receive, send)
            return
        request = await self._read(scope, receive)
        for _ in range(FORWARD_TRIES):
            answered = await cancel_on_disconnect(receive, lambda: self._relay(request, send))
            if answered is not False:  # None: the client left
                return
        await _send_json(send, 503, _replica_lost_body(), [(b"retry-after", b"1")])

    async def _read(self, scope: Scope, receive: Receive) -> ForwardedRequest:
        parts = []
        while True:  # bounded: RequestGuard has read a POST's body already
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        prefix: tuple[bytes, ...] = ()
        if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            prefix = await anyio.to_thread.run_sync(self._keys.of, scope["path"], body)
        headers = list(scope["headers"])
        pinned = next((value.decode() for name, value in headers
                       if name == REPLICA_HEADER.encode()), None)
        return ForwardedRequest(method=scope["method"], path=scope["path"],
                                query_string=scope.get("query_string", b""), headers=headers,
                                body=body, client=scope.get("client"), prefix=prefix,
                                replica=pinned)

    async def _relay(self, request: ForwardedRequest, send: Send) -> bool:
        """Relay one replica's answer; False when the replica died before answering."""
        answer = self._replicas.forward.remote(request)
        streaming = started = ended = False
        try:
            async for message in answer:
                if message["type"] == "http.response.start":
                    started = True
                    streaming = any(name == b"content-type" and value.startswith(
                        b"text/event-stream") for name, value in message.get("headers", ()))
                await send(message)
            ended = True
        except RayError as exc:
            ended = True
            if not started:
                if isinstance(exc, RayActorError):
                    return False
                await _send_json(send, 500, _replica_lost_body(exc))
            elif streaming:
                event = error_event(_replica_lost_body(exc))
                await send({"type": "http.response.body", "body": event, "more_body": True})
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if not ended:  # the client left: the replica drops the request
                answer.cancel()
        return True


def _replica_lost_body(exc: RayError | None = None) -> dict[str, Any]:
    why = f" ({type(exc).__name__})" if exc is not None else ""
    return error_body(f"the replica serving this request failed{why}; retry", "server_error",
                      None, "replica_lost")


async def _send_json(send: Send, status: int, body: Any,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": msgspec.json.encode(body)})


async def _no_lifespan(receive: Receive, send: Send) -> None:
    """Answer the lifespan protocol: the front has nothing to start or stop."""
    while True:
        message = await receive()
        kind = message["type"].removeprefix("lifespan.")
        await send({"type": f"lifespan.{kind}.complete"})
        if kind == "shutdown":
            return


class OpenAIFront:
    """The HTTP ingress: `Forwarder` behind `q4k serve`'s request checks (size, time, key)."""

    def __init__(self, replicas: DeploymentHandle, settings: ReplicaSettings) -> None:
        self._app = RequestGuard(Forwarder(replicas, PromptKeys(settings)),
                                 settings.request_limits())

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


class PrefixAffinityRouter(RequestRouter):
    """Routes a request to the replica that was last sent the longest run of its prompt's
    blocks (at least `min_shared` of them), unless that replica is busy (`busy_at` requests
    ongoing, its batch full); otherwise, and for prompts no replica holds, to the less loaded
    of two replicas drawn at random (power of two choices). A request naming a replica in
    the `x-q4k-replica` header goes to that one."""

    def initialize_state(self, busy_at: int = 64, min_shared: float = 0.5,
                         remembered_blocks: int = 1 << 20) -> None:
        self._busy_at = busy_at
        self._min_shared = min_shared
        self._remembered_blocks = remembered_blocks
        # Block hash -> the replica last sent it, least recently sent first.
        self._holder: OrderedDict[bytes, str] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        request = _forwarded(pending_request)
        if request is None:
            return [pair]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if request.replica in by_id:
            return [[by_id[request.replica]]]
        holder = self._holder_of(request.prefix, by_id)
        # The holder alone, even when its load is not known yet (a probe that came late):
        # asked again, the router knows it, and a busy holder gives way to the pair.
        return [pair] if holder is None or self._busy(holder) else [[holder]]

    def _holder_of(self, prefix: Sequence[bytes],
                   replicas: dict[str, RunningReplica]) -> RunningReplica | None:
        """The replica holding the longest run of `prefix`, if that run is long enough."""
        for shared in range(len(prefix), 0, -1):
            if shared < self._min_shared * len(prefix):
                return None
            holder = replicas.get(self._holder.get(prefix[shared - 1], ""))
            if holder is not None:
                return holder
        return None

    def _busy(self, replica: RunningReplica) -> bool:
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        return ongoing is not None and ongoing >= self._busy_at

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        request = _forwarded(pending_request)
        if request is None:
            return
        for block in request.prefix:
            self._holder[block] = replica_id.unique_id
            self._holder.move_to_end(block)
        while len(self._holder) > self._remembered_blocks:
            self._holder.popitem(last=False)


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    """The request being routed, told by its fields: Ray Serve ships the router class by
    value, so its `ForwardedRequest` is a copy of the class the front builds them from."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if type(request).__name__ == ForwardedRequest.__name__ else None


def serve_application(settings: ReplicaSettings, **replica_options: Any) -> Application:
    """The Serve application: `replica_options` go to the engine replicas' deployment as Ray
    Serve's own (`num_replicas`, `autoscaling_config`, `ray_actor_options`, ...). Each
    replica takes one GPU where the backend is CUDA, else one CPU."""
    from ray.serve.config import RequestRouterConfig

    resources = {"num_gpus": 1} if settings.backend == "cuda" else {"num_cpus": 1}
    replicas = serve.deployment(EngineReplica).options(
        **{"ray_actor_options": resources,
           "max_ongoing_requests": settings.max_sequences + settings.max_queued,
           "request_router_config": RequestRouterConfig(
               request_router_class=PrefixAffinityRouter,
               request_router_kwargs={"busy_at": settings.max_sequences}),
           **replica_options})
    front = serve.deployment(serve.ingress()(OpenAIFront)).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=FRONT_MAX_ONGOING)
    return front.bind(replicas.bind(settings), settings)


def application(args: dict[str, Any]) -> Application:
    """The builder `serve run actors.serve.ray:application model=... [backend=...]` calls:
    `args` are `ReplicaSettings`' fields; replica counts and autoscaling go in the config's
    `deployments:` section (deployment `EngineReplica`)."""
    return serve_application(msgspec.convert(args, ReplicaSettings, strict=False))
