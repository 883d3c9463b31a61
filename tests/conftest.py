"""Session fixtures: the tiny random checkpoints and mlx-lm's cached outputs on them; and after
each module, a garbage collection that frees the sim devices its tests left in reference cycles.
Module fixtures for the tests of drafting streams on a batching engine (drafting_streams.py),
and fixtures that record their moves.

The builders live in tiny_models.py so that other test modules (and scripts) can call
`tiny_checkpoint(name)` directly; these fixtures only make them session-scoped.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from device_testing import open_test_device
from drafting_streams import MAX_SEQ
from tiny_models import TINY_SPECS, mlx_reference, tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine import scheduler
from lily.engine.batch import BatchedDecoder
from lily.engine.engine import DeviceEngine
from lily.engine.sampling import GeneratedToken
from lily.engine.scheduler import BatchScheduler


@pytest.fixture(autouse=True, scope="module")
def free_devices_after_each_module() -> Iterator[None]:
    """A sim device keeps thousands of memory maps (its fibers' stacks and guard pages) until
    its last reference goes: devices a module left in reference cycles are freed here, before
    they add up to the kernel's limit on maps (65,530 by default; "cannot map a fiber stack")."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def small_checkpoint() -> Path:
    return tiny_checkpoint("small")


@pytest.fixture(scope="session")
def wide_checkpoint() -> Path:
    return tiny_checkpoint("wide")


@pytest.fixture(scope="session", params=sorted(set(TINY_SPECS) - {"unrouted"}))
def tiny_name(request: pytest.FixtureRequest) -> str:
    """Each tiny configuration in turn ("small", "wide"; "unrouted" serves one test alone)."""
    return request.param


@pytest.fixture(scope="session")
def mlx_outputs(tiny_name: str) -> dict[str, np.ndarray]:
    return mlx_reference(tiny_name)


@pytest.fixture(scope="module")
def drafting_engine() -> Iterator[DeviceEngine]:
    """The small tiny model with its MTP head, on the test device (drafting_streams.py)."""
    checkpoint = load_checkpoint(tiny_checkpoint("small", mtp_head=True))
    vocab = checkpoint.config.vocab_size
    engine = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, max_chunk=16, mtp=True)
    yield engine
    engine.close()


@pytest.fixture
def drafting_scheduler(drafting_engine: DeviceEngine) -> Iterator[BatchScheduler]:
    scheduler = BatchScheduler(drafting_engine, slots=2)
    yield scheduler
    scheduler.stop()


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tokens each stream had when it moved from the engine's state into a slot."""
    moved: list[int] = []
    join = BatchedDecoder.join_from_engine

    def recorded(self: BatchedDecoder, prompt_length: int, generated: int, *args: Any) -> int:
        moved.append(generated)
        return join(self, prompt_length, generated, *args)

    monkeypatch.setattr(BatchedDecoder, "join_from_engine", recorded)
    return moved


@pytest.fixture
def returns(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, Any]]:
    """Each stream that went back to drafting: its tokens then, its drafter's verify passes
    then, and its drafter."""
    returned: list[tuple[int, int, Any]] = []
    resume = DeviceEngine.resume

    def recorded(self: DeviceEngine, prompt_length: int, generated: int, *args: Any, **kw: Any):
        drafter = args[1]  # after max_new_tokens
        returned.append((generated, drafter.total.passes, drafter))
        return resume(self, prompt_length, generated, *args, **kw)

    monkeypatch.setattr(DeviceEngine, "resume", recorded)
    return returned


@pytest.fixture
def redraft_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The way back taken from 2 tokens left on: the tests' answers are short."""
    monkeypatch.setattr(scheduler, "REDRAFT_MIN_TOKENS", 2)


@pytest.fixture
def deliveries(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(the generation's prompt length, the token) of each token the scheduler delivers, in
    order: which stream got a token before which."""
    delivered: list[tuple[int, int]] = []
    deliver = scheduler._Generation.deliver

    def recorded(self: scheduler._Generation, item: object) -> None:
        if isinstance(item, GeneratedToken):
            delivered.append((len(self.prompt), item.id))
        deliver(self, item)

    monkeypatch.setattr(scheduler._Generation, "deliver", recorded)
    return delivered
