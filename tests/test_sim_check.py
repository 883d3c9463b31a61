"""The sim's checking mode (``open_device("sim", check=True)``) against planted bugs
(tests/sim_kernels/planted.metal and broken_gemm.metal): each is a KernelError naming the kernel,
the threadgroup, and the buffer index and byte offset, or the threadgroup array, index and both
threads; the correct kernels they were made from raise nothing. Then traffic counting: distinct
bytes per dispatch and binding, in the checking and the counting mode alike."""

import re
from pathlib import Path

import numpy as np
import pytest

from lily.device import Graph, KernelError, open_device
from lily.kernels import pack_params
from lily.kernels.gemm import THREADS_PER_THREADGROUP, TILE, record_gemm_nt

ROOT = Path(__file__).resolve().parents[1]
ORDERS = ("forward", "reverse", "random")


@pytest.fixture(scope="module", params=ORDERS)
def dev(request):
    return open_device("sim", lane_order=request.param, seed=3, workers=2, check=True)


def dispatch(dev, name, threadgroups, threads, buffers, n=None, bytes=None):  # noqa: A002
    g = Graph()
    g.dispatch(
        dev.kernel(name),
        threadgroups=threadgroups,
        threads=threads,
        buffers=buffers,
        bytes=bytes if bytes is not None else ({2: pack_params("I", n)} if n is not None else {}),
    )
    return g


def expect_error(dev, graph, kernel, pattern):
    with pytest.raises(KernelError) as info:
        dev.run(graph)
    message = str(info.value)
    assert message.startswith(f"kernel '{kernel}' threadgroup ("), message
    assert re.search(pattern, message), message
    still_works(dev)
    return message


def still_works(dev):
    x = np.arange(5, dtype=np.float32)
    out = np.zeros(5, dtype=np.float32)
    dev.run(dispatch(dev, "test_pair_sum", 1, 32, {0: dev.wrap(x), 1: dev.wrap(out)}, n=5))
    np.testing.assert_array_equal(out, x + np.append(x[1:], 0))


def floats(n, seed=0):
    return np.random.default_rng(seed).normal(0, 1, n).astype(np.float32)


# ---- device memory: bounds ------------------------------------------------------------------


def test_read_one_past_the_input(dev):
    x = dev.wrap(floats(37))
    out = dev.alloc(4 * 37)
    msg = expect_error(
        dev,
        dispatch(dev, "broken_read_past_input", 2, 32, {0: x, 1: out}, n=37),
        "broken_read_past_input",
        r"thread 4 \(simdgroup 0\) reads 4 bytes at byte offset 148 of buffer 0, "
        r"outside its 148 bound bytes",
    )
    assert "threadgroup (1,0,0)" in msg
    dev.run(dispatch(dev, "test_pair_sum", 2, 32, {0: x, 1: out}, n=37))


def test_write_one_past_the_output(dev):
    out = dev.alloc(4 * 37)
    expect_error(
        dev,
        dispatch(dev, "broken_write_past_output", 2, 32, {0: dev.wrap(floats(37)), 1: out}, n=37),
        "broken_write_past_output",
        r"thread 4 \(simdgroup 0\) writes 4 bytes at byte offset 148 of buffer 1, "
        r"outside its 148 bound bytes",
    )


def test_read_past_the_input_through_a_vector_cast(dev):
    expect_error(
        dev,
        dispatch(
            dev,
            "broken_vector_read_past_input",
            1,
            32,
            {0: dev.wrap(floats(37)), 1: dev.alloc(40)},
            n=37,
        ),
        "broken_vector_read_past_input",
        r"thread 9 \(simdgroup 0\) reads 16 bytes at byte offset 144 of buffer 0, outside its 148",
    )


def test_read_past_the_input_through_a_struct_member_in_an_inline_function(dev):
    expect_error(
        dev,
        dispatch(
            dev,
            "broken_struct_pointer_past_input",
            1,
            32,
            {0: dev.wrap(floats(5 * 4)), 1: dev.alloc(4 * 5)},
            n=5,
        ),
        "broken_struct_pointer_past_input",
        r"thread 4 \(simdgroup 0\) reads 4 bytes at byte offset 80 of buffer 0, outside its 80",
    )


def test_simdgroup_load_past_the_input(dev):
    expect_error(
        dev,
        dispatch(
            dev,
            "broken_simdgroup_load_past_input",
            1,
            32,
            {0: dev.wrap(floats(12 * 8)), 1: dev.alloc(4 * 64)},
            n=12,
        ),
        "broken_simdgroup_load_past_input",
        r"reads [48] bytes at byte offset (38[4-9]|39\d|4\d\d|50\d) of buffer 0, outside its 384",
    )


def test_a_recorded_length_or_a_region_bounds_a_binding_inside_a_larger_buffer(dev):
    x = floats(32)
    out = dev.alloc(4 * 32)
    whole = dev.wrap(x)
    dev.run(dispatch(dev, "test_double", 1, 32, {0: (whole, 64), 1: out}, n=16))
    expect_error(
        dev,
        dispatch(dev, "test_double", 1, 32, {0: (whole, 0, 64), 1: out}, n=20),
        "test_double",
        r"thread 1[6-9] \(simdgroup 0\) reads 4 bytes at byte offset (64|68|72|76) of buffer 0, "
        r"outside its 64 bound bytes",
    )
    tensors = dev.wrap(x, regions=[(0, 64), (64, 64)])
    expect_error(
        dev,
        dispatch(dev, "test_double", 1, 32, {0: (tensors, 64), 1: out}, n=20),
        "test_double",
        r"reads 4 bytes at byte offset (64|68|72|76) of buffer 0, outside its 64 bound bytes",
    )
    dev.run(dispatch(dev, "test_double", 1, 32, {0: (tensors, 64), 1: out}, n=16))
    np.testing.assert_array_equal(out.numpy().view(np.float32)[:16], 2 * x[16:])


def test_inline_bytes_shorter_than_the_kernel_reads(dev):
    expect_error(
        dev,
        dispatch(
            dev,
            "test_double",
            1,
            32,
            {0: dev.wrap(floats(4)), 1: dev.alloc(16)},
            bytes={2: b"\x04\x00"},
        ),
        "test_double",
        r"reads 4 bytes at byte offset 0 of the inline bytes at index 2, outside its 2 bound",
    )


def test_write_to_a_read_only_buffer(dev):
    frozen = np.zeros(8, dtype=np.float32)
    frozen.flags.writeable = False
    expect_error(
        dev,
        dispatch(dev, "test_double", 1, 32, {0: dev.wrap(floats(8)), 1: dev.wrap(frozen)}, n=8),
        "test_double",
        r"writes 4 bytes at byte offset \d+ of buffer 1, which is read-only",
    )


# ---- device memory: scratch -----------------------------------------------------------------


def test_read_of_scratch_nothing_wrote(dev):
    scratch = dev.scratch(4 * 40)
    assert np.isnan(scratch.numpy()[:4].view(np.float32)).all()  # poisoned (this view defines it)
    fresh = dev.scratch(4 * 40)
    out = dev.alloc(4 * 40)
    expect_error(
        dev,
        dispatch(dev, "test_double", 2, 32, {0: fresh, 1: out}, n=40),
        "test_double",
        r"reads byte offset \d+ of buffer 0, scratch memory nothing has written",
    )
    # A kernel writes the first 32 floats; reading those is fine, reading one more is not.
    dev.run(dispatch(dev, "test_double", 1, 32, {0: dev.wrap(floats(32)), 1: fresh}, n=32))
    dev.run(dispatch(dev, "test_double", 1, 32, {0: fresh, 1: out}, n=32))
    expect_error(
        dev,
        dispatch(dev, "test_double", 2, 32, {0: fresh, 1: out}, n=33),
        "test_double",
        r"thread 0 \(simdgroup 0\) reads byte offset 128 of buffer 0, scratch memory nothing",
    )
    # Scratch is zeroed, like alloc, where nothing checks.
    plain = open_device("sim", check=False).scratch(64)
    assert not plain.numpy().any()


def test_dispatches_of_one_graph_level_that_touch_the_same_bytes(dev):
    """Without a barrier between them, the second dispatch reading what the first writes is a
    race between concurrent dispatches; two dispatches reading the same input are fine."""
    x, middle, out = dev.wrap(floats(40)), dev.alloc(4 * 40), dev.alloc(4 * 40)
    params = {2: pack_params("I", 40)}
    for barrier in (True, False):
        g = Graph()
        g.dispatch(
            dev.kernel("test_double"),
            threadgroups=2,
            threads=32,
            buffers={0: x, 1: middle},
            bytes=params,
        )
        if barrier:
            g.barrier()
        g.dispatch(
            dev.kernel("test_double"),
            threadgroups=2,
            threads=32,
            buffers={0: middle, 1: out},
            bytes=params,
        )
        if barrier:
            dev.run(g)
            continue
        with pytest.raises(KernelError) as info:
            dev.run(g)
        assert str(info.value) == (
            "kernel 'test_double': reads byte offset 0 of buffer 0, which an earlier dispatch of "
            "the same graph level ('test_double') wrote: dispatches between two barriers may run "
            "concurrently"
        )
    g = Graph()
    for target in (middle, out):
        g.dispatch(
            dev.kernel("test_double"),
            threadgroups=2,
            threads=32,
            buffers={0: x, 1: target},
            bytes=params,
        )
    dev.run(g)


# ---- threadgroup memory -----------------------------------------------------------------------


def test_read_of_threadgroup_memory_nothing_wrote(dev):
    expect_error(
        dev,
        dispatch(
            dev,
            "broken_read_unwritten_threadgroup",
            1,
            64,
            {0: dev.wrap(floats(64)), 1: dev.alloc(256)},
        ),
        "broken_read_unwritten_threadgroup",
        r"thread \d+ \(simdgroup 0\) reads 'tile'\[(3[2-9]|[4-5]\d|6[0-3])\], which no thread has",
    )


def test_atomic_on_threadgroup_memory_nothing_wrote(dev):
    expect_error(
        dev,
        dispatch(dev, "broken_atomic_unwritten", 1, 64, {0: dev.alloc(4), 1: dev.alloc(4)}),
        "broken_atomic_unwritten",
        r"updates 'count', which no thread has written",
    )


def test_atomics_do_not_race(dev):
    total = np.zeros(1, dtype=np.uint32)
    counts = np.zeros(3, dtype=np.uint32)
    dev.run(dispatch(dev, "test_atomic_counts", 3, 96, {0: dev.wrap(total), 1: dev.wrap(counts)}))
    assert total[0] == 3 * 96 and (counts == 96).all()


def test_write_past_a_threadgroup_array(dev):
    expect_error(
        dev,
        dispatch(
            dev, "broken_threadgroup_past_end", 1, 64, {0: dev.wrap(floats(64)), 1: dev.alloc(256)}
        ),
        "broken_threadgroup_past_end",
        r"thread 63 \(simdgroup 1\) writes threadgroup memory outside every threadgroup variable "
        r"\(0 bytes past the end of 'tile'\)",
    )


def test_overwrite_of_a_tile_another_simdgroup_reads(dev):
    x = floats(64)
    msg = expect_error(
        dev,
        dispatch(
            dev, "broken_overwrite_without_barrier", 1, 64, {0: dev.wrap(x), 1: dev.alloc(256)}
        ),
        "broken_overwrite_without_barrier",
        r"thread (\d+) \(simdgroup (\d)\) (writes|reads) 'tile'\[\d+\], which thread (\d+) "
        r"\(simdgroup (\d)\) (read|wrote) since the last threadgroup_barrier: a race between "
        r"SIMD-groups",
    )
    first, second = re.findall(r"simdgroup (\d)", msg)
    assert first != second
    out = np.zeros(64, dtype=np.float32)
    dev.run(
        dispatch(dev, "test_overwrite_after_barrier", 1, 64, {0: dev.wrap(x), 1: dev.wrap(out)})
    )
    np.testing.assert_array_equal(out, 3 * x[::-1])


def test_missing_barrier_in_the_msl_test_kernel(dev):
    x = np.arange(1, 129, dtype=np.float32)
    expect_error(
        dev,
        dispatch(dev, "test_missing_barrier", 2, 64, {0: dev.wrap(x), 1: dev.alloc(512)}),
        "test_missing_barrier",
        r"reads 'shared'\[\d+\], which (no thread has written|thread \d+ \(simdgroup 0\) wrote)",
    )


# ---- the GEMM without its second barrier ------------------------------------------------------


def planted_gemm() -> str:
    """metal/gemm.metal with its second threadgroup_barrier removed and gemm_nt renamed."""
    lines = (ROOT / "metal" / "gemm.metal").read_text().splitlines(keepends=True)
    barriers = [i for i, line in enumerate(lines) if "threadgroup_barrier" in line]
    del lines[barriers[1]]
    return re.sub(r"\bgemm_nt", "broken_gemm_nt", "".join(lines))


def test_planted_gemm_is_the_gemm_without_its_second_barrier():
    planted = (ROOT / "tests" / "sim_kernels" / "broken_gemm.metal").read_text()
    header, _, body = planted.partition("\n\n")
    assert header.startswith("// PLANTED BUG:")
    assert body == planted_gemm(), "regenerate tests/sim_kernels/broken_gemm.metal"


def gemm(dev, kernel, m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1, (m, k)).astype(np.float32)
    b = rng.normal(0, 1, (n, k)).astype(np.float32)
    c = dev.alloc(4 * m * n)
    g = Graph()
    record_gemm_nt(g, dev, dev.wrap(a), dev.wrap(b), c, m, n, k)
    if kernel == "broken_gemm_nt_float":  # launched exactly as the real one
        real = g
        g = Graph()
        g.dispatch(
            dev.kernel(kernel),
            threadgroups=(-(-n // TILE), -(-m // TILE), 1),
            threads=THREADS_PER_THREADGROUP,
            buffers={1: dev.wrap(a), 2: dev.wrap(b), 3: c},
            bytes={0: pack_params("III", m, n, k)},
        )
        assert real.dispatch_count == 1
    dev.run(g)
    return c.numpy().view(np.float32).reshape(m, n), a.astype(np.float64) @ b.T.astype(np.float64)


def test_gemm_without_its_second_barrier_races(dev):
    with pytest.raises(KernelError) as info:
        gemm(dev, "broken_gemm_nt_float", 37, 45, 40)
    message = str(info.value)
    assert re.search(
        r"kernel 'broken_gemm_nt_float' threadgroup \(\d,\d,0\): thread \d+ \(simdgroup \d\) "
        r"(writes|reads) '(a_tile|bt_tile)'\[\d+\], which thread \d+ \(simdgroup \d\) "
        r"(read|wrote) since the last threadgroup_barrier: a race between SIMD-groups",
        message,
    ), message
    first, second = re.findall(r"simdgroup (\d)", message)
    assert first != second
    c, expected = gemm(dev, "gemm_nt_float", 37, 45, 40)
    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("order", ["reverse", "random"])
def test_simdgroup_interleavings_make_the_missing_barrier_a_wrong_answer(order):
    unchecked = open_device("sim", lane_order=order, seed=3, workers=1, check=False)
    c, expected = gemm(unchecked, "broken_gemm_nt_float", 37, 45, 40)
    assert not np.allclose(c, expected, rtol=1e-3, atol=1e-3)
    c, expected = gemm(unchecked, "gemm_nt_float", 37, 45, 40)
    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4)


# ---- traffic ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["check", "count_traffic"])
def test_traffic_counts_distinct_bytes_per_binding(mode):
    dev = open_device("sim", workers=2, **{mode: True})
    n = 100
    x, out = dev.wrap(floats(n)), dev.alloc(4 * n + 64)
    g = Graph()
    g.dispatch(
        dev.kernel("test_double"),
        threadgroups=4,
        threads=32,
        buffers={0: x, 1: out},
        bytes={2: pack_params("I", n)},
    )
    g.barrier()
    g.dispatch(
        dev.kernel("test_broadcast_sum"),
        threadgroups=4,
        threads=32,
        buffers={0: (out, 0), 1: x},
        bytes={2: pack_params("I", n)},
    )
    dev.run(g)
    double, broadcast = dev.traffic()
    assert double.kernel == "test_double" and broadcast.kernel == "test_broadcast_sum"
    assert (double.buffers[0].read, double.buffers[0].written) == (4 * n, 0)
    assert (double.buffers[1].read, double.buffers[1].written) == (0, 4 * n)
    assert double.buffers[1].extent == 4 * n + 64
    assert double.buffers[0].buffer is x and double.buffers[0].offset == 0
    # Every thread read all of buffer 0: it still counts once.
    assert (broadcast.buffers[0].read, broadcast.read, broadcast.written) == (4 * n, 4 * n, 4 * n)
    assert dev.traffic() == []


def test_unchecked_devices_count_nothing_and_the_environment_turns_checking_on(monkeypatch):
    plain = open_device("sim")
    x = plain.wrap(floats(8))
    plain.run(dispatch(plain, "test_double", 1, 32, {0: x, 1: plain.alloc(32)}, n=8))
    assert plain.traffic() == []
    monkeypatch.setenv("LILY_SIM_CHECK", "1")
    checked = open_device("sim")
    with pytest.raises(KernelError, match="outside its 32 bound bytes"):
        checked.run(
            dispatch(
                checked,
                "test_double",
                1,
                32,
                {0: checked.wrap(floats(8)), 1: checked.alloc(32)},
                n=9,
            )
        )
