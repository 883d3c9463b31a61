"""Every kernel on the metal device and on the sim, with the same inputs.

This runs only where the metal device can: macOS on an Apple7-family GPU (M1 or later). Anywhere
else each test is skipped with a reason saying that the metal device is unavailable on this
platform (and why); this is the suite's one legitimate skip, and the macOS workflow lists it.

How the kernels are covered: the kernel tests (tests/test_kernel_*.py) take their device from
``kernel_testing.sim_device()``. Each kernel test file runs again, in a subprocess, with this
module loaded as a pytest plugin (``-p test_metal_vs_sim``). The plugin makes ``sim_device()``
return a :class:`DualDevice`: buffers and kernels live on the metal device, so the kernel tests'
own assertions hold the metal results to their float64 numpy references and ulp tolerances;
and every graph is also replayed on the sim with copies of the same inputs, taken before the
metal device runs, and the outputs of the two devices are compared. Metal and the sim are not
expected to agree bit for bit (reduction order, fused multiply-adds); the comparison fails only
on a NaN from metal where the sim has a number, and otherwise reports how far they differ.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily import _native
from lily.device import Device, Graph, open_device

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
KERNEL_TEST_FILES = sorted(TESTS.glob("test_kernel_*.py"))
REPORT_ENV = "LILY_METAL_VS_SIM_REPORT"
STAND_IN_ENV = "LILY_METAL_VS_SIM_STAND_IN"  # a second sim plays metal: tests the harness


def metal_unavailable_reason() -> str | None:
    """Why the metal device cannot run here, or None when it must."""
    if sys.platform != "darwin":
        return f"metal device unavailable on this platform ({sys.platform}): Metal is macOS-only"
    if not hasattr(_native, "metal_device_info"):
        return None  # a macOS build without the metal device is a failure, not a skip
    info = _native.metal_device_info()
    if not info["supported"]:
        return (
            f"metal device unavailable on this platform: {info['name']} "
            f"({info['gpu_family']}): {info['unsupported_reason']}"
        )
    return None


@pytest.fixture(scope="module")
def metal() -> Device:
    reason = metal_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return open_device("metal")


@pytest.fixture(scope="module")
def sim() -> Device:
    return open_device("sim")


def kernels_in_metal_sources(names: list[str]) -> set[str]:
    """The names among `names` that metal/*.metal defines (the sim also has test kernels)."""
    text = "\n".join(path.read_text() for path in (REPO / "metal").glob("*.metal"))
    return {name for name in names if re.search(rf"\b{re.escape(name)}\b", text)}


def test_metal_library_has_every_kernel(metal, sim):
    expected = kernels_in_metal_sources(sim.kernel_names())
    assert expected, "the sim registers no kernel from metal/*.metal"
    assert expected <= set(metal.kernel_names())
    for name in sorted(expected):
        assert metal.kernel(name).max_threads_per_threadgroup >= 32


def test_wrapped_memory_is_shared_not_copied(metal):
    # A region that starts mid-page: the device widens it to whole pages and binds by offset.
    backing = np.arange(3 * 16384, dtype=np.uint32).view(np.uint8)
    region = backing[12345 : 12345 + 40000]
    buffer = metal.wrap(region)
    assert buffer.size == region.nbytes
    np.testing.assert_array_equal(buffer.numpy(), region)
    region[0] = 7
    assert buffer.numpy()[0] == 7


def test_memory_preflight(metal):
    info = _native.metal_device_info()
    _native.metal_check_memory(info["recommended_working_set"] // 2)
    with pytest.raises(RuntimeError, match="recommendedMaxWorkingSetSize"):
        _native.metal_check_memory(info["recommended_working_set"] + 2**30)


def run_on_dual_device(test_file: Path, tmp_path: Path, stand_in: bool = False):
    """Runs a kernel test file with the plugin below; returns pytest's result and the report."""
    report = tmp_path / f"{test_file.stem}.jsonl"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    env[REPORT_ENV] = str(report)
    if stand_in:
        env[STAND_IN_ENV] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "test_metal_vs_sim", str(test_file)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    graphs = (
        [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    )
    return result, graphs


@pytest.mark.parametrize("test_file", KERNEL_TEST_FILES, ids=lambda path: path.stem)
def test_kernel_tests_on_metal_and_sim(metal, test_file, tmp_path):
    result, graphs = run_on_dual_device(test_file, tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert graphs, f"{test_file.name} ran no graph through the dual device"
    kernels = sorted({name for graph in graphs for name in graph["kernels"]})
    identical = sum(graph["identical"] for graph in graphs)
    worst = max(graph["max_relative_difference"] for graph in graphs)
    print(f"{test_file.name}: {len(graphs)} graphs, {identical} bit-identical on metal and sim, "
          f"largest relative difference {worst:.3g}; kernels: {', '.join(kernels)}")  # fmt: skip
    nan_graphs = [graph for graph in graphs if graph["metal_nan_where_sim_is_not"]]
    assert not nan_graphs, f"metal produced NaN where the sim did not: {nan_graphs[:3]}"


# --- the harness itself, checked on any platform with a second sim standing in for metal ---------


def test_dual_device_harness_with_a_sim_standing_in_for_metal(tmp_path):
    result, graphs = run_on_dual_device(TESTS / "test_kernel_norm.py", tmp_path, stand_in=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert graphs, "the kernel tests ran no graph through the dual device"
    assert all(graph["kernels"] for graph in graphs)
    assert not any(graph["metal_nan_where_sim_is_not"] for graph in graphs)
    assert any(graph["identical"] for graph in graphs)


def test_dual_device_reports_nan_where_the_other_device_has_numbers(sim, tmp_path):
    report = tmp_path / "report.jsonl"
    dual = DualDevice(open_device("sim", lane_order="reverse"), sim, report)
    good = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    bad = np.array([1.0, np.nan, 3.0, 4.5], dtype=np.float32)
    dual._compare(["k"], [(dual.wrap(bad), sim.wrap(good))])
    dual._compare(["k"], [(dual.wrap(good.copy()), sim.wrap(good))])
    first, second = (json.loads(line) for line in report.read_text().splitlines())
    assert first["metal_nan_where_sim_is_not"] and not first["identical"]
    assert first["max_relative_difference"] == pytest.approx(0.5 / 4.0)
    assert second["identical"] and not second["metal_nan_where_sim_is_not"]


# --- the plugin the subprocesses load ------------------------------------------------------------


class DualDevice(Device):
    """The metal device, with each graph also replayed on the sim and the outputs compared."""

    def __init__(self, metal: Device, sim: Device, report: Path) -> None:
        super().__init__(metal._native)
        self._sim = sim
        self._report = report
        self._pending: dict[int, tuple[list[str], list[tuple]]] = {}

    def run(self, graph: Graph) -> None:
        self.wait(self.submit(graph))

    def submit(self, graph: Graph) -> int:
        sim_graph, pairs, kernels = self._replay_on_sim(graph)  # copies inputs before metal runs
        ticket = super().submit(graph)
        self._sim.run(sim_graph)
        self._pending[ticket] = (kernels, pairs)
        return ticket

    def wait(self, ticket: int) -> None:
        super().wait(ticket)
        for done in sorted(t for t in self._pending if t <= ticket):
            self._compare(*self._pending.pop(done))

    def _replay_on_sim(self, graph: Graph):
        copies: dict[int, tuple] = {}

        def on_sim(buffer):
            if id(buffer) not in copies:
                copy = self._sim.alloc(buffer.size)
                copy.numpy()[:] = buffer.numpy()
                copies[id(buffer)] = (buffer, copy)
            return copies[id(buffer)][1]

        sim_graph = Graph()
        kernels = []
        for operation in getattr(graph, "recorded", []):
            if operation is None:
                sim_graph.barrier()
                continue
            kernel, arguments = operation
            kernels.append(kernel.name)
            buffers = {}
            for index, binding in (arguments.get("buffers") or {}).items():
                buffer, offset = binding if isinstance(binding, tuple) else (binding, 0)
                buffers[index] = (on_sim(buffer), offset)
            sim_graph.dispatch(self._sim.kernel(kernel.name), **{**arguments, "buffers": buffers})
        return sim_graph, [pair for pair in copies.values() if pair[0].writable], kernels

    def _compare(self, kernels: list[str], pairs: list[tuple]) -> None:
        identical, relative, metal_nan = True, 0.0, False
        for metal_buffer, sim_buffer in pairs:
            a, b = metal_buffer.numpy(), sim_buffer.numpy()
            if np.array_equal(a, b):
                continue
            identical = False
            if a.size % 4 == 0:  # outputs are mostly float32: compare as such
                fa, fb = (
                    a.view(np.float32).astype(np.float64),
                    b.view(np.float32).astype(np.float64),
                )
                metal_nan |= bool(np.any(np.isnan(fa) & ~np.isnan(fb)))
                finite = np.isfinite(fa) & np.isfinite(fb)
                if finite.any():
                    scale = max(float(np.max(np.abs(fb[finite]))), 1e-30)
                    relative = max(relative, float(np.max(np.abs(fa - fb)[finite])) / scale)
        record = {
            "kernels": kernels,
            "identical": identical,
            "max_relative_difference": relative,
            "metal_nan_where_sim_is_not": metal_nan,
        }
        with self._report.open("a") as out:
            out.write(json.dumps(record) + "\n")


def pytest_configure(config) -> None:
    """Active only when this module is loaded with -p by test_kernel_tests_on_metal_and_sim."""
    report = os.environ.get(REPORT_ENV)
    if report is None:
        return
    import kernel_testing

    dispatch, barrier = Graph.dispatch, Graph.barrier

    def recording_dispatch(self, kernel, **arguments):
        self.__dict__.setdefault("recorded", []).append((kernel, arguments))
        dispatch(self, kernel, **arguments)

    def recording_barrier(self):
        self.__dict__.setdefault("recorded", []).append(None)
        barrier(self)

    Graph.dispatch, Graph.barrier = recording_dispatch, recording_barrier
    if os.environ.get(STAND_IN_ENV):
        metal = open_device("sim", lane_order="reverse", seed=1)
    else:
        metal = open_device("metal")
    devices: dict[str, DualDevice] = {}

    def dual_device(lane_order: str) -> DualDevice:
        if lane_order not in devices:
            sim = open_device("sim", lane_order=lane_order, seed=0)
            devices[lane_order] = DualDevice(metal, sim, Path(report))
        return devices[lane_order]

    kernel_testing.sim_device = dual_device
