"""The Gated DeltaNet prefill scan's time per token per layer on Apple GPUs: a model, not a
measurement (nothing here runs on a GPU).

The model is throughput only: it counts the instructions a threadgroup issues per token (all its
SIMD-groups together), puts as many threadgroups on a core as its threadgroup memory and thread
slots allow, and divides the busiest core's count by its issue rate (4 schedulers, one
instruction per cycle each). Threadgroups that do not all fit on the GPU at once run in rounds,
each round paying its whole scan. Latency (barriers, the dependency chains of reductions and of
the triangular solve, memory) is not modelled: it only adds. The counts follow the kernels'
structure (metal/gdn.metal):

- **serial** (the `gdn_chunk` the chunkwise kernel replaced): one 1,024-thread threadgroup per
  value head; per token each of its 32 SIMD-groups runs 4 state rows through the recurrence
  (4 key dims per lane: decay, dot, update, readout, delta: 72 fp32 operations), two float4
  simd_sums (5 shuffle-and-add steps per component) and its q/k/v loads; once per token a
  SIMD-group prepares the token (norms, gates) and one applies the output norm (~100).
- **chunkwise** (today's `gdn_chunk`): per sub-chunk of 16 tokens, the 8x8x8 simdgroup-matrix
  products of its 4 SIMD-groups with half operands (the key-side tiles of K K^T and Q K^T, and
  per SIMD-group K S^T and Q S^T over 16 key tiles, U = X R, P U and the state's update), one
  tile load per product, the diagonal scalings and half conversions on each lane's own
  elements, 16 prepared tokens and the solve's 120 steps with an exp. A half product is counted
  at the fp32 product's cycles: Apple GPUs up to the M4 issue both at one rate
  (`prefill_model.py`), so this is conservative on an M5.

Assumed GPU figures (public core counts; the clock follows from the fp32 rate bench_prefill.py
assumes, rate = cores x 128 lanes x 2 x clock; not measured): an 8x8x8 fp32 product occupies a
scheduler for 512 / 32 = 16 cycles; a core holds 64 KiB of threadgroup memory and 1,024 threads
at once.

    python benchmarks/gdn_scan_model.py
"""

from __future__ import annotations

from dataclasses import dataclass

from lily.kernels.gdn import CHUNK_ROWS_PER_THREADGROUP, CHUNK_SUB_CHUNK, KEY_HEAD_DIM

VALUE_HEADS = 32  # the real model's
GDN_LAYERS = 30
SCHEDULERS_PER_CORE = 4
PRODUCT_CYCLES = 8 * 8 * 8 // 32  # one 8x8x8 fp32 product on one scheduler


@dataclass(frozen=True)
class Gpu:
    name: str
    cores: int
    clock_hz: float
    threadgroup_memory: int  # per core, bytes
    threads: int  # resident per core


# Clocks from the fp32 rates bench_prefill.py assumes (rate = cores * 128 lanes * 2 * clock).
GPUS = [
    Gpu("M1 Pro (16-core GPU)", 16, 5.2e12 / (16 * 256), 64 * 1024, 1024),
    Gpu("M5 Max (40-core GPU)", 40, 18.4e12 / (40 * 256), 64 * 1024, 1024),
]


@dataclass(frozen=True)
class Kernel:
    name: str
    threadgroups: int
    threads: int
    threadgroup_memory: int
    # Issue cycles per token of one threadgroup, summed over its SIMD-groups.
    cycles_per_token: float


def serial_kernel() -> Kernel:
    per_lane_keys = KEY_HEAD_DIM // 32
    rows = 4
    arithmetic = rows * per_lane_keys * 4 + rows * 2  # decay, dot, update, readout; delta
    reductions = 2 * rows * 5 * 2  # two float4 simd_sums: 5 shuffle + add steps per component
    loads = 2 * per_lane_keys + rows + 2  # q, k from threadgroup memory, v, the readout store
    per_simdgroup = arithmetic + reductions + loads
    # One SIMD-group per token prepares it (loads, two norms, gates) and one norms its output.
    per_token_once = 60 + 40
    return Kernel(
        "serial scan",
        VALUE_HEADS,
        1024,
        16 * 1024 + 16 * 128 * 4 + 16 * 8,
        32 * per_simdgroup + per_token_once,
    )


def chunkwise_kernel() -> Kernel:
    tokens = CHUNK_SUB_CHUNK
    token_tiles, key_tiles = tokens // 8, KEY_HEAD_DIM // 8
    lower_tiles = token_tiles * (token_tiles + 1) // 2
    simdgroups = CHUNK_ROWS_PER_THREADGROUP // 8
    key_side = 2 * lower_tiles * key_tiles  # K K^T and Q K^T, spread over the SIMD-groups
    state_side = (
        2 * token_tiles * key_tiles  # K S^T, Q S^T
        + lower_tiles  # U = X R
        + lower_tiles  # P U
        + key_tiles * token_tiles  # the state's K^T U
    )
    # Per SIMD-group, on a lane's 2 elements of each tile: the diagonal scalings (R, O, U to the
    # end, the state's decay: a multiply and an add each), the conversions to half operands, and
    # the three power-of-two scales' simd_max (5 shuffle-and-max steps each).
    scaled_tiles = key_tiles + 3 * token_tiles
    elementwise = scaled_tiles * 2 * 2 + (key_tiles + 3 * token_tiles) * 2 + 3 * 5 * 2
    products = key_side + simdgroups * state_side
    loads = products  # a tile load (2 per lane) per product, as one issue slot each
    prepare = tokens * 60
    solve = tokens * (tokens - 1) // 2 * 8  # exp, 2 multiplies, an add per step, one lane column
    cycles = products * PRODUCT_CYCLES + loads + simdgroups * elementwise + prepare + solve
    memory = (
        2 * 2 * tokens * KEY_HEAD_DIM  # q, k (half)
        + 4 * 2 * tokens * CHUNK_ROWS_PER_THREADGROUP  # v, the readouts
        + 4 * 2 * tokens * tokens  # K K^T, Q K^T
        + 2 * 2 * tokens * tokens  # P, X (half)
        + 4 * 3 * tokens  # log decay, beta, Gamma
    )
    return Kernel(
        "chunkwise",
        VALUE_HEADS * 128 // CHUNK_ROWS_PER_THREADGROUP,
        simdgroups * 32,
        memory,
        cycles / tokens,
    )


def per_token_seconds(kernel: Kernel, gpu: Gpu) -> tuple[float, int, int]:
    """(seconds per token per layer, threadgroups per core at once, rounds)."""
    per_core = min(
        gpu.threadgroup_memory // kernel.threadgroup_memory, gpu.threads // kernel.threads
    )
    rounds = -(-kernel.threadgroups // (per_core * gpu.cores))
    # The busiest core of a round runs this many threadgroups side by side.
    busiest = min(per_core, -(-kernel.threadgroups // (rounds * gpu.cores)))
    cycles = busiest * kernel.cycles_per_token / SCHEDULERS_PER_CORE * rounds
    return cycles / gpu.clock_hz, per_core, rounds


def main() -> None:
    print(
        "GDN prefill scan per token per layer: a model from counted instructions, not a measurement"
    )
    for kernel in (serial_kernel(), chunkwise_kernel()):
        print(
            f"{kernel.name}: {kernel.threadgroups} threadgroups of {kernel.threads} threads, "
            f"{kernel.threadgroup_memory / 1024:.1f} KiB threadgroup memory, "
            f"{kernel.cycles_per_token:.0f} issue cycles per token per threadgroup"
        )
        for gpu in GPUS:
            seconds, per_core, rounds = per_token_seconds(kernel, gpu)
            print(
                f"  {gpu.name:<22} {seconds * 1e6:6.2f} us per token per layer "
                f"({per_core} threadgroup(s) per core at once, {rounds} round(s)); "
                f"the {GDN_LAYERS} layers' scans alone cap prefill at "
                f"{1 / (seconds * GDN_LAYERS):9,.0f} tok/s"
            )


if __name__ == "__main__":
    main()
