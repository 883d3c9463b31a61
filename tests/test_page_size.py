"""The sim on Apple silicon's 16 KiB pages, from Linux: an LD_PRELOAD shim (xnu_pages_shim.c)
reports 16 KiB pages, places mappings on 16 KiB boundaries and refuses mprotect, madvise and
munmap at addresses off them with EINVAL, as XNU does. A child process under the shim starts
fibers, maps device memory (plain and checked sim) and generates on a tiny checkpoint; its
tokens must equal the same run's without the shim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.engine.engine import DeviceEngine

SHIM_SOURCE = Path(__file__).with_name("xnu_pages_shim.c")
XNU_PAGE = 16384
PROMPT = [1, 5, 9, 2, 7, 3, 8]
NEW_TOKENS = 4

CHILD = f"""
import ctypes, errno, mmap, os, struct, sys
import numpy as np

# The shim is in force: the page size, the placement of a mapping, an mprotect XNU refuses.
assert os.sysconf("SC_PAGESIZE") == {XNU_PAGE}, os.sysconf("SC_PAGESIZE")
region = mmap.mmap(-1, 3 * {XNU_PAGE})
start = ctypes.addressof(ctypes.c_char.from_buffer(region))
assert start % {XNU_PAGE} == 0, hex(start)
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(start + 4096, 4096, mmap.PROT_READ) == -1
assert ctypes.get_errno() == errno.EINVAL
print("shim active", flush=True)

from lily.checkpoint.loader import load_checkpoint
from lily.device import Graph, open_device
from lily.engine.engine import DeviceEngine

for check in (False, True):
    device = open_device("sim", workers=2, check=check)
    x = np.arange(100, dtype=np.float32)
    y = device.alloc(400)
    graph = Graph()
    graph.dispatch(device.kernel("test_axpy"), threadgroups=4, threads=32,
                   buffers={{0: device.wrap(x), 1: y}}, bytes={{2: struct.pack("<fI", 2.0, 100)}})
    device.run(graph)
    assert (y.numpy().view(np.float32) == 2 * x).all(), "check" if check else "plain"
print("kernels ran", flush=True)

checkpoint = load_checkpoint(sys.argv[1])
engine = DeviceEngine(checkpoint, open_device("sim", workers=2), 32, checkpoint.config.vocab_size)
tokens = [t.id for t in engine.generate({PROMPT}, {NEW_TOKENS})]
engine.close()
print("tokens", *tokens, flush=True)
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    library = tmp_path_factory.mktemp("shim") / "xnu_pages_shim.so"
    compiler = os.environ.get("CC", "cc")
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(SHIM_SOURCE), "-ldl"],
        check=True,
    )
    return library


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shim interposes glibc")
def test_sim_runs_under_16k_pages(shim: Path) -> None:
    path = tiny_checkpoint("small")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        env={**os.environ, "LD_PRELOAD": str(shim)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "shim active" in child.stdout, child.stderr
    assert child.returncode == 0, child.stdout + child.stderr
    checkpoint = load_checkpoint(path)
    engine = DeviceEngine(
        checkpoint, open_device("sim", workers=2), 32, checkpoint.config.vocab_size
    )
    expected = [t.id for t in engine.generate(PROMPT, NEW_TOKENS)]
    engine.close()
    assert f"tokens {' '.join(map(str, expected))}" in child.stdout
