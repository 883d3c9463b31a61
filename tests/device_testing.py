"""The device of the tests that honour LILY_DEVICE (default sim; the macOS workflow sets metal).

On a Mac whose GPU the metal device refuses (GitHub's macOS runners have a paravirtual GPU
without Metal 3), those tests are skipped with the device's reason, so the workflow's summary
lists them as not run; any other failure to open the device fails them.
"""

from __future__ import annotations

import os

import pytest

from lily.device import Device, UnsupportedGPUError, open_device

DEVICE_ENV = "LILY_DEVICE"


def open_test_device() -> Device:
    try:
        return open_device(os.environ.get(DEVICE_ENV, "sim"))
    except UnsupportedGPUError as refusal:
        pytest.skip(str(refusal))
