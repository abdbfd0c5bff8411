"""`q4k serve`: the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics) over one engine, on uvicorn. Once the engine is open, one line on stderr
says what it holds (its resident memory after loading and the positions its KV pool holds) and
the next that the server is ready, with its URL."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from actors.cli.common import (
    add_backend_flag,
    add_logging_flags,
    add_model_flag,
    at_least,
    configure_logging_from,
    has_chat_template,
    model_path_from,
    model_source,
    open_engine,
    read_template,
)
from actors.errors import InvalidRequest, Q4KError
from actors.logs import LEVELS, get_logger
from actors.model.packaged import CHAT_MODEL, DEFAULT_MODEL, PACKAGED_MODELS, packaged_model
from actors.serve.guard import (
    ANY_HOST,
    API_KEY_ENV,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
    RequestLimits,
    api_key_from_environment,
    own_host_names,
)

if TYPE_CHECKING:
    import uvicorn

    from actors.engine import Engine
    from actors.serve.app import ServerOptions

# Loopback by default: without --api-key the server has no authentication.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# The Ray Serve application `q4k serve --replicas` deploys.
RAY_APP_NAME = "q4k"
# An origin as a browser's Origin header names it: scheme://host[:port], no path.
CORS_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@\s]+")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the model over the OpenAI HTTP API",
        description="Serve the model over the OpenAI HTTP API: POST /v1/completions and "
        "/v1/chat/completions (streaming or not), GET /v1/models (and /v1/models/ID), "
        "/health (503 until the model is loaded) and /metrics (Prometheus). Chat needs a chat "
        "template: the model's own, or --template FILE. Logs are JSON lines, one `http_request` line "
        "per request plus the engine's events, on stderr or --log-file. Needs "
        "pip install 'q4k-actors[serve]'.",
    )
    add_model_flag(parser, default_help=f"{CHAT_MODEL} when installed, so that both endpoints "
                   f"answer, else {DEFAULT_MODEL}")
    add_backend_flag(parser)
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port to listen on (default {DEFAULT_PORT}; 0 = any free port)")
    parser.add_argument("--served-model-name", metavar="NAME", default=None,
                        help="the model id clients send (default: the packaged model's name "
                        "--model gave, else the model file's name without .gguf)")
    parser.add_argument("--max-sequences", type=at_least(1), default=64, metavar="N",
                        help="requests decoding at once (default 64)")
    parser.add_argument("--max-queued", type=at_least(0), default=256, metavar="N",
                        help="requests waiting beyond those; more get 429 (default 256)")
    parser.add_argument("--max-tokens-limit", type=at_least(1), default=None, metavar="N",
                        help="the most tokens one request may ask for (max_tokens); more get "
                        "400 (default: no limit but the context)")
    parser.add_argument("--template", metavar="FILE", default=None,
                        help="a Jinja chat template for /v1/chat/completions instead of the "
                        "model's own (base models have none)")
    parser.add_argument("--replicas", type=at_least(1), default=None, metavar="N",
                        help="serve N engines (replicas) on Ray Serve behind one endpoint, a "
                        "request going to the replica that holds its prompt's prefix; starts a "
                        "local Ray instance, or joins the one RAY_ADDRESS names. Needs "
                        "pip install 'q4k-actors[ray]'")
    _add_request_limit_flags(parser)
    add_logging_flags(parser, without_file="without one, to stderr")
    parser.set_defaults(handler=_serve)


def _add_request_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-body-bytes", type=at_least(1), default=DEFAULT_MAX_BODY_BYTES,
                        metavar="N", help="larger request bodies get 413, refused before they "
                        f"are read (default {DEFAULT_MAX_BODY_BYTES:,})")
    parser.add_argument("--body-timeout", type=_positive_seconds, default=DEFAULT_BODY_TIMEOUT_S,
                        metavar="S", help="a request body still arriving after S seconds gets "
                        f"408 (default {DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every path but /health and "
                        "/metrics (401 otherwise), as llama-server and vLLM do; without it, "
                        f"the key {API_KEY_ENV} holds, if set (ps shows a command line to "
                        "every user of the machine)")
    parser.add_argument("--allowed-host", action="append", default=[], type=_allowed_host,
                        metavar="NAME", help="a host name the server answers to besides IP "
                        "addresses, localhost, this machine's name and --host (repeatable; "
                        f".NAME for a domain and its subdomains, {ANY_HOST} for any): requests "
                        "naming another in Host or Origin get 403, so that no web page can "
                        "reach the server by DNS rebinding")
    parser.add_argument("--cors-origin", action="append", default=[], type=_cors_origin,
                        metavar="ORIGIN", help="let web pages of ORIGIN (scheme://host[:port], "
                        f"e.g. http://localhost:5173; {ANY_HOST} for any) call the server from a "
                        "browser: their preflight requests are answered (before the API key is "
                        "asked for) and the responses carry the Access-Control-Allow-* headers "
                        "(repeatable; default: none)")
    parser.add_argument("--header-timeout", type=_positive_seconds, default=None, metavar="S",
                        help="close a connection that has not sent a request's whole head "
                        "(request line and headers) S seconds after it opened or after its "
                        f"first byte (408; default {DEFAULT_HEAD_TIMEOUT_S:g}); not with "
                        "--replicas")
    parser.add_argument("--max-connections", type=at_least(1), default=None, metavar="N",
                        help="connections open at once (default "
                        f"{DEFAULT_MAX_CONNECTIONS}); past it a new one takes the place of the "
                        "one idle longest, and is answered 503 only when every one has a "
                        "request in progress; not with --replicas")


def _allowed_host(text: str) -> str:
    name = text.strip().lower().rstrip(".")
    if not name or any(char in name for char in ":/@[] \t"):
        raise argparse.ArgumentTypeError(
            f"must be a host name (NAME, .NAME for a domain and its subdomains, or {ANY_HOST}) "
            f"without a port, got {text!r}")
    return name


def _cors_origin(text: str) -> str:
    origin = text.strip().lower().rstrip("/")
    if origin != ANY_HOST and not CORS_ORIGIN.fullmatch(origin):
        raise argparse.ArgumentTypeError(
            f"must be an origin as browsers send it, scheme://host[:port] without a path "
            f"(e.g. http://localhost:5173), or {ANY_HOST} for any, got {text!r}")
    return origin


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return seconds


def _request_limits(args: argparse.Namespace) -> RequestLimits:
    if args.api_key is not None and not args.api_key.strip():
        raise InvalidRequest("--api-key is empty", field="api_key")
    api_key = args.api_key if args.api_key is not None else api_key_from_environment()
    return RequestLimits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                         api_key=api_key,
                         allowed_hosts=(*own_host_names(args.host), *args.allowed_host),
                         cors_origins=tuple(args.cors_origin))


def _connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    defaults = ConnectionLimits()
    return ConnectionLimits(
        head_timeout_s=args.header_timeout or defaults.head_timeout_s,
        max_connections=args.max_connections or defaults.max_connections)


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from actors.serve.app import ServerOptions, build_app
        from actors.serve.connections import ACCEPT_BACKLOG, bounded_h11_protocol
        from actors.serve.fingerprint import model_digest
    except ImportError as exc:
        raise InvalidRequest(
            f"the server needs the `serve` extra ({exc.name} is missing): "
            "pip install 'q4k-actors[serve]'"
        ) from None
    limits = _request_limits(args)
    _configure_server_logging(args)
    template = read_template(args.template)
    args.default_model = _default_model()
    model = model_path_from(args)
    # Reads the model's header before anything starts: a bad file fails here.
    options = ServerOptions(chat_template=template,
                            chat_available=has_chat_template(model, template),
                            max_tokens_limit=args.max_tokens_limit,
                            model_digest=model_digest(model))
    if args.replicas is not None:
        return _serve_on_ray(args, model, options, limits)
    listener = _listen(args.host, args.port)
    failures: list[Q4KError] = []
    config = uvicorn.Config(
        build_app(partial(_open_for_serving, args, _url(*listener.getsockname()[:2])),
                  _served_model_name(args, model),
                  on_failure=lambda exc: _stop(server, failures, exc), options=options,
                  limits=limits),
        http=bounded_h11_protocol(_connection_limits(args)), backlog=ACCEPT_BACKLOG,
        log_config=None, access_log=False, lifespan="on",
    )
    server = uvicorn.Server(config)
    print(f"q4k serve: {model.name} on {_url(*listener.getsockname()[:2])} (loading; a line "
          "and GET /health say when it is ready)", file=sys.stderr, flush=True)
    if not options.chat_available:
        print(f"q4k serve: notice: {model.name} has no chat template, so "
              f"/v1/chat/completions is unavailable (restart with --template FILE{_chat_hint()}"
              " to chat; /v1/completions works)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it shut down on: for a server, the normal way out
    if failures:
        raise failures[0]
    print("q4k serve: stopped", file=sys.stderr)
    return 0


def _default_model() -> str:
    """The model served without --model: the packaged instruction-tuned one when installed, as
    most clients of an OpenAI server chat and it answers /v1/completions too; else the default
    model, a base model that answers /v1/completions only (a notice says so)."""
    return CHAT_MODEL if PACKAGED_MODELS[CHAT_MODEL].locate() is not None else DEFAULT_MODEL


def _chat_hint() -> str:
    """How to chat when the model served has no chat template: a template, or the packaged
    chat model when it is not installed yet."""
    chat_model = PACKAGED_MODELS[CHAT_MODEL]
    if chat_model.locate() is not None:
        return f", or --model {CHAT_MODEL}"
    return f", or `{chat_model.install}` and --model {CHAT_MODEL}"


def _served_model_name(args: argparse.Namespace, model: Path) -> str:
    """The model id clients send: --served-model-name, else the packaged model's name the
    model was given by, else the file's name without .gguf."""
    if args.served_model_name:
        return args.served_model_name
    known = packaged_model(model_source(args))
    return known.name if known is not None else model.stem


def _url(host: str, port: int) -> str:
    return f"http://{host}:{port}/v1"


@asynccontextmanager
async def _open_for_serving(args: argparse.Namespace, url: str) -> AsyncIterator[Engine]:
    """The engine `q4k serve` serves for the life of its process (see
    `freeze_long_lived_objects`), its memory said on stderr, then that the server is ready."""
    from actors.serve.app import freeze_long_lived_objects

    async with open_engine(args, report_memory=True, max_sequences=args.max_sequences,
                           max_queued=args.max_queued) as engine:
        freeze_long_lived_objects()
        # No await until the app holds the engine: a client acting on this line is answered.
        print(f"q4k serve: ready on {url}", file=sys.stderr, flush=True)
        yield engine


def _serve_on_ray(args: argparse.Namespace, model: Path, options: ServerOptions,
                  limits: RequestLimits) -> int:
    """--replicas N: deploy N replicas behind Ray Serve's HTTP proxy and serve until Ctrl-C
    (or SIGTERM); then stop what this command started: the whole local Ray instance, or on a
    cluster it joined, its own application."""
    try:
        import ray
        from ray import serve

        from actors.serve.ray import ReplicaSettings, serve_application
    except ImportError as exc:
        raise InvalidRequest(
            f"--replicas needs the `ray` extra ({exc.name} is missing): "
            "pip install 'q4k-actors[ray]'"
        ) from None
    if not 0 < args.port <= 65535:
        raise InvalidRequest(f"--port must be in 1..65535 with --replicas (Ray Serve's proxy "
                             f"listens on a fixed port), got {args.port}", field="port")
    if args.header_timeout is not None or args.max_connections is not None:
        raise InvalidRequest("--header-timeout and --max-connections bound q4k serve's own HTTP "
                             "server; with --replicas, Ray Serve's proxy holds the connections",
                             field="replicas")
    settings = ReplicaSettings(
        model=str(model.resolve()), backend=args.backend,
        served_model_name=_served_model_name(args, model),
        chat_template=options.chat_template, max_tokens_limit=args.max_tokens_limit,
        max_sequences=args.max_sequences, max_queued=args.max_queued, limits=limits)
    joined = os.environ.get("RAY_ADDRESS")
    # A local instance gets a CPU for each replica even on a smaller machine (each replica
    # asks Ray for one), so N replicas always start.
    context = ray.init(address=joined or "local", log_to_driver=False,
                       logging_level=logging.WARNING,
                       num_cpus=None if joined else max(os.cpu_count() or 1, args.replicas))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(serve_application(settings, num_replicas=args.replicas), name=RAY_APP_NAME,
                  route_prefix="/")
        print(f"q4k serve: ready on {_url(args.host, args.port)} ({model.name}, "
              f"{args.replicas} replicas on Ray Serve, Ray at "
              f"{context.address_info['gcs_address']}; Ctrl-C stops)", file=sys.stderr, flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        if joined:
            serve.delete(RAY_APP_NAME)
        ray.shutdown()  # and with it the local instance, Serve and the replicas in it
    print("q4k serve: stopped", file=sys.stderr)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop(server: uvicorn.Server, failures: list[Q4KError], exc: Q4KError) -> None:
    """The engine could not open: stop serving, and report why once uvicorn is down."""
    failures.append(exc)
    server.should_exit = True


def _configure_server_logging(args: argparse.Namespace) -> None:
    """Logs from info up (unless --log-level says) to --log-file or stderr; uvicorn's own
    messages join the same stream as `server_log` events."""
    configure_logging_from(args, default_level="info")
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.handlers = [_IntoEvents()]
    uvicorn_logger.setLevel(LEVELS[args.log_level or "info"])
    uvicorn_logger.propagate = False


class _IntoEvents(logging.Handler):
    """A standard-logging handler writing each record as a `server_log` event."""

    def emit(self, record: logging.LogRecord) -> None:
        method = record.levelname.lower() if record.levelname.lower() in LEVELS else "info"
        getattr(get_logger(record.name), method)("server_log", message=record.getMessage())


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the model loads so a taken port fails at once."""
    if not 0 <= port <= 65535:
        raise InvalidRequest(f"--port must be in 0..65535, got {port}", field="port")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(info[0], socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(info[4])
        listener.listen(2048)
    except OSError as exc:
        raise InvalidRequest(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="port"
        ) from None
    return listener
