"""`q4k serve`: an OpenAI-compatible HTTP server over the engine (needs the `serve` extra).

`protocol` reads request bodies, `replies` writes response objects and events, `metrics`
renders Prometheus text, `app` is the Starlette app that ties them to an engine.
"""
