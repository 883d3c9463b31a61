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
simulated threads of a threadgroup are started and resumed; running tests under all three
exposes missing barriers. Kernel faults (divergent barriers, threadgroup memory over 32 KiB,
reads of unbound buffers, fiber stack overflow) raise :class:`KernelError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lily import _native

KernelError = _native.KernelError
Buffer = _native.Buffer
Kernel = _native.Kernel

LANE_ORDERS = ("forward", "reverse", "random")
# Metal's limit for setBytes parameter blocks.
MAX_INLINE_BYTES = 4096

Size = int | Sequence[int]


def _size3(value: Size, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 non-negative ints, got {value!r}")
    return (*dims, *(1,) * (3 - len(dims)))  # type: ignore[return-value]


class Graph:
    """Dispatches in order, cut into levels by barriers; built once, run many times."""

    def __init__(self) -> None:
        self._graph = _native.Graph()

    def dispatch(
        self,
        kernel: Kernel,
        *,
        threadgroups: Size,
        threads: Size,
        buffers: Mapping[int, Buffer | tuple[Buffer, int]] | None = None,
        bytes: Mapping[int, bytes] | None = None,  # noqa: A002 - the documented keyword
        threadgroup_memory: Mapping[int, int] | None = None,
    ) -> None:
        """Record one dispatch: `threadgroups` x `threads` simulated threads.

        `buffers` binds ``[[buffer(n)]]`` to a buffer or ``(buffer, byte_offset)``; `bytes`
        binds ``[[buffer(n)]]`` to a small constant block copied now; `threadgroup_memory`
        sizes ``[[threadgroup(n)]]`` arguments in bytes (a multiple of 16, as Metal requires).
        """
        bound = []
        for index, binding in (buffers or {}).items():
            buffer, offset = binding if isinstance(binding, tuple) else (binding, 0)
            if not 0 <= offset <= buffer.size:
                raise ValueError(
                    f"buffer {index}: offset {offset} outside a {buffer.size}-byte buffer"
                )
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
        self._graph.dispatch(
            kernel,
            _size3(threadgroups, "threadgroups"),
            _size3(threads, "threads"),
            bound,
            inline,
            memory,
        )

    def barrier(self) -> None:
        """Every later dispatch sees every write of the earlier ones."""
        self._graph.barrier()

    @property
    def dispatch_count(self) -> int:
        return self._graph.dispatch_count

    @property
    def barrier_count(self) -> int:
        return self._graph.barrier_count


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

    def wrap(self, array: np.ndarray) -> Buffer:
        """The array's memory as a buffer, without copying; the array is kept alive.

        Read-only arrays (and read-only memory maps) give buffers kernels must not write.
        """
        if not isinstance(array, np.ndarray):
            raise TypeError(f"wrap takes a numpy array, got {type(array).__name__}")
        if not array.flags.c_contiguous:
            raise ValueError("wrap needs a C-contiguous array")
        address = array.__array_interface__["data"][0]
        return self._native.wrap(address, array.nbytes, bool(array.flags.writeable), array)

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

    def submit(self, graph: Graph) -> int:
        """Start running `graph` (graphs run in submission order); returns a ticket."""
        return self._native.submit(graph._graph)

    def wait(self, ticket: int) -> None:
        """Wait for the graph of `ticket` and every earlier one; raises its KernelError."""
        self._native.wait(ticket)


def open_device(
    kind: str = "sim",
    *,
    lane_order: str = "forward",
    seed: int = 0,
    workers: int | None = None,
    execute: bool = True,
) -> Device:
    """Open a device: ``sim`` (anywhere) or ``metal`` (macOS builds on Apple silicon).

    `lane_order`, `seed` and `workers` (OS threads, default one per core) configure the sim;
    ``execute=False`` makes it check and retire graphs without running kernels, to time the
    host's side of a step alone.
    """
    if kind == "metal":
        return _open_metal()
    if kind != "sim":
        raise ValueError(f"unknown device {kind!r}; this build has: {', '.join(available())}")
    if lane_order not in LANE_ORDERS:
        raise ValueError(f"lane_order must be one of {LANE_ORDERS}, got {lane_order!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    return Device(_native.open_sim_device(lane_order, seed, workers or 0, execute))


def metal_info() -> dict | None:
    """The Metal GPU as the device sees it (name, GPU family, whether Lily's kernels can run,
    recommended working set, ...), or None in a build without the metal device."""
    return _native.metal_device_info() if hasattr(_native, "metal_device_info") else None


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
    # A metallib built with the wheel is used when present; otherwise the .metal sources are
    # compiled at first use: shipped in the package, or metal/ of a source checkout.
    package = Path(__file__).resolve().parent
    sources = next(
        (d for d in (package / "metal", package.parents[1] / "metal") if d.is_dir()),
        package / "metal",
    )
    return Device(_native.open_metal_device(str(package / "lily.metallib"), str(sources)))
