"""One caller at a time on an engine shared by threads.

An engine holds one sequence's state on its device; two generations interleaved on it would read
each other's tokens, silently. A `Lily` object is what users share between threads (a web app's
worker pool, `asyncio.to_thread`), so each engine takes an `EngineLock`: a generation holds the
engine from its first token until it ends or is closed, and other threads wait their turn. The
one thing waiting cannot fix is a thread starting a second generation while its own first one
is still open (a stream read half-way): that raises `EngineBusyError` instead of deadlocking.

The holder is the generation itself, not a thread: which thread started it is remembered in that
thread's own storage (a thread id is reused once its thread exits, and must not make a new thread
look like the holder), and whichever thread steps or closes the generation runs it as the holder
(`shared` calls of its cleanup go ahead from any thread). A generation nobody can reach any more
but that the garbage collector has not finalized yet (a stream dropped in a reference cycle)
would hold the engine until the next collection: a caller that finds the engine taken collects
once before it waits or refuses.
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from lily.errors import EngineBusyError

T = TypeVar("T")

# How long a caller waits for the engine before it collects garbage once (a stream dropped in a
# reference cycle is then finalized), and waits on.
GC_AFTER_SECONDS = 1.0


class _Holder:
    """One call's hold on the engine (a generation's, from its first token to its end)."""


class EngineLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: _Holder | None = None
        # Per thread: the holders it started (dropped with the thread), and the one whose code
        # it is running now.
        self._local = threading.local()

    def _started_here(self) -> weakref.WeakSet[_Holder]:
        started = getattr(self._local, "started", None)
        if started is None:
            started = self._local.started = weakref.WeakSet()
        return started

    def _held_here(self) -> bool:
        """Whether this thread started the holder, or is running its code right now."""
        holder = self._holder
        if holder is None:
            return False
        return holder in self._started_here() or getattr(self._local, "running", None) is holder

    @contextmanager
    def turn(self, what: str, holder: _Holder | None = None) -> Iterator[None]:
        """Holds the engine for a call that changes its state: waits for other threads, and
        refuses the thread that already holds it."""
        holder = _Holder() if holder is None else holder
        if self._held_here():
            gc.collect()  # a generation dropped in a reference cycle lets go of the engine
            if self._held_here():
                raise EngineBusyError(
                    f"{what} started while a generation of this model is still open in the same "
                    "thread: read that stream to its end or close() it first"
                )
        if not self._lock.acquire(timeout=GC_AFTER_SECONDS):
            gc.collect()
            self._lock.acquire()
        self._holder = holder
        started = self._started_here()
        started.add(holder)
        try:
            yield
        finally:
            started.discard(holder)
            self._holder = None
            self._lock.release()

    @contextmanager
    def running(self, holder: _Holder) -> Iterator[None]:
        """Marks this thread as running `holder`'s code (a generation stepped or closed here)."""
        outer = getattr(self._local, "running", None)
        self._local.running = holder
        try:
            yield
        finally:
            self._local.running = outer

    @contextmanager
    def shared(self) -> Iterator[None]:
        """For a call that only reads what a generation leaves alone between its tokens (the
        prefix cache's index) or ends the engine: the holder goes ahead, in whichever thread."""
        if self._held_here():
            yield
            return
        with self._lock:
            yield

    def generation(self, tokens: Iterator[T]) -> Iterator[T]:
        """`tokens`, holding the engine from the first until the last or until closed (from
        any thread: the step or close runs as the holder)."""
        holder = _Holder()
        with self.turn("a generation", holder):
            try:
                while True:
                    with self.running(holder):
                        token = next(tokens, _END)
                    if token is _END:
                        return
                    yield token  # type: ignore[misc]
            finally:
                with self.running(holder):
                    tokens.close()  # type: ignore[attr-defined]


_END: Any = object()


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
    """A call the holder may make between its tokens, from any thread (EngineLock.shared)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> T:
        with self.lock.shared():
            return method(self, *args, **kwargs)

    return call
