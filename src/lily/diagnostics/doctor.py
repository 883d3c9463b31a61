"""`lily doctor`: does Lily work on this machine, and how fast are its kernels?

Prints the machine (device, GPU family, macOS, memory and the GPU wired-memory limit, the
checkpoint) and the lane-layout self-test (does the GPU lay out simdgroup_matrix fragments as
the kernels assume: lily.kernels.lane_layout), then runs every kernel of metal/ once on the
device against its float64 numpy reference with the test suite's error bounds
(lily.diagnostics.kernel_checks), as a table: kernel, shapes, largest error, worst error /
bound, pass or FAIL. On the metal device the large kernels are run again to report their GPU
time and achieved bandwidth next to the chip's. On the sim (any machine without the metal
device) the table checks correctness only, the largest kernels at
smaller shapes. Exits 1 if the self-test or a row fails.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lily.device import Device, metal_info, open_device, physical_memory
from lily.diagnostics.kernel_checks import CHECKS, Comparison, KernelCheck
from lily.diagnostics.preflight import GIB
from lily.kernels.lane_layout import run_lane_layout_self_test

# Apple's published unified-memory bandwidth of each chip, GB/s (the largest configuration's
# where variants differ, e.g. the binned M3 Max and M4 Max have less). Longest name first.
CHIP_BANDWIDTH_GBS = {
    "M1 Ultra": 800, "M1 Max": 400, "M1 Pro": 200, "M1": 68.25,
    "M2 Ultra": 800, "M2 Max": 400, "M2 Pro": 200, "M2": 100,
    "M3 Ultra": 819, "M3 Max": 400, "M3 Pro": 150, "M3": 100,
    "M4 Max": 546, "M4 Pro": 273, "M4": 120,
    "M5": 153,
}  # fmt: skip
TIMING_RUNS = 10


def chip_bandwidth(gpu_name: str) -> float | None:
    """GB/s for a GPU named like "Apple M3 Max", or None for an unknown chip."""
    for chip in sorted(CHIP_BANDWIDTH_GBS, key=len, reverse=True):
        if gpu_name.endswith(" " + chip) or f" {chip} " in gpu_name + " ":
            return CHIP_BANDWIDTH_GBS[chip]
    return None


@dataclass
class Row:
    check: KernelCheck
    comparison: Comparison | None = None
    error: str | None = None  # the exception that stopped the check
    gpu_seconds: float | None = None
    bytes_moved: int = 0
    host_seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and self.comparison is not None and self.comparison.passed

    @property
    def gb_per_s(self) -> float | None:
        if not self.gpu_seconds or not self.bytes_moved:
            return None
        return self.bytes_moved / self.gpu_seconds / 1e9


def gpu_seconds_of(device: Device) -> float | None:
    from lily import _native

    if device.name != "metal":
        return None
    return _native.metal_last_gpu_seconds(device._native)


def run_check(device: Device, check: KernelCheck, seed: int = 0, timing_runs: int = 0) -> Row:
    """Runs one check; any exception (a kernel fault, a missing kernel) fails its row."""
    row = Row(check)
    start = time.perf_counter()
    try:
        trial = check.prepare(device, np.random.default_rng(seed))
        device.run(trial.graph)
        row.comparison = trial.verify()
        row.bytes_moved = trial.bytes_moved
        if check.timed and timing_runs and device.name == "metal":
            times = []
            for _ in range(timing_runs):
                device.run(trial.graph)
                times.append(gpu_seconds_of(device))
            row.gpu_seconds = statistics.median(times)
    except Exception as exc:  # noqa: BLE001 - a failing kernel is a row of the report
        row.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if os.environ.get("LILY_DOCTOR_TRACEBACK"):
            traceback.print_exc()
    row.host_seconds = time.perf_counter() - start
    return row


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def system_lines(device: Device) -> list[str]:
    from lily.checkpoint.demo import demo_status
    from lily.checkpoint.loader import default_checkpoint_status
    from lily.version import __version__

    memory = physical_memory()
    lines = [
        f"lily:              {__version__}",
        f"python:            {platform.python_version()} on {platform.system()} "
        f"{platform.machine()}",
        f"device:            {device.name}",
        f"prefill gemms:     {'tensor ops' if device.tensor_ops else 'simdgroup matrix'} "
        f"({device.gemm_path_reason})",
        f"memory:            {f'{memory / GIB:.1f} GiB' if memory else 'unknown'}",
    ]
    info = None
    try:
        info = metal_info()
    except RuntimeError as exc:
        lines.append(f"metal:             unavailable ({exc})")
    if info:
        bandwidth = chip_bandwidth(info["name"])
        lines += [
            f"gpu:               {info['name']}, family {info['gpu_family']}"
            + (f", {bandwidth:g} GB/s (Apple's figure)" if bandwidth else ""),
            f"macOS:             {info['os_version']}",
            f"gpu working set:   {info['recommended_working_set'] / GIB:.1f} GiB recommended "
            "(recommendedMaxWorkingSetSize)",
        ]
        wired = _sysctl("iogpu.wired_limit_mb")
        if wired is not None:
            setting = "macOS default" if wired == "0" else f"{wired} MiB, raised"
            lines.append(f"gpu wired limit:   iogpu.wired_limit_mb = {wired} ({setting})")
        if not info.get("supported", True):
            lines.append(f"metal:             cannot run the kernels: {info['unsupported_reason']}")
    elif info is None and device.name == "sim":
        lines.append("metal:             not in this build (Apple silicon and macOS only)")
    lines += [
        f"checkpoint:        {default_checkpoint_status()}",
        f"                   {demo_status()}",
    ]
    return lines


def lane_layout_line(device: Device) -> tuple[str, bool]:
    """The report's line on the lane-layout self-test, and whether it passed (an exception
    fails it)."""
    try:
        mismatch = run_lane_layout_self_test(device).mismatch()
    except Exception as exc:  # noqa: BLE001 - a failing self-test is a line of the report
        mismatch = f"could not run the self-test: {type(exc).__name__}: {exc}".splitlines()[0]
    else:
        if mismatch is not None:
            info = metal_info() if device.name == "metal" else None
            gpu = f'the GPU "{info["name"]}"' if info else f"the {device.name} device"
            mismatch = f"{gpu} {mismatch}"
    if mismatch is None:
        return "lane layout:       pass (simdgroup_matrix fragments as metal/common.h says)", True
    return f"lane layout:       FAIL: {mismatch}", False


def format_table(rows: Sequence[Row], device: Device) -> str:
    timed = device.name == "metal"
    bandwidth = None
    if timed:
        info = metal_info() or {}
        bandwidth = chip_bandwidth(info.get("name", ""))
    header = ["kernel", "shapes", "max error", "error/bound", "result"]
    if timed:
        header += ["GPU time", "GB/s", "of peak"]
    table = [header]
    for row in rows:
        if row.comparison is not None:
            cells = [f"{row.comparison.max_error:.3g}", f"{row.comparison.worst_ratio:.3g}"]
        else:
            cells = ["-", "-"]
        cells.append("pass" if row.passed else f"FAIL{': ' + row.error if row.error else ''}")
        if timed:
            gbs = row.gb_per_s
            cells += [
                f"{row.gpu_seconds * 1e6:.0f} us" if row.gpu_seconds else "",
                f"{gbs:.0f}" if gbs else "",
                f"{gbs / bandwidth:.0%}" if gbs and bandwidth else "",
            ]
        table.append([row.check.kernel, row.check.shapes, *cells])
    widths = [max(len(r[i]) for r in table[:]) for i in range(len(header) - (not timed))]
    lines = []
    for i, cells in enumerate(table):
        padded = [c.ljust(w) for c, w in zip(cells, widths, strict=False)] + cells[len(widths) :]
        lines.append("| " + " | ".join(padded) + " |")
        if i == 0:
            lines.append("|" + "|".join("-" * (len(c) + 2) for c in padded) + "|")
    return "\n".join(lines)


def run(
    device: Device,
    checks: Sequence[KernelCheck] = CHECKS,
    *,
    out=None,
    timing_runs: int = TIMING_RUNS,
    system: bool = True,
) -> int:
    """Prints the report for `checks` on `device` (to `out`, default stdout; progress goes to
    stderr); 0 if every row passed, else 1."""
    out = out or sys.stdout
    if system:
        print("\n".join(system_lines(device)), file=out)
    layout, layout_passed = lane_layout_line(device)
    print(layout, file=out)
    print(file=out)
    if device.name == "sim":
        print(
            "Kernels on the sim device (the CPU simulator): correctness only, no timings.",
            file=out,
        )
    else:
        print(
            f"Kernels on the {device.name} device; large ones timed over {timing_runs} runs "
            "(median GPU time, bytes read and written once per run).",
            file=out,
        )
    rows = []
    for check in (c.on(device.name) for c in checks):
        rows.append(run_check(device, check, timing_runs=timing_runs))
        print(
            f"  {check.kernel} ({check.shapes}): {'pass' if rows[-1].passed else 'FAIL'}",
            file=sys.stderr,
            flush=True,
        )
    print(format_table(rows, device), file=out)
    failed = [row for row in rows if not row.passed]
    print(file=out)
    if failed:
        print(f"{len(failed)} of {len(rows)} kernel checks FAILED.", file=out)
    else:
        print(f"All {len(rows)} kernel checks passed.", file=out)
    if not layout_passed:
        print("The lane-layout self-test FAILED: the kernels' results are wrong here.", file=out)
    return 0 if layout_passed and not failed else 1


def open_for_doctor(kind: str) -> Device:
    """`auto`: the metal device where this build has one, else the sim."""
    if kind == "auto":
        from lily.device import available

        kind = "metal" if "metal" in available() else "sim"
    return open_device(kind)


def main(kind: str = "auto", timing_runs: int = TIMING_RUNS) -> int:
    """`lily doctor`: the report on the `kind` device (auto, sim or metal); 1 if a row fails or
    the device cannot be opened."""
    try:
        device = open_for_doctor(kind)
    except (RuntimeError, ValueError) as exc:
        info = None
        with contextlib.suppress(RuntimeError):
            info = metal_info()
        print(f"lily doctor: cannot open the {kind} device: {exc}", file=sys.stderr)
        if info:
            print(f"metal device info: {info}", file=sys.stderr)
        return 1
    return run(device, timing_runs=timing_runs)
