"""Deliberately broken kernels (tests/sim_kernels/broken.metal) raise KernelError naming the
kernel and threadgroup, never crash the process, and leave the device usable."""

import re

import numpy as np
import pytest

from lily.device import Graph, KernelError, open_device


@pytest.fixture(scope="module", params=["forward", "reverse", "random", "random-checked"])
def dev(request):
    order, _, checked = request.param.partition("-")
    return open_device("sim", lane_order=order, seed=1, workers=2, check=bool(checked))


def dispatch(dev, name, threadgroups, threads, buffers, threadgroup_memory=None):
    g = Graph()
    g.dispatch(
        dev.kernel(name),
        threadgroups=threadgroups,
        threads=threads,
        buffers=buffers,
        threadgroup_memory=threadgroup_memory,
    )
    return g


def expect_error(dev, name, pattern, threadgroups=(2, 1, 1), threads=64, buffers=None, **kw):
    out = dev.alloc(4096)
    g = dispatch(dev, name, threadgroups, threads, buffers or {0: out}, **kw)
    with pytest.raises(KernelError) as info:
        dev.run(g)
    message = str(info.value)
    assert f"kernel '{name}'" in message
    assert re.search(r"threadgroup \(\d+,0,0\)", message)
    assert re.search(pattern, message), message
    still_works(dev)
    return message


def still_works(dev):
    x = np.arange(64, dtype=np.float32)
    sums = np.zeros(1, dtype=np.float32)
    dev.run(dispatch(dev, "test_threadgroup_sum", 1, 64, {0: dev.wrap(x), 1: dev.wrap(sums)}))
    assert sums[0] == x.sum()


def test_barrier_after_partial_simdgroup_return(dev):
    msg = expect_error(dev, "broken_barrier_after_return", r"divergent control flow")
    assert "broken.metal:" in msg and "returned" in msg


def test_barriers_at_different_sites(dev):
    expect_error(dev, "broken_barrier_two_sites", r"threadgroup_barrier at .*broken\.metal:\d+")


def test_divergent_simd_collectives(dev):
    msg = expect_error(dev, "broken_divergent_simd", r"divergent control flow", threads=32)
    assert "simd_sum" in msg and "simd_max" in msg


def test_products_in_divergent_control_flow(dev):
    expect_error(dev, "broken_divergent_product", r"simdgroup_matrix multiply", threads=32)


def test_simd_collective_against_barrier(dev):
    expect_error(dev, "broken_simd_vs_barrier", r"simd_sum.*threadgroup_barrier", threads=32)


def test_threadgroup_memory_over_32_kib_in_kernel_body(dev):
    expect_error(dev, "broken_threadgroup_memory", r"36000 bytes .*32 KiB")


def test_threadgroup_memory_over_32_kib_as_arguments(dev):
    x, sums = dev.alloc(4 * 64), dev.alloc(4)
    g = dispatch(
        dev, "test_threadgroup_arg_sum", 1, 64, {0: x, 1: sums},
        threadgroup_memory={0: 16 * 1024, 1: 20 * 1024},
    )  # fmt: skip
    with pytest.raises(KernelError, match=r"test_threadgroup_arg_sum.*32 KiB"):
        dev.run(g)


def test_read_of_unbound_buffer(dev):
    expect_error(dev, "broken_unbound_read", r"buffer index 1, which is not bound")


def test_fiber_stack_overflow(dev):
    x = dev.wrap(np.ones(4, dtype=np.float32))
    expect_error(
        dev, "broken_stack_overflow", r"stack overflow", threads=4, buffers={0: dev.alloc(64), 1: x}
    )


def test_errors_reach_the_waiter_of_their_ticket(dev):
    bad = dispatch(dev, "broken_unbound_read", 1, 32, {0: dev.alloc(128)})
    good_x = np.arange(64, dtype=np.float32)
    sums = np.zeros(1, dtype=np.float32)
    good = dispatch(dev, "test_threadgroup_sum", 1, 64, {0: dev.wrap(good_x), 1: dev.wrap(sums)})
    t_bad = dev.submit(bad)
    t_good = dev.submit(good)
    with pytest.raises(KernelError, match="not bound"):
        dev.wait(t_good)  # the earlier failure surfaces at the first wait that covers it
    dev.wait(t_bad)  # reported once
    assert sums[0] == good_x.sum()
