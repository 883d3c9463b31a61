"""Devices: where Lily's kernels run. The only module that touches ``lily._native`` devices.

A device allocates or wraps memory, looks kernels up by their ``[[host_name]]`` and runs graphs
of dispatches recorded once and replayed::

    dev = open_device("sim", lane_order="reverse")
    x = dev.wrap(np.arange(4, dtype=np.float32))
    g = Graph()
    g.dispatch(dev.kernel("my_kernel"), threadgroups=1, threads=4, buffers={0: x})
    dev.run(g)

The ``sim`` device runs the ``metal/*.metal`` kernels on the CPU, one fiber per simulated
thread. Its lane order (``forward``, ``reverse`` or seeded ``random``) is the order in which the
simulated threads of a threadgroup are started and resumed, and how its SIMD-groups interleave;
running tests under all three exposes missing barriers. Kernel faults (divergent barriers,
threadgroup memory over 32 KiB, reads of unbound buffers, fiber stack overflow) raise
:class:`KernelError`. Opened with ``check=True`` (or with ``LILY_SIM_CHECK=1`` in the
environment) it runs a build of the kernels that checks every memory access: out of bounds of a
binding, threadgroup-memory races between SIMD-groups, reads of memory nothing wrote (see
docs/sim.md); ``count_traffic=True`` only counts the bytes each dispatch reads and writes
(:meth:`Device.traffic`). Every sim device counts the simdgroup-matrix products each kernel
executes, by operand type (:meth:`Device.matrix_products`).
"""

from __future__ import annotations

import difflib
import mmap
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lily import _native

KernelError = _native.KernelError
Buffer = _native.Buffer
Kernel = _native.Kernel


class UnsupportedGPUError(RuntimeError):
    """The Mac's GPU cannot run Lily's kernels (not Apple7 family with Metal 3, e.g. the
    paravirtual GPU of a virtual machine). Any other failure to open the metal device is a plain
    RuntimeError: only this one means "this machine cannot", not "something is broken"."""


LANE_ORDERS = ("forward", "reverse", "random")
# Metal's limit for setBytes parameter blocks.
MAX_INLINE_BYTES = 4096

Size = int | Sequence[int]
BufferBinding = Buffer | tuple[Buffer, int] | tuple[Buffer, int, int]
# Set to 1 to open every sim device in the checking mode (open_device's `check` default).
CHECK_ENV = "LILY_SIM_CHECK"


@dataclass(frozen=True)
class BindingTraffic:
    """Distinct bytes one dispatch read and wrote through one buffer binding."""

    buffer: Buffer
    offset: int
    extent: int  # bytes the binding could touch
    read: int
    written: int


@dataclass(frozen=True)
class DispatchTraffic:
    kernel: str
    buffers: dict[int, BindingTraffic]  # by [[buffer(n)]] index

    @property
    def read(self) -> int:
        return sum(b.read for b in self.buffers.values())

    @property
    def written(self) -> int:
        return sum(b.written for b in self.buffers.values())


@dataclass(frozen=True)
class MatrixProducts:
    """8x8x8 simdgroup-matrix products, by the operand type that sets their rate on a GPU: `half`
    or `bfloat` when both operands are, `fp32` otherwise; `tensor_op` counts Metal 4 tensor-op
    matmuls in 8x8x8 units (M N K / 512 per matmul2d run)."""

    fp32: int = 0
    half: int = 0
    bfloat: int = 0
    tensor_op: int = 0

    def __add__(self, other: MatrixProducts) -> MatrixProducts:
        return MatrixProducts(
            self.fp32 + other.fp32,
            self.half + other.half,
            self.bfloat + other.bfloat,
            self.tensor_op + other.tensor_op,
        )

    @property
    def total(self) -> int:
        return self.fp32 + self.half + self.bfloat + self.tensor_op


def _size3(value: Size, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 non-negative ints, got {value!r}")
    return (*dims, *(1,) * (3 - len(dims)))  # type: ignore[return-value]


@dataclass(frozen=True)
class DispatchRecord:
    """What a graph recorded of one dispatch, for reports (the benchmarks' per-kernel tables)."""

    kernel: str
    threadgroups: tuple[int, int, int]
    threads: tuple[int, int, int]
    level: int  # barriers recorded before it


class Graph:
    """Dispatches in order, cut into levels by barriers; built once, run many times.

    Each command buffer is also recorded as a graph of its own (`command_buffers`), so that a
    caller can submit a long pass piece by piece and act between the pieces (report progress,
    stop when asked) instead of waiting for the whole pass."""

    def __init__(self) -> None:
        self._graph = _native.Graph()
        self.dispatches: list[DispatchRecord] = []
        self._pieces = [_native.Graph()]

    def dispatch(
        self,
        kernel: Kernel,
        *,
        threadgroups: Size,
        threads: Size,
        buffers: Mapping[int, BufferBinding] | None = None,
        bytes: Mapping[int, bytes] | None = None,  # noqa: A002 - the documented keyword
        threadgroup_memory: Mapping[int, int] | None = None,
    ) -> None:
        """Record one dispatch: `threadgroups` x `threads` simulated threads.

        `buffers` binds ``[[buffer(n)]]`` to a buffer, ``(buffer, byte_offset)`` or
        ``(buffer, byte_offset, length)``: the length, when given, is how many bytes the kernel
        may touch (the checking sim holds it to that); `bytes` binds ``[[buffer(n)]]`` to a small
        constant block copied now; `threadgroup_memory` sizes ``[[threadgroup(n)]]`` arguments in
        bytes (a multiple of 16, as Metal requires).
        """
        bound = []
        lengths = []
        for index, binding in (buffers or {}).items():
            if not isinstance(binding, tuple):
                binding = (binding, 0)
            buffer, offset = binding[0], binding[1]
            if not 0 <= offset <= buffer.size:
                raise ValueError(
                    f"buffer {index}: offset {offset} outside a {buffer.size}-byte buffer"
                )
            if len(binding) == 3:
                length = binding[2]
                if not 0 <= length <= buffer.size - offset:
                    raise ValueError(
                        f"buffer {index}: {length} bytes at offset {offset} do not fit a "
                        f"{buffer.size}-byte buffer"
                    )
                lengths.append((index, length))
            bound.append((index, buffer, offset))
        inline = []
        for index, data in (bytes or {}).items():
            data = memoryview(data).tobytes()
            if len(data) > MAX_INLINE_BYTES:
                raise ValueError(f"bytes {index}: {len(data)} bytes, more than {MAX_INLINE_BYTES}")
            inline.append((index, data))
        if {b[0] for b in bound} & {b[0] for b in inline}:
            raise ValueError("an index is bound both to a buffer and to bytes")
        memory = []
        for index, size in (threadgroup_memory or {}).items():
            if size % 16:
                raise ValueError(f"threadgroup_memory {index}: {size} is not a multiple of 16")
            memory.append((index, size))
        grid, group = _size3(threadgroups, "threadgroups"), _size3(threads, "threads")
        self._graph.dispatch(kernel, grid, group, bound, inline, memory, lengths)
        self._pieces[-1].dispatch(kernel, grid, group, bound, inline, memory, lengths)
        self.dispatches.append(DispatchRecord(kernel.name, grid, group, self.barrier_count))

    def barrier(self) -> None:
        """Every later dispatch sees every write of the earlier ones."""
        self._graph.barrier()
        self._pieces[-1].barrier()

    def end_command_buffer(self) -> None:
        """A barrier after which the metal device starts a new command buffer, so that no one
        command buffer of a long pass runs long enough to trip macOS's GPU watchdog."""
        self._graph.end_command_buffer()
        if self._pieces[-1].dispatch_count:
            self._pieces.append(_native.Graph())

    @property
    def command_buffers(self) -> list[CommandBuffer]:
        """The graph's command buffers in order, each submittable alone: submitted one after
        the other they run what the whole graph does."""
        return [CommandBuffer(piece) for piece in self._pieces if piece.dispatch_count]

    @property
    def command_buffer_count(self) -> int:
        return self._graph.command_buffer_count

    @property
    def dispatch_count(self) -> int:
        return self._graph.dispatch_count

    @property
    def barrier_count(self) -> int:
        return self._graph.barrier_count


@dataclass(frozen=True)
class CommandBuffer:
    """One command buffer of a `Graph`, for `Device.submit`."""

    _graph: _native.Graph


class Device:
    """A device opened with :func:`open_device`."""

    def __init__(self, native: _native.Device) -> None:
        self._native = native

    @property
    def name(self) -> str:
        return self._native.name

    def alloc(self, nbytes: int) -> Buffer:
        """A zero-initialised buffer of `nbytes` bytes."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        return self._native.alloc(nbytes)

    def scratch(self, nbytes: int) -> Buffer:
        """A buffer whose contents are undefined until written: memory kernels write before
        they read. Zeroed like :meth:`alloc` except on the checking sim, which fills it with NaN
        poison and raises KernelError where a kernel reads a byte that nothing wrote (taking a
        ``numpy()`` view counts as writing all of it)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        return self._native.alloc_scratch(nbytes)

    def wrap(self, array: np.ndarray, regions: Iterable[tuple[int, int]] | None = None) -> Buffer:
        """The array's memory as a buffer; the array is kept alive.

        An array inside a memory-mapped file (a checkpoint shard) is used in place. Any other
        array (numpy's own memory, from malloc) the metal device mirrors, since Metal wraps only
        whole-page VM allocations without copying: the array is copied to the device when a
        graph binding it is submitted (unless an earlier such graph is still running) and, if
        writable, the kernels' writes are copied back once the graph has finished, so the array
        shows them after ``run``/``wait`` as before. Do not write such an array while a graph
        that binds it runs. The sim uses every array in place unless opened with
        ``mirror_wrapped=True``, which mirrors them as the metal device does.
        Read-only arrays (and read-only memory maps) give buffers kernels must not write.
        `regions`: ``(byte_offset, nbytes)`` of tensors inside the array (a checkpoint shard's):
        the checking sim holds a binding that starts inside one to that tensor's end.
        """
        if not isinstance(array, np.ndarray):
            raise TypeError(f"wrap takes a numpy array, got {type(array).__name__}")
        if not array.flags.c_contiguous:
            raise ValueError("wrap needs a C-contiguous array")
        address = array.__array_interface__["data"][0]
        buffer = self._native.wrap(
            address, array.nbytes, bool(array.flags.writeable), array, in_mapped_file(array)
        )
        for offset, nbytes in regions or ():
            if offset < 0 or nbytes < 0 or offset + nbytes > array.nbytes:
                raise ValueError(f"region {nbytes} bytes at {offset} outside the array")
            buffer.add_region(offset, nbytes)
        return buffer

    def kernel(self, host_name: str) -> Kernel:
        """The kernel registered under `host_name`."""
        try:
            return self._native.kernel(host_name)
        except ValueError:
            close = difflib.get_close_matches(host_name, self.kernel_names(), n=5)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise ValueError(
                f"unknown kernel {host_name!r} on the {self.name} device{hint}"
            ) from None

    def kernel_names(self) -> list[str]:
        return sorted(self._native.kernel_names())

    def run(self, graph: Graph) -> None:
        """Run `graph` and wait for it; raises KernelError if a kernel failed."""
        self._native.run(graph._graph)

    def submit(self, graph: Graph | CommandBuffer) -> int:
        """Start running `graph` (graphs run in submission order); returns a ticket."""
        return self._native.submit(graph._graph)

    def wait(self, ticket: int) -> None:
        """Wait for the graph of `ticket` and every earlier one; raises its KernelError."""
        self._native.wait(ticket)

    def traffic(self) -> list[DispatchTraffic]:
        """The distinct bytes every dispatch run since the last call read and wrote, per buffer
        binding, in run order; only a sim opened with ``check`` or ``count_traffic`` counts
        (elsewhere this is empty)."""
        return [
            DispatchTraffic(
                kernel,
                {
                    index: BindingTraffic(buffer, offset, extent, read, written)
                    for index, buffer, offset, extent, read, written in bindings
                },
            )
            for kernel, bindings in self._native.take_traffic()
        ]

    @property
    def tensor_ops(self) -> bool:
        """Whether the prefill GEMMs and a bf16 cache's chunk attention run the Metal 4
        tensor-op kernels (`metal/quantized_gemm_tensor_ops.metal`,
        `metal/attention_tensor_ops.metal`): on a Mac with macOS 26.2 and an M5-class GPU whose
        compile of them succeeded, or on a sim opened with ``tensor_ops=True``."""
        return bool(self._native.gemm_path[0])

    @property
    def gemm_path_reason(self) -> str:
        """Why the prefill GEMMs run the kernels they do (:attr:`tensor_ops`)."""
        return str(self._native.gemm_path[1])

    def matrix_products(self) -> dict[str, MatrixProducts] | None:
        """The simdgroup-matrix products each kernel executed since the last call, by kernel
        name (kernels that executed none are left out). The sim always counts them; None on a
        device that cannot (Metal: the GPU does not report them)."""
        counted = self._native.take_matrix_products()
        if counted is None:
            return None
        return {kernel: MatrixProducts(*counts) for kernel, *counts in counted}


def in_mapped_file(array: np.ndarray) -> bool:
    """Whether the array's memory lies in a memory-mapped file (an ``mmap.mmap``, which
    ``np.memmap`` and the checkpoint's shards use), which the metal device wraps in place."""
    owner: object = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    return isinstance(owner, mmap.mmap)


def open_device(
    kind: str = "sim",
    *,
    lane_order: str = "forward",
    seed: int = 0,
    workers: int | None = None,
    execute: bool = True,
    check: bool | None = None,
    count_traffic: bool = False,
    tensor_ops: bool = False,
    matrix_lanes: Sequence[int] | None = None,
    mirror_wrapped: bool = False,
) -> Device:
    """Open a device: ``sim`` (anywhere) or ``metal`` (macOS builds on Apple silicon; on a GPU
    the kernels cannot run on it raises :class:`UnsupportedGPUError` with the reason).

    `lane_order`, `seed` and `workers` (OS threads, default one per core) configure the sim;
    ``execute=False`` makes it check and retire graphs without running kernels, to time the
    host's side of a step alone. ``check=True`` runs the checked kernel build (several times
    slower): out-of-bounds accesses, threadgroup races and reads of unwritten memory raise
    KernelError, and traffic is counted; the default comes from ``LILY_SIM_CHECK``.
    ``count_traffic=True`` only counts traffic (:meth:`Device.traffic`), with bindings used in
    place, which suits a full-size checkpoint. ``tensor_ops=True`` makes the prefill GEMMs (and
    chunk attention over a bf16 cache) run the Metal 4 tensor-op kernels, as on an M5, on the
    sim's emulation of them (:attr:`Device.tensor_ops`); the metal device decides that itself.
    `matrix_lanes` makes the sim play a GPU whose simdgroup_matrix layout differs from Apple's:
    its lane l holds the elements Apple's layout gives lane ``matrix_lanes[l]`` (a permutation
    of 0..31), which the lane-layout self-test (lily.kernels.lane_layout) must catch.
    ``mirror_wrapped=True`` makes the sim mirror wrapped arrays that are not in a memory-mapped
    file as the metal device does (:meth:`Device.wrap`), instead of using them in place.
    """
    if kind == "metal":
        return _open_metal()
    if kind != "sim":
        raise ValueError(f"unknown device {kind!r}; this build has: {', '.join(available())}")
    if lane_order not in LANE_ORDERS:
        raise ValueError(f"lane_order must be one of {LANE_ORDERS}, got {lane_order!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if check is None:
        check = os.environ.get(CHECK_ENV, "") not in ("", "0")
    mode = "check" if check else "count" if count_traffic else "off"
    lanes = list(matrix_lanes or ())
    if lanes and sorted(lanes) != list(range(32)):
        raise ValueError(f"matrix_lanes must be a permutation of 0..31, got {lanes}")
    return Device(
        _native.open_sim_device(
            lane_order, seed, workers or 0, execute, mode, tensor_ops, lanes, mirror_wrapped
        )
    )


def metal_info() -> dict | None:
    """The Metal GPU as the device sees it (name, GPU family, whether Lily's kernels can run,
    recommended working set, ...), or None in a build without the metal device."""
    return _native.metal_device_info() if hasattr(_native, "metal_device_info") else None


def physical_memory() -> int | None:
    """This machine's RAM in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(kind: str, nbytes: int) -> None:
    """Refuse, before anything is allocated, a run that needs more GPU memory than Metal
    recommends on this Mac (with the `iogpu.wired_limit_mb` advice). The sim uses host memory
    and has no such limit."""
    if kind == "metal":
        try:
            _native.metal_check_memory(nbytes)
        except RuntimeError as e:
            raise MemoryError(str(e)) from None


def available() -> list[str]:
    """The device kinds this build of Lily can open."""
    return ["sim", "metal"] if hasattr(_native, "open_metal_device") else ["sim"]


def _open_metal() -> Device:
    if not hasattr(_native, "open_metal_device"):
        raise ValueError("the metal device exists only in macOS builds; this build has: sim")
    info = _native.metal_device_info()
    if not info["supported"]:
        raise UnsupportedGPUError(f"the metal device cannot run here: {info['unsupported_reason']}")
    # A metallib built with the wheel is used when present; otherwise the .metal sources are
    # compiled at first use: shipped in the package, or metal/ of a source checkout.
    package = Path(__file__).resolve().parent
    sources = next(
        (d for d in (package / "metal", package.parents[1] / "metal") if d.is_dir()),
        package / "metal",
    )
    return Device(_native.open_metal_device(str(package / "lily.metallib"), str(sources)))
