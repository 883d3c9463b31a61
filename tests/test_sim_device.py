"""The device API on the sim: buffers, kernels, graphs, submission, built-in ids."""

import struct

import numpy as np
import pytest

from lily.device import Graph, KernelError, open_device


@pytest.fixture(scope="module")
def dev():
    return open_device("sim", workers=2)


def axpy(dev, x, y, a, n, threadgroups, threads=32):
    g = Graph()
    g.dispatch(
        dev.kernel("test_axpy"),
        threadgroups=threadgroups,
        threads=threads,
        buffers={0: x, 1: y},
        bytes={2: struct.pack("<fI", a, n)},
    )
    return g


def test_alloc_is_zeroed_and_numpy_views_share_memory(dev):
    buf = dev.alloc(1000)
    view = buf.numpy()
    assert view.dtype == np.uint8 and view.shape == (1000,)
    assert not view.any()
    view[:4] = 7
    assert list(buf.numpy()[:5]) == [7, 7, 7, 7, 0]
    assert buf.size == 1000 and buf.writable


def test_run_writes_through_wrapped_arrays(dev):
    n = 100
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, 0.5, dtype=np.float32)
    dev.run(axpy(dev, dev.wrap(x), dev.wrap(y), 2.0, n, threadgroups=(4,)))
    np.testing.assert_array_equal(y, 2.0 * np.arange(n, dtype=np.float32) + 0.5)


def test_wrap_keeps_array_alive_and_accepts_read_only_and_memmap(dev, tmp_path):
    x = np.arange(64, dtype=np.float32)
    x.flags.writeable = False
    xb = dev.wrap(x)
    assert not xb.writable and not xb.numpy().flags.writeable
    path = tmp_path / "weights.bin"
    np.arange(64, dtype=np.float32).tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r")
    mb = dev.wrap(mm)
    del mm
    y = dev.alloc(64 * 4)
    dev.run(axpy(dev, mb, y, 1.0, 64, threadgroups=2))
    np.testing.assert_array_equal(y.numpy().view(np.float32), np.arange(64, dtype=np.float32))
    buf = dev.wrap(np.ones(8, dtype=np.float32))  # the temporary array lives on in the buffer
    assert buf.numpy().view(np.float32).sum() == 8


def test_wrap_rejects_non_contiguous(dev):
    with pytest.raises(ValueError, match="contiguous"):
        dev.wrap(np.zeros((4, 4), dtype=np.float32)[:, ::2])


def test_buffer_offsets(dev):
    x = dev.wrap(np.arange(16, dtype=np.float32))
    y = dev.alloc(16 * 4)
    g = Graph()
    g.dispatch(
        dev.kernel("test_axpy"),
        threadgroups=1,
        threads=8,
        buffers={0: (x, 8 * 4), 1: (y, 4 * 4)},
        bytes={2: struct.pack("<fI", 1.0, 8)},
    )
    dev.run(g)
    out = y.numpy().view(np.float32)
    np.testing.assert_array_equal(out[4:12], np.arange(8, 16))
    assert not out[:4].any() and not out[12:].any()


def test_unknown_kernel_names_close_matches(dev):
    with pytest.raises(ValueError, match="test_axpy"):
        dev.kernel("test_axpyy")
    assert "test_axpy" in dev.kernel_names()
    assert dev.name == "sim"


def test_template_instantiations_registered_by_host_name_only(dev):
    names = dev.kernel_names()
    for t in ("float", "half", "bfloat"):
        assert f"test_scale_{t}" in names
    assert "test_scale" not in names
    x = np.linspace(-2, 2, 64).astype(np.float16)
    y = np.zeros_like(x)
    g = Graph()
    g.dispatch(
        dev.kernel("test_scale_half"),
        threadgroups=2,
        threads=32,
        buffers={0: dev.wrap(x), 1: dev.wrap(y)},
        bytes={2: struct.pack("<f", 3.0)},
    )
    dev.run(g)
    np.testing.assert_array_equal(y, (x.astype(np.float32) * 3).astype(np.float16))


def test_graph_levels_replay_and_submit_wait(dev):
    n = 32
    x = dev.wrap(np.ones(n, dtype=np.float32))
    y = np.zeros(n, dtype=np.float32)
    yb = dev.wrap(y)
    g = axpy(dev, x, yb, 1.0, n, threadgroups=1)
    g.barrier()
    g.barrier()  # an empty level is not recorded
    g._graph.dispatch(
        dev.kernel("test_axpy"),
        (1, 1, 1),
        (32, 1, 1),
        [(0, x, 0), (1, yb, 0)],
        [(2, struct.pack("<fI", 2.0, n))],
        [],
    )
    assert g.dispatch_count == 2 and g.barrier_count == 1
    tickets = [dev.submit(g) for _ in range(3)]
    dev.wait(tickets[-1])
    np.testing.assert_array_equal(y, np.full(n, 9.0))
    dev.wait(tickets[0])  # already finished: returns at once


def test_builtins_match_the_grid(dev):
    tg, tpt = (3, 2, 2), (8, 3, 2)
    total = np.prod(tg) * np.prod(tpt)
    out = np.zeros((total, 12), dtype=np.uint32)
    g = Graph()
    g.dispatch(
        dev.kernel("test_builtins"), threadgroups=tg, threads=tpt, buffers={0: dev.wrap(out)}
    )
    dev.run(g)
    gx, gy, gz = (a * b for a, b in zip(tg, tpt, strict=True))
    z, y, x = np.meshgrid(np.arange(gz), np.arange(gy), np.arange(gx), indexing="ij")
    x, y, z = x.ravel(), y.ravel(), z.ravel()
    tid = np.stack([x % tpt[0], y % tpt[1], z % tpt[2]], axis=1)
    np.testing.assert_array_equal(out[:, 0:3], np.stack([x // 8, y // 3, z // 2], axis=1))
    np.testing.assert_array_equal(out[:, 3:6], tid)
    flat = (tid[:, 2] * tpt[1] + tid[:, 1]) * tpt[0] + tid[:, 0]
    np.testing.assert_array_equal(out[:, 6], flat)
    np.testing.assert_array_equal(out[:, 7], flat // 32)
    np.testing.assert_array_equal(out[:, 8], flat % 32)
    assert (out[:, 9] == 2).all()  # 48 threads: two simdgroups
    assert (out[:, 10] == 6).all() and (out[:, 11] == 48).all()


def test_dispatch_argument_checks(dev):
    k = dev.kernel("test_axpy")
    buf = dev.alloc(16)
    g = Graph()
    with pytest.raises(ValueError, match="offset"):
        g.dispatch(k, threadgroups=1, threads=1, buffers={0: (buf, 32)})
    with pytest.raises(ValueError, match="4096"):
        g.dispatch(k, threadgroups=1, threads=1, bytes={2: bytes(5000)})
    with pytest.raises(ValueError, match="multiple of 16"):
        g.dispatch(k, threadgroups=1, threads=1, threadgroup_memory={0: 10})
    with pytest.raises(ValueError, match="1 to 3"):
        g.dispatch(k, threadgroups=(1, 1, 1, 1), threads=1)
    g.dispatch(k, threadgroups=1, threads=2048, buffers={0: buf, 1: buf}, bytes={2: bytes(8)})
    with pytest.raises(KernelError, match="1024 threads"):
        dev.run(g)


def test_open_device_arguments():
    with pytest.raises(ValueError, match="lane_order"):
        open_device("sim", lane_order="sideways")
    with pytest.raises(ValueError, match="unknown device"):
        open_device("tpu")
    assert open_device("sim", lane_order="random", seed=3, workers=1).name == "sim"


def run_order(lane_order, seed=0, groups=3, threads=64):
    dev = open_device("sim", lane_order=lane_order, seed=seed, workers=2)
    counters = np.zeros(groups, dtype=np.uint32)
    ticket = np.zeros(groups * threads, dtype=np.uint32)
    g = Graph()
    g.dispatch(
        dev.kernel("test_run_order"),
        threadgroups=groups,
        threads=threads,
        buffers={0: dev.wrap(counters), 1: dev.wrap(ticket)},
    )
    dev.run(g)
    return ticket.reshape(groups, threads)


def test_lane_orders():
    lanes = np.arange(64)
    assert (run_order("forward") == lanes).all()
    assert (run_order("reverse") == lanes[::-1]).all()
    random = run_order("random", seed=1)
    for group in random:
        assert sorted(group) == list(lanes) and not (group == lanes).all()
    assert not (random[0] == random[1]).all()  # each threadgroup has its own permutation
    np.testing.assert_array_equal(run_order("random", seed=1), random)  # reproducible
    assert not (run_order("random", seed=2) == random).all()


def test_a_device_that_does_not_execute_checks_and_retires_graphs():
    dry = open_device("sim", execute=False)
    x = dry.wrap(np.ones(4, dtype=np.float32))
    y = dry.wrap(np.zeros(4, dtype=np.float32))
    graph = Graph()
    graph.dispatch(
        dry.kernel("test_axpy"),
        threadgroups=1,
        threads=4,
        buffers={0: x, 1: y},
        bytes={2: struct.pack("<fI", 2.0, 4)},
    )
    dry.run(graph)
    assert not y.numpy().any()
    graph.dispatch(
        dry.kernel("test_axpy"),
        threadgroups=1,
        threads=4,
        buffers={0: x, 1: y},
        bytes={2: b""},
        threadgroup_memory={0: 40 * 1024},
    )
    with pytest.raises(KernelError, match="32 KiB"):
        dry.run(graph)


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checked"])
def test_declared_max_threads_per_threadgroup_is_the_limit(check):
    """[[max_total_threads_per_threadgroup(N)]] is the kernel's limit, as a Metal pipeline
    reports it, and a larger threadgroup is refused instead of run."""
    dev = open_device("sim", check=check, workers=1)
    assert dev.kernel("test_axpy").max_threads_per_threadgroup == 1024  # declares none
    limits = {"test_max_threads": 64, "test_max_threads_32": 32, "test_max_threads_float": 32}
    for name, limit in limits.items():
        kernel = dev.kernel(name)
        assert kernel.max_threads_per_threadgroup == limit, name
        out = dev.alloc(4 * 2 * limit)
        g = Graph()
        g.dispatch(kernel, threadgroups=2, threads=limit, buffers={0: out})
        dev.run(g)
        expected = np.arange(1, 2 * limit + 1)
        values = out.numpy().view(np.float32 if name.endswith("float") else np.uint32)
        np.testing.assert_array_equal(values, expected)

        g = Graph()
        g.dispatch(kernel, threadgroups=1, threads=(limit, 2), buffers={0: out})
        message = (
            rf"kernel '{name}': {2 * limit} threads per threadgroup, more than its "
            rf"\[\[max_total_threads_per_threadgroup\({limit}\)\]\] allows"
        )
        with pytest.raises(KernelError, match=message):
            dev.run(g)
    # The device stays usable after the refusal.
    dev.run(axpy(dev, dev.alloc(64), dev.alloc(64), 1.0, 16, threadgroups=1))
