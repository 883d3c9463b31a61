"""Wrapped numpy arrays that are not in a memory-mapped file.

Metal wraps without copying only whole-page VM allocations (the checkpoint's memory maps), so
the metal device mirrors any other wrapped array (csrc/host_mirror.h): copied to the device when
a graph binding it is submitted, unless an earlier graph binding it is still running, and copied
back, if writable, once the graph has finished. The sim, opened with mirror_wrapped=True, mirrors
them the same way; these tests hold it to what Python relies on: the kernels' writes appear in
the array after the graph is waited for, the host's writes between graphs reach the kernels, and
a graph submitted behind another one sees that one's writes, not the array's older bytes.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from device_testing import open_test_device

from lily.device import Graph, in_mapped_file, open_device
from lily.kernels.copy import record_copy

WORDS = 4096


@pytest.fixture(scope="module", params=["mirrored", "in-place", "test-device"])
def device(request):
    """The sim mirroring wrapped arrays, the sim using them in place, and the device named by
    LILY_DEVICE (the metal device on a Mac, which mirrors them)."""
    if request.param == "test-device":
        return open_test_device()
    return open_device("sim", mirror_wrapped=request.param == "mirrored")


def copy_graph(device, source, destination) -> Graph:
    graph = Graph()
    record_copy(graph, device, source, destination, WORDS * 4)
    return graph


def test_arrays_in_memory_mapped_files_are_told_apart(tmp_path):
    assert not in_mapped_file(np.arange(10))
    assert not in_mapped_file(np.arange(10)[2:])
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    shard = np.frombuffer(mapped, dtype=np.uint8)
    assert in_mapped_file(shard)
    assert in_mapped_file(shard[16:32].view(np.uint32))
    memmap = np.memmap(path, dtype=np.uint32, mode="r+")
    assert in_mapped_file(memmap) and in_mapped_file(memmap[4:8])
    assert not in_mapped_file(np.array(memmap))  # a copy is numpy's own memory
    del shard, memmap
    mapped.close()


def test_kernel_writes_appear_in_the_array_and_host_writes_reach_the_kernels(device):
    source = np.arange(WORDS, dtype=np.uint32)
    destination = np.zeros(WORDS, dtype=np.uint32)
    graph = copy_graph(device, device.wrap(source), device.wrap(destination))
    device.run(graph)
    np.testing.assert_array_equal(destination, source)
    # The host writes the source between two runs of the same graph: the kernel sees it.
    source[:] = np.arange(WORDS, dtype=np.uint32)[::-1] * 3
    device.run(graph)
    np.testing.assert_array_equal(destination, source)


def test_the_buffer_shows_the_array_itself(device):
    array = np.zeros(WORDS, dtype=np.uint32)
    buffer = device.wrap(array)
    view = buffer.numpy()
    array[7] = 99
    assert view.view(np.uint32)[7] == 99


def test_a_graph_behind_another_sees_its_writes(device):
    rng = np.random.default_rng(5)
    for _ in range(20):
        source = rng.integers(0, 2**32, WORDS, dtype=np.uint32)
        middle = np.zeros(WORDS, dtype=np.uint32)
        destination = np.zeros(WORDS, dtype=np.uint32)
        wrapped = [device.wrap(a) for a in (source, middle, destination)]
        first = device.submit(copy_graph(device, wrapped[0], wrapped[1]))
        second = device.submit(copy_graph(device, wrapped[1], wrapped[2]))
        device.wait(second)
        assert first < second
        np.testing.assert_array_equal(middle, source)
        np.testing.assert_array_equal(destination, source)


def test_read_only_arrays_are_read(device):
    source = np.arange(WORDS, dtype=np.uint32) + 11
    source.flags.writeable = False
    destination = np.zeros(WORDS, dtype=np.uint32)
    device.run(copy_graph(device, device.wrap(source), device.wrap(destination)))
    np.testing.assert_array_equal(destination, source)


def test_a_memory_mapped_file_is_written_in_place(device, tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(WORDS * 4))
    memmap = np.memmap(path, dtype=np.uint32, mode="r+")
    source = np.arange(WORDS, dtype=np.uint32) * 7
    device.run(copy_graph(device, device.wrap(source), device.wrap(memmap)))
    np.testing.assert_array_equal(memmap, source)
    memmap.flush()
    np.testing.assert_array_equal(np.fromfile(path, dtype=np.uint32), source)
