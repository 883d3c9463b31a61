"""Opening the metal device on a GPU it refuses: UnsupportedGPUError with the device's reason,
which the LILY_DEVICE tests turn into a skip, while any other failure stays an error; and
`lily.load` refusing (device "metal") or leaving for the sim (device "auto") a GPU that fails the
lane-layout self-test. The native module is replaced by a stand-in here, so this runs anywhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from device_testing import DEVICE_ENV, open_test_device

import lily
import lily.api
import lily.device
from lily.device import UnsupportedGPUError, open_device

PARAVIRTUAL = (
    'the GPU "Apple Paravirtual device" is not in MTLGPUFamilyApple7 and MTLGPUFamilyMetal3 '
    "(Apple M1 or later), which the kernels need for simdgroup_matrix and bfloat"
)


def native_metal(monkeypatch, *, reason: str = "", open_error: Exception | None = None):
    """A stand-in for a macOS build's native module, with the GPU it reports; returns the
    list of devices it was asked to open."""
    opened = []

    def open_metal_device(metallib: str, sources: str):
        if open_error is not None:
            raise open_error
        opened.append((metallib, sources))
        return SimpleNamespace(name="metal")

    native = SimpleNamespace(
        metal_device_info=lambda: {"supported": not reason, "unsupported_reason": reason},
        open_metal_device=open_metal_device,
    )
    monkeypatch.setattr(lily.device, "_native", native)
    monkeypatch.setenv(DEVICE_ENV, "metal")
    return opened


def test_a_refused_gpu_raises_unsupported_gpu_error_with_the_reason(monkeypatch):
    opened = native_metal(monkeypatch, reason=PARAVIRTUAL)
    with pytest.raises(UnsupportedGPUError) as refusal:
        open_device("metal")
    assert str(refusal.value) == f"the metal device cannot run here: {PARAVIRTUAL}"
    assert isinstance(refusal.value, RuntimeError)  # callers catching RuntimeError still do
    assert opened == []


def test_tests_on_a_refused_gpu_skip_with_the_reason(monkeypatch):
    native_metal(monkeypatch, reason=PARAVIRTUAL)
    with pytest.raises(pytest.skip.Exception, match="Apple Paravirtual device"):
        open_test_device()


def test_other_failures_to_open_the_metal_device_are_errors_not_skips(monkeypatch):
    failure = RuntimeError("Metal could not compile attention.metal: ...")
    native_metal(monkeypatch, open_error=failure)
    with pytest.raises(RuntimeError) as error:
        open_test_device()
    assert error.value is failure and not isinstance(error.value, UnsupportedGPUError)


def test_a_supported_gpu_is_opened(monkeypatch):
    opened = native_metal(monkeypatch)
    assert open_test_device().name == "metal"
    assert len(opened) == 1


# ---- the lane-layout self-test when the metal device opens -------------------------------------
# The stand-in "metal" device is a sim playing a GPU whose lanes 5 and 6 trade their
# simdgroup_matrix elements (tests/test_kernel_lane_layout.py), or one with Apple's layout.

GPU = "Apple M9 Test"
SWAPPED = [6 if lane == 5 else 5 if lane == 6 else lane for lane in range(32)]
DIFFERENCE = "lane 5 element 0 holds (row 3, column 0), not (row 2, column 2)"


def sim_as_metal(monkeypatch, matrix_lanes: list[int]) -> list[str]:
    """The native module with a metal device that is a sim with `matrix_lanes`, on a Mac whose
    GPU the device supports; returns the log of model work (checkpoints resolved)."""
    real = lily.device._native
    native = SimpleNamespace(
        **{name: getattr(real, name) for name in dir(real) if not name.startswith("__")},
        metal_device_info=lambda: {"supported": True, "unsupported_reason": "", "name": GPU},
        open_metal_device=lambda metallib, sources: real.open_sim_device(
            "forward", 0, 0, True, "off", False, matrix_lanes
        ),
        metal_check_memory=lambda nbytes: None,
    )
    monkeypatch.setattr(lily.device, "_native", native)
    monkeypatch.setattr(lily.api, "_metal_supported", lambda: True)
    model_work = []
    resolve_model = lily.api.resolve_model

    def logged(model, revision):
        model_work.append(model)
        return resolve_model(model, revision)

    monkeypatch.setattr(lily.api, "resolve_model", logged)
    return model_work


def test_metal_refuses_a_gpu_whose_lane_layout_differs_before_any_model_work(monkeypatch):
    model_work = sim_as_metal(monkeypatch, SWAPPED)
    with pytest.raises(UnsupportedGPUError) as refusal:
        lily.load("demo", device="metal")
    message = str(refusal.value)
    assert message.startswith(f'the metal device cannot run here: the GPU "{GPU}" lays out ')
    assert DIFFERENCE in message
    assert model_work == []


def test_auto_falls_back_to_the_sim_with_the_reason(monkeypatch, capsys):
    model_work = sim_as_metal(monkeypatch, SWAPPED)
    with lily.load("demo", device="auto") as llm:
        assert llm.device == "sim"
        assert llm.generate("Hi", 2)
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("lily: the GPU")]
    assert f'"{GPU}" lays out simdgroup_matrix fragments differently' in line
    assert DIFFERENCE in line and line.endswith("; running on the CPU simulator")
    assert model_work == ["demo"]


def test_a_gpu_with_apple_s_layout_keeps_the_metal_device(monkeypatch, capsys):
    sim_as_metal(monkeypatch, list(range(32)))
    with lily.load("demo", device="auto") as llm:
        assert llm.device == "metal"
    assert "lily:" not in capsys.readouterr().err
