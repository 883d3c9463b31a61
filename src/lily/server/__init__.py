"""HTTP: the OpenAI chat-completions API, and the legacy completions, Anthropic Messages and
OpenAI Responses APIs translated onto it, served by one engine worker (see `lily.server.routes`).

`create_app(llm)` is the ASGI app for a loaded model; `serve(model)` loads one and runs it.
"""

from lily.server.app import create_app, serve

__all__ = ["create_app", "serve"]
