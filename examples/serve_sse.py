"""Embedding the engine in a web app: POST /generate streams server-sent events.

Needs the optional extra: pip install 'q4k-actors[serve]' (starlette + uvicorn).

    python examples/serve_sse.py --port 8000
    curl -N -X POST localhost:8000/generate -d '{"prompt": "Hello", "params": {"max_tokens": 16}}'

Each event is one chunk as JSON; a client that disconnects cancels its request.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import msgspec

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ModuleNotFoundError as missing:
    raise SystemExit(
        f"serve_sse.py needs the `serve` extra ({missing.name} is missing): "
        "pip install 'q4k-actors[serve]' (or pip install -e '.[serve]' in a clone)"
    ) from None

from actors import Engine, EngineOverloaded, InvalidRequest, SamplingParams


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with Engine.open(app.state.model_path) as engine:
        app.state.engine = engine
        yield


async def generate(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    try:
        body = await request.json()
        params = SamplingParams.from_dict(body.get("params", {}))
        stream = engine.generate(body["prompt"], params)
    except (InvalidRequest, KeyError, ValueError) as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    except EngineOverloaded as exc:
        return JSONResponse({"error": str(exc)}, status_code=503)

    async def events() -> AsyncIterator[bytes]:
        # Starlette cancels this generator when the client goes away; aclosing ends the request.
        async with aclosing(stream):
            async for chunk in stream:
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def build_app(model_path: str | None) -> Starlette:
    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])], lifespan=lifespan)
    app.state.model_path = model_path
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Stream completions as server-sent events.")
    parser.add_argument("--model", default=None, help="GGUF path (default: gemma-3-270m)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(build_app(args.model), host=args.host, port=args.port)
