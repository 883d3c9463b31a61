"""Zero-copy safetensors reading: every tensor is a read-only numpy view over a memory map.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (tensor name ->
dtype, shape, data_offsets relative to the end of the header; plus an optional string map
`__metadata__`), then the raw little-endian tensor bytes. Each shard is mapped once, read-only;
nothing here reads tensor data, so opening a 20 GB checkpoint costs page-table entries, not RAM.

numpy has no bfloat16, so BF16 tensors are exposed as `np.uint16` holding the raw bits (the upper
half of the float32 with the same value: `(bits.astype(np.uint32) << 16).view(np.float32)`).
FP8 tensors are exposed as raw `np.uint8` for the same reason.

The device binds weights by absolute byte offset into a whole-shard buffer, so every tensor's
data must start on a 16-byte boundary of its file, and each `Shard` keeps its map reachable.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lily.checkpoint.files import checkpoint_file, open_regular, read_json_file
from lily.errors import CheckpointError

# safetensors dtype code -> numpy dtype of the exposed view (raw bits where numpy lacks the type).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
}

DATA_ALIGNMENT = 16
INDEX_FILE = "model.safetensors.index.json"
SHARD_KIND = "shard file"
_HEADER_LENGTH_BYTES = 8
# Far above any real header (the 19.5 GB checkpoint's are well under 1 MB); guards against
# mapping garbage as JSON.
_MAX_HEADER_BYTES = 100 << 20
# The largest gap between consecutive tensors that still counts as padding (see
# write_aligned_copy); used only to tell a cut-off file from offsets pointing nowhere.
_MAX_PADDING = 64


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard and absolute byte range in that file."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16", "U32"
    shape: tuple[int, ...]
    shard: Path
    offset: int  # absolute byte offset of the first element in the shard file
    nbytes: int


class Shard:
    """One safetensors file, mapped read-only once. `buffer` spans the whole file."""

    def __init__(self, path: str | Path, alignment: int = DATA_ALIGNMENT) -> None:
        self.path = path = Path(path)
        if not path.exists():
            raise CheckpointError(f"missing shard file {path}")
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER_LENGTH_BYTES:
                raise CheckpointError(
                    f"{path}: truncated file ({size} bytes, shorter than the header length)"
                )
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # A read-only map yields a read-only numpy buffer; every tensor view inherits that.
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self.metadata, self.tensors = _parse_header(path, self.buffer, alignment)
        self._views: dict[str, np.ndarray] = {}

    @property
    def mmap(self) -> mmap.mmap:
        return self._mmap

    @property
    def size(self) -> int:
        return self.buffer.size

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only view over the map (created on first use, then cached)."""
        view = self._views.get(name)
        if view is None:
            info = self.tensors[name]
            dtype = NUMPY_DTYPES[info.dtype]
            raw = self.buffer[info.offset : info.offset + info.nbytes]
            view = raw.view(dtype).reshape(info.shape)
            self._views[name] = view
        return view


def _parse_header(
    path: Path, buffer: np.ndarray, alignment: int
) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    file_size = buffer.size
    (header_len,) = struct.unpack("<Q", buffer[:_HEADER_LENGTH_BYTES].tobytes())
    data_start = _HEADER_LENGTH_BYTES + header_len
    if header_len > _MAX_HEADER_BYTES or data_start > file_size:
        raise CheckpointError(
            f"{path}: header length {header_len} goes beyond the file ({file_size} bytes): "
            "truncated or not a safetensors file"
        )
    try:
        header = json.loads(buffer[_HEADER_LENGTH_BYTES:data_start].tobytes().decode("utf-8"))
    except ValueError as e:  # not UTF-8, not JSON, or an integer of too many digits
        raise CheckpointError(f"{path}: invalid header JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: invalid header JSON (nested too deeply)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: invalid header JSON (not an object)")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: invalid header JSON (__metadata__ is not an object)")
    spans = {name: _parse_entry(path, name, entry) for name, entry in header.items()}

    data_size = file_size - data_start
    _check_ranges(path, spans, data_size)
    tensors = {}
    for name, (dtype, shape, begin, end) in spans.items():
        offset = data_start + begin
        if offset % alignment:
            raise CheckpointError(
                f"{path}: tensor {name!r} starts at byte {offset}, not aligned to {alignment} "
                "bytes (the device binds tensors by offset into the shard)"
            )
        tensors[name] = TensorInfo(name, dtype, shape, path, offset, end - begin)
    return metadata, tensors


def _parse_entry(path: Path, name: str, entry: object) -> tuple[str, tuple[int, ...], int, int]:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: invalid header JSON for tensor {name!r}: {why}")

    if not isinstance(entry, dict):
        raise bad("entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in NUMPY_DTYPES:
        raise bad(f"unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise bad(f"data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise CheckpointError(
            f"{path}: tensor {name!r} has out-of-range data_offsets [{begin}, {end}]"
        )
    expected = math.prod(shape) * NUMPY_DTYPES[dtype].itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but {dtype} {shape} "
            f"needs {expected}"
        )
    return dtype, tuple(shape), begin, end


def _check_ranges(
    path: Path, spans: Mapping[str, tuple[str, tuple[int, ...], int, int]], data_size: int
) -> None:
    ordered = sorted(spans.items(), key=lambda item: (item[1][2], item[1][3]))
    previous_name, previous_end = None, 0
    for name, (_, _, begin, end) in ordered:
        if begin < previous_end and end > begin:
            raise CheckpointError(
                f"{path}: tensors {previous_name!r} and {name!r} overlap "
                f"(byte {begin} < {previous_end})"
            )
        if end > begin:
            previous_name, previous_end = name, end
    beyond = [(name, span) for name, span in ordered if span[3] > data_size]
    if not beyond:
        return
    # A file whose tensors follow each other (at most alignment padding apart) but end past
    # the file's end was cut short; anything else is a header pointing where the file never had.
    starts = [span[2] for _, span in ordered]
    ends = [0] + [span[3] for _, span in ordered[:-1]]
    packed = all(0 <= start - end < _MAX_PADDING for start, end in zip(starts, ends, strict=True))
    name, (_, _, begin, end) = beyond[0]
    if packed:
        raise CheckpointError(
            f"{path}: truncated file: the header describes {previous_end} data bytes but only "
            f"{data_size} are present (tensor {name!r} is cut off)"
        )
    raise CheckpointError(
        f"{path}: tensor {name!r} data_offsets [{begin}, {end}] out of range "
        f"(the data section has {data_size} bytes)"
    )


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """All tensors of a set of shards, by name, as read-only views. Each shard is mapped once."""

    def __init__(self, shards: Iterable[Shard]) -> None:
        self.shards: dict[Path, Shard] = {}
        self._owner: dict[str, Shard] = {}
        for shard in shards:
            self.shards[shard.path] = shard
            for name in shard.tensors:
                if name in self._owner:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {self._owner[name].path} and {shard.path}"
                    )
                self._owner[name] = shard

    def __getitem__(self, name: str) -> np.ndarray:
        return self._owner[name].array(name)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would build the view just to answer.
        return name in self._owner

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)

    def info(self, name: str) -> TensorInfo:
        return self._owner[name].tensors[name]

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return {name: shard.tensors[name] for name, shard in self._owner.items()}


def write_aligned_copy(
    source: str | Path,
    destination: str | Path,
    alignment: int = DATA_ALIGNMENT,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Rewrite a safetensors file so every tensor starts on an `alignment`-byte file boundary.

    mlx (and therefore mlx-lm) writes headers without padding and packs tensors back to back,
    so its files are generally not aligned. The copy pads the header with spaces and leaves
    zero gaps between tensors where needed; tensor data is streamed, never held in memory.
    """
    shard = Shard(Path(source), alignment=1)
    ordered = sorted(shard.tensors.values(), key=lambda t: t.offset)
    placed, cursor = [], 0
    for info in ordered:
        cursor += -cursor % alignment
        placed.append((info, cursor))
        cursor += info.nbytes
    header: dict[str, object] = {}
    if shard.metadata:
        header["__metadata__"] = shard.metadata
    for info, begin in placed:
        header[info.name] = {
            "dtype": info.dtype,
            "shape": list(info.shape),
            "data_offsets": [begin, begin + info.nbytes],
        }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(_HEADER_LENGTH_BYTES + len(encoded)) % alignment)
    chunk = 64 << 20
    with open(destination, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        written = 0
        for info, begin in placed:
            out.write(bytes(begin - written))
            for start in range(info.offset, info.offset + info.nbytes, chunk):
                end = min(start + chunk, info.offset + info.nbytes)
                out.write(shard.buffer[start:end].data)
                if progress is not None:
                    progress(end - start)
            written = begin + info.nbytes


def open_safetensors(
    paths: Iterable[str | Path], alignment: int = DATA_ALIGNMENT
) -> SafetensorsCheckpoint:
    return SafetensorsCheckpoint(Shard(Path(p), alignment) for p in paths)


def open_safetensors_dir(
    directory: str | Path,
    alignment: int = DATA_ALIGNMENT,
    allow_external_links: bool | None = None,
) -> SafetensorsCheckpoint:
    """The shards listed by `model.safetensors.index.json`, else every `*.safetensors` file.

    With an index, each listed tensor must be in the shard the index names, and each shard's
    tensors must all be listed: a mismatch means a partial or mixed-up download. Shard names
    and links must stay inside the directory (see lily.checkpoint.files).
    """
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if not index_path.exists():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no {INDEX_FILE} and no *.safetensors files in {directory}")
        paths = [
            checkpoint_file(directory, f.name, allow_external_links, SHARD_KIND) for f in files
        ]
        return open_safetensors(paths, alignment)

    index = read_json_file(checkpoint_file(directory, INDEX_FILE, allow_external_links))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{index_path}: invalid index (weight_map must map tensor names to file names)"
        )
    shard_names = sorted(set(weight_map.values()))
    paths = {
        n: checkpoint_file(directory, n, allow_external_links, SHARD_KIND) for n in shard_names
    }
    checkpoint = open_safetensors(paths.values(), alignment)
    for name, shard_name in weight_map.items():
        if name not in checkpoint or checkpoint.info(name).shard != paths[shard_name]:
            raise CheckpointError(
                f"{index_path}: tensor {name!r} is listed in {shard_name} but not found there"
            )
    unlisted = sorted(set(checkpoint) - set(weight_map))
    if unlisted:
        raise CheckpointError(
            f"{index_path}: {len(unlisted)} tensors are in the shards but not in the index, "
            f"e.g. {', '.join(unlisted[:3])}"
        )
    return checkpoint
