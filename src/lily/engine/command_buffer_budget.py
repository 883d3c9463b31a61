"""How much estimated work one command buffer of a prefill pass may hold on a given Mac.

macOS ends a command buffer that keeps the GPU from the window server too long: it fails with
`kIOGPUCommandBufferCallbackErrorImpactingInteractivity` on a Mac driving a display. Apple does
not document the limit. Reports put the hard GPU-hang limit near 5 s (MoltenVK's log of a
command buffer ended at 5,001 ms, KhronosGroup/MoltenVK#2675), and show the interactivity error
well before it in long prefills: MLX ran into it prefilling this model at 120-130k tokens on an
M2 Max (jundot/omlx#1387), and tracel-ai/cubecl#1523 saw a single large matmul end it on an
M1 Max. So a command buffer is cut at COMMAND_BUFFER_SECONDS of estimated time, a fifth of the
hang limit, leaving room for the estimate to be off by several times.

Time is turned into work with the GPU's fp32 rate (cores x 128 lanes x 2 per FMA x clock; Apple
GPUs up to the M4 issue half-precision simdgroup-matrix FMAs at the same rate, per Philip
Turner's metal-benchmarks) at ATTAINED_FRACTION of it. The core count comes from the device (the
I/O Registry's `gpu-core-count`, `lily.device.metal_info`), the clock from the chip's generation
in its name. A budget per Mac, rather than one sized for the slowest, keeps chunks long on large
GPUs at long contexts. These are estimates from published figures, not measurements: no Mac has
run them.
"""

from __future__ import annotations

import re

COMMAND_BUFFER_SECONDS = 1.0
FP32_FLOPS_PER_CORE_CYCLE = 128 * 2
# GPU clocks by generation, from Apple's published fp32 rates: M1 2.6 TFLOPS with 8 cores,
# M2 3.6 with 10; M4 Max 16.2 with 40 and M5 Max 18.4 with 40 (as reported for those chips).
# A generation not listed takes the newest listed one before it (an M3 the M2's clock), a name
# with none the M1's: a lower clock only shortens command buffers.
GPU_CLOCK_HZ = {
    1: 2.6e12 / (8 * 256),
    2: 3.6e12 / (10 * 256),
    4: 16.2e12 / (40 * 256),
    5: 18.4e12 / (40 * 256),
}
# Share of the fp32 peak the prefill kernels are assumed to reach when the budget is set: the
# low end of what benchmarks/prefill_model.py assumes for today's GEMMs and chunk attention, so
# that a command buffer runs longer than estimated only if the kernels do worse than that.
ATTAINED_FRACTION = 0.4
# The fewest cores of a supported GPU (a 7-core M1), taken when the device does not say.
FEWEST_GPU_CORES = 7


def gpu_clock_hz(name: str) -> float:
    """The clock of the GPU named `name` (Metal's device name, e.g. "Apple M4 Max")."""
    found = re.search(r"\bM(\d+)\b", name)
    generation = int(found.group(1)) if found else 0
    known = [g for g in GPU_CLOCK_HZ if g <= generation]
    return GPU_CLOCK_HZ[max(known)] if known else GPU_CLOCK_HZ[1]


def fp32_flops(name: str, cores: int) -> float:
    """Peak fp32 FLOP/s of the GPU named `name` with `cores` cores (0: unknown, the fewest)."""
    return (cores or FEWEST_GPU_CORES) * FP32_FLOPS_PER_CORE_CYCLE * gpu_clock_hz(name)


def command_buffer_flops(name: str, cores: int) -> float:
    """The most estimated work (FLOPs, as `model_graph.layer_flops` counts them) one command
    buffer may hold on the GPU named `name` with `cores` cores."""
    return COMMAND_BUFFER_SECONDS * ATTAINED_FRACTION * fp32_flops(name, cores)
