"""OpenAI's legacy completions API (`POST /v1/completions`), with fill-in-the-middle.

The prompt is fed as it is, without the chat template: a string, or token ids. With `suffix`
it becomes the model's fill-in-the-middle prompt,

    <|fim_prefix|>{prompt}<|fim_suffix|>{suffix}<|fim_middle|>

and the completion is the middle. The request is translated into chat-completions fields and
checked by `lily.chat.completions.parse_request` (the one validation: sampling, stop, logprobs, n,
seed,
...), run on the chat path with its prompt replaced by the raw one (`ChatRequest.raw_prompt`),
and the ChatCompletion or the chunks it produces become `text_completion` objects.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lily.chat.request_limits import UNBOUNDED, RequestLimits
from lily.chat.types import ChoiceLogprobs
from lily.errors import ContextLengthError, RequestError
from lily.server.api_translation import API as APIDescription
from lily.server.api_translation import chat_request, openai_error_body, refuse_unknown, sse

if TYPE_CHECKING:
    from lily.api import Lily
    from lily.chat.completions import ChatRequest
    from lily.chat.tokenizer import Tokenizer
    from lily.chat.types import ChatCompletion, ChatCompletionChunk
    from lily.server.routes import APIError

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
# OpenAI's default for this API (a completion of a request that sets no max_tokens).
DEFAULT_MAX_TOKENS = 16
# OpenAI's bound on `logprobs` in this API.
MAX_LOGPROBS = 5
# Fields passed on to the chat path unchanged (the same names and meaning there).
CHAT_FIELDS = (
    "model",
    "max_tokens",
    "stop",
    "stream",
    "stream_options",
    "n",
    "seed",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "prompt_cache_key",
)
FIELDS = (*CHAT_FIELDS, "prompt", "suffix", "echo", "logprobs")


@dataclass(frozen=True)
class CompletionPrompt:
    """The raw prompt (`ChatRequest.raw_prompt`): text or token ids, and a FIM suffix."""

    prompt: str | tuple[int, ...]
    suffix: str | None = None

    def encode(self, tokenizer: Tokenizer, *, escape: bool) -> list[int]:
        text = tokenizer.encode_as_text if escape else tokenizer.encode

        def ids(part: str | tuple[int, ...]) -> list[int]:
            return list(part) if isinstance(part, tuple) else text(part)

        if self.suffix is None:
            return ids(self.prompt)
        prefix, suffix, middle = fim_token_ids(tokenizer)
        return [prefix, *ids(self.prompt), suffix, *text(self.suffix), middle]

    def text(self, tokenizer: Tokenizer) -> str:
        """The prompt as text (what `echo` repeats)."""
        return self.prompt if isinstance(self.prompt, str) else tokenizer.decode(self.prompt)


def fim_token_ids(tokenizer: Tokenizer) -> tuple[int, int, int]:
    """The ids of the model's fill-in-the-middle tokens (prefix, suffix, middle)."""
    ids = [tokenizer.token_to_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)]
    if None in ids:
        raise RequestError(
            "suffix needs the model's fill-in-the-middle tokens "
            f"({FIM_PREFIX}, {FIM_SUFFIX}, {FIM_MIDDLE}), which this tokenizer lacks",
            param="suffix",
            code="unsupported_parameter",
        )
    return ids[0], ids[1], ids[2]  # type: ignore[return-value]


def _prompt(value: Any, vocab_size: int) -> str | tuple[int, ...]:
    """A string or a list of token ids; a list holding one of them is that one (a batch of
    several prompts is refused)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is not in the vocabulary (0..{vocab_size - 1})",
                param="prompt",
            )
        return tuple(value)
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise RequestError(
            "a batch of several prompts is not supported: send one prompt per request",
            param="prompt",
            code="unsupported_parameter",
        )
    raise RequestError("prompt must be a string or a non-empty list of token ids", param="prompt")


def translate(
    params: dict[str, Any], llm: Lily, limits: RequestLimits = UNBOUNDED
) -> CompletionTranslation:
    refuse_unknown(params, FIELDS)
    if "prompt" not in params:
        raise RequestError("prompt is required", param="prompt", code="missing_required")
    prompt = _prompt(params["prompt"], llm.tokenizer.vocab_size)
    suffix = params.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise RequestError("suffix must be a string", param="suffix")
    echo = params.get("echo", False)
    if not isinstance(echo, bool):
        raise RequestError("echo must be a boolean", param="echo")
    logprobs = params.get("logprobs")
    if logprobs is not None and not (type(logprobs) is int and 0 <= logprobs <= MAX_LOGPROBS):
        raise RequestError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}", param="logprobs")
    if echo and suffix is not None:
        raise RequestError("echo cannot be combined with suffix", param="echo")
    if echo and logprobs is not None:
        # OpenAI then returns the prompt's logprobs too, which Lily does not compute.
        raise RequestError(
            "echo with logprobs (the prompt's logprobs) is not supported",
            param="echo",
            code="unsupported_parameter",
        )
    raw = CompletionPrompt(prompt, suffix)
    if suffix is not None:
        fim_token_ids(llm.tokenizer)
    chat = {name: params[name] for name in CHAT_FIELDS if name in params}
    chat.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    if logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, logprobs
    # A stand-in message: the raw prompt replaces the rendered conversation.
    chat["messages"] = [{"role": "user", "content": ""}]
    request = chat_request(chat, llm, limits)
    _refuse_by_size(raw, llm, request.max_tokens)
    # Tokenized here, off the engine's thread (translations run before the request is queued).
    tokens = CompletionPrompt(tuple(raw.encode(llm.tokenizer, escape=llm.escape_special_tokens)))
    request = dataclasses.replace(request, messages=[], raw_prompt=tokens, prompt_param="prompt")
    return CompletionTranslation(
        request, llm, echo=raw.text(llm.tokenizer) if echo else None, top_logprobs=logprobs
    )


def _refuse_by_size(raw: CompletionPrompt, llm: Lily, max_tokens: int | None) -> None:
    """Refuses a prompt or suffix whose size alone shows it cannot fit the context beside
    `max_tokens`, before anything tokenizes it (as the chat path refuses its prompt)."""
    room = llm.max_seq - (max_tokens or 1)
    for param, text in (("prompt", raw.prompt), ("suffix", raw.suffix)):
        if isinstance(text, str) and llm.tokenizer.surely_longer_than(text, room):
            raise ContextLengthError(
                f"the {param} is {len(text.encode('utf-8', 'surrogatepass'))} bytes, more than "
                f"the context of {llm.max_seq} tokens can hold beside max_tokens {max_tokens}",
                param=param,
            )


class CompletionTranslation:
    """A chat completion's results as `text_completion` objects."""

    def __init__(
        self, request: ChatRequest, llm: Lily, *, echo: str | None, top_logprobs: int | None
    ):
        self.request = request
        self._model = llm.model_id
        self._fingerprint = llm.system_fingerprint
        self._echo = echo
        self._top = top_logprobs
        self._id = f"cmpl-{uuid.uuid4().hex}"
        self._offsets: dict[int, int] = {}  # choice -> characters of text sent so far
        self._started: set[int] = set()

    def _object(self, choices: list[dict[str, Any]], created: int, **extra: Any) -> dict:
        return {
            "id": self._id,
            "object": "text_completion",
            "created": created,
            "model": self._model,
            "choices": choices,
            "system_fingerprint": self._fingerprint,
            **extra,
        }

    def _logprobs(self, logprobs: ChoiceLogprobs | None, offset: int) -> dict[str, Any] | None:
        """The chat path's logprobs in this API's shape: parallel lists."""
        if logprobs is None or self._top is None:
            return None
        entries = logprobs.content
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries]
            if self._top
            else None,
            "text_offset": offsets,
        }

    def complete(self, result: ChatCompletion) -> dict[str, Any]:
        choices = []
        for choice in result.choices:
            head = self._echo or ""
            choices.append(
                {
                    "text": head + (choice.message.content or ""),
                    "index": choice.index,
                    "logprobs": self._logprobs(choice.logprobs, len(head)),
                    "finish_reason": choice.finish_reason,
                }
            )
        usage = result.usage.model_dump() if result.usage else None
        return self._object(choices, result.created, usage=usage)

    def events(self, chunk: ChatCompletionChunk) -> Iterable[bytes]:
        if not chunk.choices:
            usage = chunk.usage.model_dump() if chunk.usage else None
            yield sse(self._object([], chunk.created, usage=usage))
            return
        for choice in chunk.choices:
            text = choice.delta.content or ""
            if choice.index not in self._started:
                self._started.add(choice.index)
                text = (self._echo or "") + text
            if not text and choice.finish_reason is None and choice.logprobs is None:
                continue
            offset = self._offsets.get(choice.index, 0)
            self._offsets[choice.index] = offset + len(text)
            piece = {
                "text": text,
                "index": choice.index,
                "logprobs": self._logprobs(choice.logprobs, offset),
                "finish_reason": choice.finish_reason,
            }
            yield sse(self._object([piece], chunk.created))

    def end(self) -> Iterable[bytes]:
        yield sse("[DONE]")

    def failed(self, error: APIError) -> Iterable[bytes]:
        yield sse(error.body())
        yield sse("[DONE]")


API = APIDescription(translate=translate, error_body=openai_error_body)
