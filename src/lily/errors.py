"""The errors Lily raises by name. Request errors are shaped so the HTTP server can turn each
into an OpenAI-style error object without guessing (`param`, `code`, HTTP status); checkpoint
errors say what is wrong with the files being loaded; `NonFiniteLogitsError` says the model's
arithmetic broke down during a generation."""

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


def require(condition: bool, message: str, param: str) -> None:
    """Raises RequestError(message, param=param) unless `condition` holds. A message that is
    only what the value must be ("must be an integer >= 1") gets the field's name in front, so
    that the Python API's errors name the field as the server's `param` does."""
    if not condition:
        if message.startswith("must "):
            message = f"{param} {message}"
        raise RequestError(message, param=param)


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

    def __init__(self, message: str, *, param: str = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFoundError(RequestError):
    status = 404

    def __init__(self, requested: str, served: str):
        super().__init__(
            f"model {requested!r} is not served here; this server runs {served!r}",
            param="model",
            code="model_not_found",
        )


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed, or does not match what Lily expects."""


class ConfigError(CheckpointError):
    """config.json is missing, malformed, or describes a model Lily does not run."""


class EngineBusyError(RuntimeError):
    """A thread started a generation (or a logits call) on a model while one of its own
    generations on that model was still open. Other threads wait their turn instead."""


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or +inf logits, so no token was emitted from them. The engine
    stays usable: the next generation starts from a clean state. The usual cause is a broken
    checkpoint (NaN weights) or a config value outside what the model was trained with."""

    def __init__(self, position: int):
        super().__init__(
            f"the model produced NaN or +inf logits at position {position}; no token was "
            "emitted (a broken checkpoint, e.g. NaN weights, is the usual cause)"
        )
        self.position = position


class ChatTemplateError(ValueError):
    """The checkpoint's chat template cannot be used: it is missing, does not compile, or
    includes, imports or extends other templates (a chat template must be self-contained).
    Raised when the model is loaded; the subclasses are raised while rendering a request."""


class ChatTemplateRefusedError(RequestError, ChatTemplateError):
    """The template refused this conversation (its `raise_exception`) or failed on its values
    (a type error, recursion too deep for the data): the same template renders other
    conversations, so the request is what has to change (HTTP 400)."""

    def __init__(self, message: str):
        super().__init__(message, param="messages", code="chat_template_refused")


class ChatTemplateLimitError(ChatTemplateError):
    """Rendering the template went over one of its bounds (`TemplateLimits`): loop steps,
    seconds, the size of one value or of the prompt, or all the text built. With the default
    bounds no conversation that fits the request limits gets there, so this is the checkpoint
    template's fault, not the client's: the server answers 500 `chat_template_limit` with this
    message and logs it; the worker is free again at once."""

    def __init__(self, message: str, *, limit: str):
        super().__init__(message)
        self.limit = limit


class GenerationCancelled(Exception):
    """The caller's `should_stop` asked a generation to stop (its client left, or the server
    is shutting down); the engine stopped at a prefill chunk or token boundary and is free."""


class ImageError(RequestError):
    """An image in a request that Lily will not encode (HTTP 400). The subclasses say why."""

    def __init__(self, message: str, *, code: str, param: str = "messages"):
        super().__init__(message, param=param, code=code)


class NotAnImageError(ImageError):
    """The bytes are in no image format the decoder reads."""

    def __init__(self, detail: str):
        super().__init__(f"not a readable image: {detail}", code="invalid_image")


class TruncatedImageError(ImageError):
    """The image's header was read but its data ends early or is corrupt."""

    def __init__(self, detail: str):
        super().__init__(f"the image is truncated or corrupt: {detail}", code="invalid_image")


class ImageTooLargeError(ImageError):
    """The encoded image has more bytes, or the decoded one more pixels, than the limits allow
    (checked before the pixels are decoded)."""

    def __init__(self, message: str):
        super().__init__(message, code="image_too_large")


class ImageURLError(ImageError):
    """An image URL Lily will not read: not a data URL, a readable local file (the Python API
    only) or, with fetching enabled, an http(s) URL; or a data URL that does not decode."""

    def __init__(self, message: str):
        super().__init__(message, code="invalid_image_url")


class ImageFetchError(ImageError):
    """Fetching an http(s) image URL failed (enabled with `fetch_images`): unreachable, an
    HTTP error, too slow or too large."""

    def __init__(self, message: str):
        super().__init__(message, code="image_fetch_failed")


class TooManyImagesError(ImageError):
    """A request holds more images than `ImageLimits.max_images`."""

    def __init__(self, count: int, limit: int):
        super().__init__(
            f"the request holds {count} images; at most {limit} are accepted",
            code="too_many_images",
        )


class ImagesUnsupportedError(ImageError):
    """Images sent to a checkpoint without a vision tower, or where the API has no place
    for them (a system prompt, a tool result)."""

    def __init__(self, message: str, *, param: str = "messages"):
        super().__init__(message, code="unsupported_content", param=param)


class ImageShapeError(ImageError):
    """The image's sides are too unequal for the patch grid (the reference processor's bound
    on the aspect ratio)."""

    def __init__(self, message: str):
        super().__init__(message, code="invalid_image_shape")


class ImageTokensError(RequestError):
    """The prompt's image-token runs do not match the images given with it: one run of
    `image_token_id` per image, exactly as long as the image has tokens, in the images' order."""

    def __init__(self, message: str):
        super().__init__(message, param="messages", code="image_tokens_mismatch")
