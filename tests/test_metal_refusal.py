"""Opening the metal device on a GPU it refuses: UnsupportedGPUError with the device's reason,
which the LILY_DEVICE tests turn into a skip, while any other failure stays an error. The native
module is replaced by a stand-in here, so this runs anywhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from device_testing import DEVICE_ENV, open_test_device

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
