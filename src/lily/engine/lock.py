"""One caller at a time on an engine shared by threads.

An engine holds one sequence's state on its device; two generations interleaved on it would read
each other's tokens, silently. A `Lily` object is what users share between threads (a web app's
worker pool, `asyncio.to_thread`), so each engine takes an `EngineLock`: a generation holds the
engine from its first token until it ends or is closed, and other threads wait their turn. The
one thing waiting cannot fix is a thread starting a second generation while its own first one
is still open (a stream read half-way): that raises `EngineBusyError` instead of deadlocking.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from lily.errors import EngineBusyError

T = TypeVar("T")


class EngineLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread whose call holds the engine

    @contextmanager
    def turn(self, what: str) -> Iterator[None]:
        """Holds the engine for a call that changes its state: waits for other threads, and
        refuses the thread that already holds it."""
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

    @contextmanager
    def shared(self) -> Iterator[None]:
        """For a call that only reads what a generation leaves alone between its tokens (the
        prefix cache's index) or ends the engine: the holder's own thread goes ahead."""
        if self._holder == threading.get_ident():
            yield
            return
        with self._lock:
            yield

    def generation(self, tokens: Iterator[T]) -> Iterator[T]:
        """`tokens`, holding the engine from the first until the last or until closed."""
        with self.turn("a generation"):
            try:
                yield from tokens
            finally:
                tokens.close()  # type: ignore[attr-defined]


# Decorators for the engines' methods (the engine keeps its EngineLock as `self.lock`).


def holds_engine(method: Callable[..., T]) -> Callable[..., T]:
    """A call that uses the engine's state, one thread at a time."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> T:
        with self.lock.turn(method.__name__):
            return method(self, *args, **kwargs)

    return call


def holds_engine_while_generating(
    method: Callable[..., Iterator[T]],
) -> Callable[..., Iterator[T]]:
    """A generation, holding the engine from its first token until it ends or is closed."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Iterator[T]:
        return self.lock.generation(method(self, *args, **kwargs))

    return call


def shares_engine(method: Callable[..., T]) -> Callable[..., T]:
    """A call the holder's own thread may make between its tokens (EngineLock.shared)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> T:
        with self.lock.shared():
            return method(self, *args, **kwargs)

    return call
