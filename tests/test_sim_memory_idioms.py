"""Loops and copies that clang turns into memset / memcpy / memmove, on the checked sim
(tests/sim_kernels/memory_idioms.metal): the load/store hooks do not see those, so the checked
build routes them through checked versions (csrc/sim/check.cpp). Their writes land as in the
plain build, their bytes past a binding's end are reported as any other out-of-bounds access
is, and traffic counts them."""

import re

import numpy as np
import pytest

from lily.device import Graph, KernelError, open_device
from lily.kernels import pack_params

RECORD_WORDS = 12  # struct Record: float4 position, float4 velocity, uint id, uint flags


def floats(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, n).astype(np.float32)


def records(n: int) -> np.ndarray:
    """n Records as raw 32-bit words, so copies compare bit for bit."""
    return np.random.default_rng(1).integers(0, 2**32, (n, RECORD_WORDS), dtype=np.uint32)


def run(dev, kernel: str, threads: int, buffers: dict, params: dict) -> None:
    g = Graph()
    g.dispatch(
        dev.kernel(kernel),
        threadgroups=1,
        threads=threads,
        buffers={i: dev.wrap(a) for i, a in buffers.items()},
        bytes={i: pack_params("I", v) for i, v in params.items()},
    )
    dev.run(g)


# kernel, threads, inputs, parameters, the output index and what it must hold afterwards
def zero_rows():
    out = np.ones(4 * 10 + 3, dtype=np.float32)
    expected = out.copy()
    expected[:40] = 0
    return "test_zero_rows", 4, {0: out}, {1: 10}, 0, expected


def zero_eight():
    out = np.ones(8 * 4 + 5, dtype=np.float32)
    expected = out.copy()
    expected[:32] = 0
    return "test_zero_eight", 4, {0: out}, {}, 0, expected


def stage_rows():
    x, out = floats(3 * 16), np.ones(3 * 16, dtype=np.float32)
    expected = out.reshape(3, 16).copy()
    expected[:, :13] = 2 * x.reshape(3, 16)[:, :13]
    return "test_stage_rows", 3, {0: x, 1: out}, {2: 13}, 1, expected.ravel()


def shift_left():
    x = np.arange(12, dtype=np.float32)
    expected = x.copy()
    expected[:9] = x[1:10]
    return "test_shift_left", 1, {0: x}, {1: 10}, 0, expected


def copy_records():
    x, out = records(5), np.zeros((6, RECORD_WORDS), dtype=np.uint32)
    expected = out.copy()
    expected[:5] = x
    return "test_copy_records", 8, {0: x, 1: out}, {2: 5}, 1, expected


CASES = [zero_rows, zero_eight, stage_rows, shift_left, copy_records]


@pytest.mark.parametrize("mode", ["check", "count_traffic"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_writes_of_compiler_formed_copies_and_fills_land_as_in_the_plain_build(case, mode):
    kernel, threads, buffers, params, out, expected = case()
    plain_buffers = {i: a.copy() for i, a in buffers.items()}
    run(open_device("sim", workers=2, check=False), kernel, threads, plain_buffers, params)
    run(open_device("sim", workers=2, **{mode: True}), kernel, threads, buffers, params)
    np.testing.assert_array_equal(plain_buffers[out], expected)
    np.testing.assert_array_equal(buffers[out], plain_buffers[out])


# kernel, threads, inputs, parameters, the error expected
OUT_OF_BOUNDS = {
    "fill_loop": (
        "test_zero_rows",
        4,
        {0: np.ones(4 * 10 - 1, dtype=np.float32)},
        {1: 10},
        r"thread 3 \(simdgroup 0\) writes 40 bytes at byte offset 120 of buffer 0, "
        r"outside its 156 bound bytes",
    ),
    "unrolled_fill": (
        "test_zero_eight",
        4,
        {0: np.ones(8 * 4 - 1, dtype=np.float32)},
        {},
        r"thread 3 \(simdgroup 0\) writes 32 bytes at byte offset 96 of buffer 0, "
        r"outside its 124 bound bytes",
    ),
    "copy_loop": (
        "test_stage_rows",
        2,
        {0: floats(2 * 16 - 3), 1: np.zeros(2 * 16, dtype=np.float32)},
        {2: 16},
        r"thread 1 \(simdgroup 0\) reads 64 bytes at byte offset 64 of buffer 0, "
        r"outside its 116 bound bytes",
    ),
    "overlapping_copy_loop": (
        "test_shift_left",
        1,
        {0: np.arange(10, dtype=np.float32)},
        {1: 12},
        r"thread 0 \(simdgroup 0\) reads 44 bytes at byte offset 4 of buffer 0, "
        r"outside its 40 bound bytes",
    ),
    "struct_copy": (
        "test_copy_records",
        8,
        {0: records(5), 1: np.zeros((6, RECORD_WORDS), dtype=np.uint32)},
        {2: 6},
        r"thread 5 \(simdgroup 0\) reads 48 bytes at byte offset 240 of buffer 0, "
        r"outside its 240 bound bytes",
    ),
}


@pytest.mark.parametrize("name", OUT_OF_BOUNDS)
def test_out_of_bounds_copies_and_fills_are_reported(name):
    kernel, threads, buffers, params, pattern = OUT_OF_BOUNDS[name]
    dev = open_device("sim", workers=2, check=True)
    with pytest.raises(KernelError) as info:
        run(dev, kernel, threads, buffers, params)
    message = str(info.value)
    assert message.startswith(f"kernel '{kernel}' threadgroup (0,0,0): "), message
    assert re.search(pattern, message), message


def test_a_fill_into_a_read_only_buffer_is_reported():
    frozen = np.ones(4 * 10, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(KernelError, match=r"writes 40 bytes at byte offset \d+ of buffer 0, "):
        run(open_device("sim", check=True), "test_zero_rows", 4, {0: frozen}, {1: 10})


@pytest.mark.parametrize("mode", ["check", "count_traffic"])
def test_traffic_counts_the_bytes_of_copies_and_fills(mode):
    dev = open_device("sim", workers=2, **{mode: True})
    run(dev, "test_zero_rows", 4, {0: np.ones(4 * 10 + 3, dtype=np.float32)}, {1: 10})
    run(dev, "test_zero_eight", 4, {0: np.ones(8 * 4, dtype=np.float32)}, {})
    stage_in, stage_out = floats(3 * 16), np.zeros(3 * 16, dtype=np.float32)
    run(dev, "test_stage_rows", 3, {0: stage_in, 1: stage_out}, {2: 13})
    run(dev, "test_shift_left", 1, {0: np.arange(12, dtype=np.float32)}, {1: 10})
    copy_in, copy_out = records(5), np.zeros((6, RECORD_WORDS), dtype=np.uint32)
    run(dev, "test_copy_records", 8, {0: copy_in, 1: copy_out}, {2: 5})
    rows, eight, stage, shift, copy = dev.traffic()
    assert (rows.buffers[0].read, rows.buffers[0].written) == (0, 4 * 40)
    assert (eight.buffers[0].read, eight.buffers[0].written) == (0, 4 * 32)
    assert (stage.buffers[0].read, stage.buffers[1].written) == (4 * 3 * 13, 4 * 3 * 13)
    assert stage.buffers[0].written == stage.buffers[1].read == 0
    # x[0:9] = x[1:10]: nine floats read from offset 4, nine written from offset 0.
    assert (shift.buffers[0].read, shift.buffers[0].written) == (4 * 9, 4 * 9)
    assert (copy.buffers[0].read, copy.buffers[1].written) == (5 * 48, 5 * 48)
    assert copy.buffers[0].written == copy.buffers[1].read == 0
