"""Errors a caller of the chat API can get for a bad request, shaped so the HTTP server can turn
each into an OpenAI-style error object without guessing (`param`, `code`, HTTP status)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request Lily will not run. `param` names the offending request field, if one does."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class UnsupportedParameterError(RequestError):
    """A parameter of the OpenAI API that Lily does not implement (never silently ignored)."""

    def __init__(self, names: list[str]):
        listed = ", ".join(sorted(names))
        super().__init__(
            f"unsupported parameter(s): {listed}",
            param=sorted(names)[0],
            code="unsupported_parameter",
        )
        self.names = sorted(names)


class ContextLengthError(RequestError):
    """The prompt plus the requested completion does not fit in the context."""

    def __init__(self, message: str):
        super().__init__(message, param="messages", code="context_length_exceeded")


class ModelNotFoundError(RequestError):
    status = 404

    def __init__(self, requested: str, served: str):
        super().__init__(
            f"model {requested!r} is not served here; this server runs {served!r}",
            param="model",
            code="model_not_found",
        )


class GenerationCancelled(Exception):
    """The caller's `should_stop` asked a generation to stop (its client left, or the server
    is shutting down); the engine stopped at a prefill chunk or token boundary and is free."""
