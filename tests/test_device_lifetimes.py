"""Wrapped host memory outlives every use of it, and is released once nothing uses it.

The device wraps numpy arrays and memory maps in place. Here Python drops every reference to a
wrapped array before a kernel reads it: the buffer, then the graph holding the buffer, must
keep the memory alive until the graph has been waited for, and let it go afterwards. On the
metal device the MTLBuffer's deallocator releases the owner (possibly on another thread, a
little after the last use), hence the polling. LILY_DEVICE names the device (default sim).
"""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
from device_testing import open_test_device

from lily.device import Graph
from lily.kernels.norm import record_rms_norm

ROWS, DIM, EPS = 3, 200, 1e-6
BF16_ONE = 0x3F80


@pytest.fixture(scope="module")
def device():
    return open_test_device()


def released(ref: weakref.ref, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.01)
    return False


def rms_norm_reference(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def wrapped_rows(device, rng):
    """A wrapped view 12 bytes into a larger array (not page-aligned, as tensors inside a
    checkpoint shard are), the values it holds, and a weak reference to the owning array."""
    owner = rng.standard_normal(ROWS * DIM + 3).astype(np.float32)
    view = owner[3:]
    expected = rms_norm_reference(view.reshape(ROWS, DIM))
    return device.wrap(view), expected, weakref.ref(owner)


def test_memory_outlives_the_python_references_until_the_graph_is_waited_for(device):
    rng = np.random.default_rng(13)
    x, expected, owner = wrapped_rows(device, rng)
    weight = device.wrap(np.full(DIM, BF16_ONE, dtype=np.uint16))
    out = device.alloc(ROWS * DIM * 4)
    graph = Graph()
    record_rms_norm(graph, device, x, weight, out, ROWS, DIM, EPS)
    del x
    assert not released(owner, timeout=0.05), "the graph no longer keeps the memory it reads"
    ticket = device.submit(graph)
    del graph
    assert not released(owner, timeout=0.05), "a submitted graph lost the memory it reads"
    device.wait(ticket)
    result = out.numpy().view(np.float32).reshape(ROWS, DIM)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    assert released(owner), "the wrapped array is still held after the graph finished"


def test_dropping_the_buffer_alone_releases_the_memory(device):
    x, _, owner = wrapped_rows(device, np.random.default_rng(14))
    assert not released(owner, timeout=0.05)
    del x
    assert released(owner)
