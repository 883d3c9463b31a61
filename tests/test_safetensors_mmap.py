"""The zero-copy safetensors reader: values, views over the map, and one error per defect."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from lily.checkpoint.safetensors_mmap import (
    INDEX_FILE,
    CheckpointError,
    Shard,
    open_safetensors,
    open_safetensors_dir,
    write_aligned_copy,
)


def write_raw(path: Path, entries: dict[str, dict], data: bytes, pad_to: int = 16) -> int:
    """A safetensors file from a literal header; returns the data section's file offset."""
    header = json.dumps(entries).encode()
    header += b" " * (-(8 + len(header)) % pad_to)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return 8 + len(header)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture
def sample(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.normal(size=(3, 5)).astype(np.float32),
        "f16": rng.normal(size=(8,)).astype(np.float16),
        "f64": rng.normal(size=(2, 2)).astype(np.float64),
        "u32": rng.integers(0, 2**32, (4, 4), dtype=np.uint32),
        "i32": rng.integers(-100, 100, (16,), dtype=np.int32),
        "i64": rng.integers(-100, 100, (2,), dtype=np.int64),
        "u8": rng.integers(0, 255, (32,), dtype=np.uint8),
        "i8": rng.integers(-100, 100, (16,), dtype=np.int8),
        "bool": rng.integers(0, 2, (16,)).astype(np.bool_),
        "scalar": np.array(3.5, dtype=np.float32),
    }
    path = tmp_path / "sample.safetensors"
    save_file(arrays, str(path), metadata={"format": "test"})
    return path, arrays


def test_values_dtypes_and_metadata_round_trip(sample):
    path, arrays = sample
    shard = Shard(path, alignment=1)
    assert shard.metadata == {"format": "test"}
    assert set(shard.tensors) == set(arrays)
    for name, expected in arrays.items():
        got = shard.array(name)
        assert got.dtype == expected.dtype, name
        assert got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected)


def test_bf16_is_exposed_as_raw_bits(tmp_path):
    values = np.array([1.0, -2.5, 0.15625, 2.0**100], dtype=np.float32)
    bits = bf16_bits(values)
    path = tmp_path / "bf16.safetensors"
    write_raw(path, {"x": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, bits.tobytes())
    got = Shard(path).array("x")
    assert got.dtype == np.uint16
    np.testing.assert_array_equal((got.astype(np.uint32) << 16).view(np.float32), values)


def test_views_are_read_only_and_share_the_map(sample):
    path, arrays = sample
    shard = Shard(path, alignment=1)
    for name in arrays:
        view = shard.array(name)
        assert not view.flags.writeable
        assert np.shares_memory(view, shard.buffer), name
    with pytest.raises(ValueError, match="read-only"):
        shard.array("f32")[0, 0] = 1.0
    # The base chain ends at the memory map itself: nothing was copied out of it.
    base = shard.array("u32")
    while isinstance(base, np.ndarray):
        base = base.base
    assert memoryview(base).obj is shard.mmap


def test_locations_give_absolute_file_offsets(sample):
    path, arrays = sample
    raw = path.read_bytes()
    shard = Shard(path, alignment=1)
    for name, expected in arrays.items():
        info = shard.tensors[name]
        assert info.shard == path
        assert info.nbytes == expected.nbytes
        assert raw[info.offset : info.offset + info.nbytes] == expected.tobytes()


def test_missing_shard(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing shard file .*absent\.safetensors"):
        Shard(tmp_path / "absent.safetensors")


def test_file_shorter_than_header_length(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match=r"tiny\.safetensors: truncated file"):
        Shard(path)


def test_truncated_data(tmp_path):
    path = tmp_path / "cut.safetensors"
    entries = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]},
    }
    write_raw(path, entries, bytes(48))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: truncated file.*'b'"):
        Shard(path)


def test_header_length_beyond_file(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match=r"long\.safetensors: header length 1000 goes beyond"):
        Shard(path)


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_invalid_header_json(tmp_path, header):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: invalid header JSON"):
        Shard(path)


def test_unsupported_dtype_names_the_tensor(tmp_path):
    path = tmp_path / "dtype.safetensors"
    write_raw(path, {"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"tensor 'w': unsupported dtype 'C64'"):
        Shard(path)


def test_offsets_out_of_range(tmp_path):
    path = tmp_path / "range.safetensors"
    entries = {
        "a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
        "far": {"dtype": "U8", "shape": [16], "data_offsets": [4096, 4112]},
    }
    write_raw(path, entries, bytes(32))
    with pytest.raises(
        CheckpointError, match=r"tensor 'far' data_offsets \[4096, 4112\] out of range"
    ):
        Shard(path)


def test_reversed_offsets(tmp_path):
    path = tmp_path / "reversed.safetensors"
    write_raw(path, {"r": {"dtype": "U8", "shape": [0], "data_offsets": [16, 0]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"tensor 'r' has out-of-range data_offsets"):
        Shard(path)


def test_overlapping_tensors(tmp_path):
    path = tmp_path / "overlap.safetensors"
    entries = {
        "first": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
        "second": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
    }
    write_raw(path, entries, bytes(32))
    with pytest.raises(CheckpointError, match=r"tensors 'first' and 'second' overlap"):
        Shard(path)


def test_byte_span_must_match_shape_and_dtype(tmp_path):
    path = tmp_path / "span.safetensors"
    write_raw(path, {"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 32]}}, bytes(48))
    with pytest.raises(
        CheckpointError, match=r"tensor 'w' spans 32 bytes but F32 \[3, 4\] needs 48"
    ):
        Shard(path)


def test_misaligned_tensor_is_named(tmp_path):
    path = tmp_path / "misaligned.safetensors"
    entries = {
        "ok": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
        "odd": {"dtype": "U8", "shape": [8], "data_offsets": [20, 28]},
    }
    start = write_raw(path, entries, bytes(32))
    with pytest.raises(
        CheckpointError, match=rf"tensor 'odd' starts at byte {start + 20}, not aligned"
    ):
        Shard(path)
    assert Shard(path, alignment=4).array("odd").shape == (8,)


def test_aligned_copy_of_an_unpadded_file(tmp_path):
    # mlx-style: no header padding and tensors of sizes that are not multiples of 16.
    rng = np.random.default_rng(1)
    arrays = {
        "a": rng.normal(size=3).astype(np.float32),
        "b": rng.integers(0, 9, 5).astype(np.uint8),
    }
    entries = {
        "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
        "b": {"dtype": "U8", "shape": [5], "data_offsets": [12, 17]},
        "__metadata__": {"format": "mlx"},
    }
    source = tmp_path / "packed.safetensors"
    write_raw(source, entries, arrays["a"].tobytes() + arrays["b"].tobytes(), pad_to=1)
    with pytest.raises(CheckpointError, match="not aligned"):
        Shard(source)
    copy = tmp_path / "aligned.safetensors"
    write_aligned_copy(source, copy)
    shard = Shard(copy)
    assert shard.metadata == {"format": "mlx"}
    for name, expected in arrays.items():
        assert shard.tensors[name].offset % 16 == 0
        np.testing.assert_array_equal(shard.array(name), expected)


def _save_two_shards(directory: Path) -> dict[str, str]:
    save_file({"a": np.arange(4, dtype=np.float32)}, str(directory / "one.safetensors"))
    save_file({"b": np.arange(8, dtype=np.int32)}, str(directory / "two.safetensors"))
    return {"a": "one.safetensors", "b": "two.safetensors"}


def test_directory_with_and_without_index(tmp_path):
    weight_map = _save_two_shards(tmp_path)
    files = open_safetensors_dir(tmp_path, alignment=8)
    assert sorted(files) == ["a", "b"]
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    files = open_safetensors_dir(tmp_path, alignment=8)
    np.testing.assert_array_equal(files["b"], np.arange(8))
    assert files.info("b").shard == tmp_path / "two.safetensors"
    assert set(files.shards) == {tmp_path / "one.safetensors", tmp_path / "two.safetensors"}


def test_index_naming_a_missing_shard(tmp_path):
    weight_map = _save_two_shards(tmp_path)
    weight_map["c"] = "three.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"missing shard file .*three\.safetensors"):
        open_safetensors_dir(tmp_path, alignment=8)


def test_index_disagreeing_with_the_shards(tmp_path):
    weight_map = _save_two_shards(tmp_path)
    weight_map["a"] = "two.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"tensor 'a' is listed in two\.safetensors"):
        open_safetensors_dir(tmp_path, alignment=8)


def test_tensor_in_two_shards(tmp_path):
    save_file({"a": np.zeros(4, np.float32)}, str(tmp_path / "one.safetensors"))
    save_file({"a": np.ones(4, np.float32)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'a' appears in both"):
        open_safetensors(sorted(tmp_path.glob("*.safetensors")), alignment=8)


RSS_PROBE = textwrap.dedent(
    """
    import os, sys
    from lily.checkpoint.safetensors_mmap import Shard

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    shard = Shard(sys.argv[1])
    views = [shard.array(name) for name in shard.tensors]
    opened = rss()
    total = sum(float(v[::4096].sum()) + float(v[-1].sum()) for v in views)  # touch every page
    total += sum(float(v.sum()) for v in views)
    touched = rss()
    print(opened - before, touched - before)
    """
)


def test_opening_does_not_make_the_weights_resident(tmp_path):
    # ~200 MB of real (non-sparse) data in 8 tensors.
    path = tmp_path / "big.safetensors"
    rows, cols, count = 6400, 1024, 8
    nbytes = rows * cols * 4
    entries = {
        f"w{i}": {
            "dtype": "F32",
            "shape": [rows, cols],
            "data_offsets": [i * nbytes, (i + 1) * nbytes],
        }
        for i in range(count)
    }
    block = np.full((rows, cols), 0.5, dtype=np.float32).tobytes()
    header = json.dumps(entries).encode()
    header += b" " * (-(8 + len(header)) % 16)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for _ in range(count):
            f.write(block)
    result = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(path)], capture_output=True, text=True, check=True
    )
    opened, touched = (int(x) for x in result.stdout.split())
    weights = count * nbytes
    assert opened < 16 << 20, f"opening grew RSS by {opened} bytes"
    # The probe can see the weights when they really are read: the measurement is not blind.
    assert touched > 0.9 * weights
