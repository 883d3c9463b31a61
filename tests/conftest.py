"""Session fixtures: the tiny random checkpoints and mlx-lm's cached outputs on them; and after
each module, a garbage collection that frees the sim devices its tests left in reference cycles.

The builders live in tiny_models.py so that other test modules (and scripts) can call
`tiny_checkpoint(name)` directly; these fixtures only make them session-scoped.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tiny_models import TINY_SPECS, mlx_reference, tiny_checkpoint


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
