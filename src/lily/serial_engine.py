"""One caller at a time on an engine shared by threads.

An engine holds one sequence's state on its device; two generations interleaved on it would read
each other's tokens, silently. A `Lily` object is what users share between threads (a web app's
worker pool, `asyncio.to_thread`), so it wraps its engine in `SerialEngine`: a generation holds
the engine from its first token until it ends or is closed, and other threads wait their turn.
The one thing waiting cannot fix is a thread starting a second generation while its own first
one is still open (a stream read half-way): that raises `EngineBusyError` instead of
deadlocking.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from lily.engine import Engine
from lily.errors import EngineBusyError
from lily.sampling import GeneratedToken

T = TypeVar("T")


class SerialEngine:
    """`engine`, used by one thread at a time. Everything not listed here is the engine's own."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread whose generation holds the engine

    @contextmanager
    def _turn(self, what: str) -> Iterator[None]:
        if self._holder == threading.get_ident():
            raise EngineBusyError(
                f"{what} started while a generation of this model is still open in the same "
                "thread: read that stream to its end or close() it first"
            )
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[GeneratedToken]:
        with self._turn("a generation"):
            tokens = self._engine.generate(*args, **kwargs)
            try:
                yield from tokens
            finally:
                tokens.close()

    def _call(self, what: str, call: Callable[[], T]) -> T:
        with self._turn(what):
            return call()

    def prompt_logits(self, prompt: Sequence[int]) -> np.ndarray:
        return self._call("prompt_logits", lambda: self._engine.prompt_logits(prompt))

    def teacher_forced_logits(self, tokens: Sequence[int]) -> np.ndarray:
        return self._call(
            "teacher_forced_logits", lambda: self._engine.teacher_forced_logits(tokens)
        )

    def cached_prefix_length(self, prompt: Sequence[int], cache_key: str | None = None) -> int:
        # Only reads the prefix cache: the thread holding the engine may ask between tokens.
        if self._holder == threading.get_ident():
            return self._engine.cached_prefix_length(prompt, cache_key)
        with self._lock:
            return self._engine.cached_prefix_length(prompt, cache_key)

    def close(self) -> None:
        # Waits for another thread's generation; the holder's own closes under it.
        if self._holder == threading.get_ident():
            self._engine.close()
            return
        with self._lock:
            self._engine.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
