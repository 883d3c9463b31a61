"""`lily doctor` on the sim: the lane-layout self-test and the full kernel table pass, and a
broken kernel fails its row and the exit code (a kernel fault, and a result outside its error
bound), as does a GPU whose simdgroup_matrix layout differs (a sim playing one)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from lily import cli
from lily.device import Graph, open_device
from lily.diagnostics import doctor
from lily.diagnostics.kernel_checks import (
    CHECKS,
    Comparison,
    KernelCheck,
    Trial,
    compare,
    compare_ulps,
)

SWAPPED = [6 if lane == 5 else 5 if lane == 6 else lane for lane in range(32)]


@pytest.fixture(scope="module")
def sim():
    return open_device("sim")


def test_every_kernel_passes_on_the_sim(capsys):
    assert cli.main(["doctor", "--device", "sim"]) == 0
    out = capsys.readouterr().out
    assert "device:            sim" in out
    assert "correctness only" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "| pass" in line]
    assert len(rows) == len(CHECKS)
    for check in (c.on("sim") for c in CHECKS):
        assert any(check.kernel in row and check.shapes in row for row in rows), check
    assert f"All {len(CHECKS)} kernel checks passed." in out
    assert "lane layout:       pass" in out


def scale_check(factor_expected: float, ulps: float = 1) -> KernelCheck:
    """test_scale_float (y = 3 x) judged against factor_expected * x."""

    def prepare(device, rng):
        x = rng.normal(0, 1, 100).astype(np.float32)
        y = np.zeros_like(x)
        graph = Graph()
        graph.dispatch(
            device.kernel("test_scale_float"),
            threadgroups=4,
            threads=25,
            buffers={0: device.wrap(x), 1: device.wrap(y)},
            bytes={2: np.float32(3.0).tobytes()},
        )
        expected = factor_expected * x.astype(np.float64)
        return Trial(graph, lambda: compare_ulps(y, expected, np.abs(expected), ulps))

    return KernelCheck("test_scale_float", f"100, expected {factor_expected} x", prepare)


def unbound_read_check() -> KernelCheck:
    def prepare(device, rng):
        graph = Graph()
        graph.dispatch(
            device.kernel("broken_unbound_read"),
            threadgroups=1,
            threads=32,
            buffers={0: device.alloc(128)},
        )
        return Trial(graph, lambda: Comparison(0.0, 0.0))

    return KernelCheck("broken_unbound_read", "32", prepare)


def report(device, checks) -> tuple[int, str]:
    out = io.StringIO()
    code = doctor.run(device, checks, out=out, system=False)
    return code, out.getvalue()


def test_a_kernel_fault_fails_its_row_and_the_exit_code(sim):
    code, out = report(sim, [scale_check(3.0), unbound_read_check()])
    assert code == 1
    (row,) = [line for line in out.splitlines() if "broken_unbound_read" in line]
    assert "FAIL: KernelError" in row and "not bound" in row
    (good,) = [line for line in out.splitlines() if "test_scale_float" in line]
    assert "| pass" in good
    assert "1 of 2 kernel checks FAILED." in out


def test_a_gpu_whose_lane_layout_differs_fails_the_report():
    # The sim playing a GPU whose lanes 5 and 6 trade their simdgroup_matrix elements.
    swapped = open_device("sim", matrix_lanes=SWAPPED)
    code, out = report(swapped, [scale_check(3.0)])
    assert code == 1
    (line,) = [line for line in out.splitlines() if line.startswith("lane layout:")]
    assert line.startswith(
        "lane layout:       FAIL: the sim device lays out simdgroup_matrix fragments differently"
    )
    assert "lane 5 element 0 holds (row 3, column 0), not (row 2, column 2)" in line
    assert "All 1 kernel checks passed." in out
    assert "The lane-layout self-test FAILED" in out


def test_the_lane_layout_self_test_passes_on_the_sim(sim):
    code, out = report(sim, [scale_check(3.0)])
    assert code == 0
    assert "lane layout:       pass" in out


def test_a_result_outside_its_bound_fails(sim):
    code, out = report(sim, [scale_check(3.0 * (1 + 1e-3))])
    assert code == 1
    (row,) = [line for line in out.splitlines() if "test_scale_float" in line]
    assert "FAIL" in row
    ratio = float(row.split("|")[4])
    assert ratio > 1000  # a relative error of 1e-3 is thousands of float32 ulps


def test_the_chunk_attention_check_runs_the_tensor_op_kernel_where_tensor_ops_run():
    """On an M5 the doctor's chunk-attention row checks the kernel prefill runs there: the
    tensor-op one (its packed queries included), within the same bound."""
    device = open_device("sim", tensor_ops=True)
    (check,) = [c for c in CHECKS if c.kernel == "attention prepare+chunk"]
    device.matrix_products()
    code, out = report(device, [check])
    assert code == 0, out
    products = device.matrix_products()
    assert [name for name in products if name.startswith("attention")] == ["attention_chunk_tensor"]


def test_a_missing_kernel_fails_its_row(sim):
    def prepare(device, rng):
        device.kernel("no_such_kernel")

    code, out = report(sim, [KernelCheck("no_such_kernel", "-", prepare)])
    assert code == 1
    assert "FAIL: ValueError: unknown kernel 'no_such_kernel'" in out


def test_a_device_that_cannot_open_fails(capsys):
    if doctor.metal_info() is not None:
        pytest.skip("this build has the metal device")
    assert cli.main(["doctor", "--device", "metal"]) == 1
    assert "cannot open the metal device" in capsys.readouterr().err


def test_compare():
    assert compare([1.0, 2.0], [1.0, 2.0], 0).passed
    assert not compare([1.0, 2.5], [1.0, 2.0], 0.4).passed
    assert compare([1.0, 2.3], [1.0, 2.0], 0.4).worst_ratio == pytest.approx(0.75)
    assert not compare([np.nan], [1.0], 10).passed
    assert not compare([1.0, 2.0], [1.0], 10).passed


@pytest.mark.parametrize(
    ("name", "bandwidth"),
    [
        ("Apple M1", 68.25),
        ("Apple M1 Pro", 200),
        ("Apple M3 Max", 400),
        ("Apple M4 Pro", 273),
        ("Apple M2 Ultra", 800),
        ("Apple M5", 153),
        ("Apple Paravirtual device", None),
    ],
)
def test_chip_bandwidth(name, bandwidth):
    assert doctor.chip_bandwidth(name) == bandwidth


def test_doctor_says_which_gemm_path_runs_and_why():
    """The sim runs the simdgroup-matrix GEMMs unless opened with tensor_ops, and says which Mac
    each stands for: macOS 26.2 with an Apple10-family GPU picks the tensor ops."""
    plain = next(
        line for line in doctor.system_lines(open_device("sim")) if "prefill gemms" in line
    )
    assert "simdgroup matrix" in plain and "unless opened with tensor_ops" in plain
    assert "before macOS 26.2 or without an Apple10-family GPU" in plain
    tensor = next(
        line
        for line in doctor.system_lines(open_device("sim", tensor_ops=True))
        if "prefill gemms" in line
    )
    assert "tensor ops" in tensor and "emulation of matmul2d" in tensor
    assert "macOS 26.2 or later and an Apple10-family GPU" in tensor
