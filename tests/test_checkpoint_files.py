"""What a checkpoint directory can make the loader open (lily.checkpoint.files): names stay in
the directory, links lead into it (or are the Hugging Face cache's own blob links) unless the
user allows more, only regular files are opened and never waited on; then a fuzz over
malformed configs, indexes and shard headers, each of which must be a named CheckpointError."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from tiny_models import tiny_checkpoint

from lily.checkpoint.files import EXTERNAL_LINKS_ENV
from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.safetensors_mmap import INDEX_FILE, open_safetensors_dir
from lily.errors import CheckpointError

SECRET = b"root:x:0:0:root:/root:/bin/bash\n"


def _checkpoint_dir(root: Path) -> Path:
    directory = root / "model"
    directory.mkdir()
    save_file({"a": np.arange(4, dtype=np.float32)}, str(directory / "one.safetensors"))
    return directory


def _index(directory: Path, weight_map: object) -> None:
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


# ---- names from the index ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../secret", "../../secret", "sub/../../secret", "{root}"])
def test_an_index_cannot_name_a_file_outside_the_directory(tmp_path, name):
    directory = _checkpoint_dir(tmp_path)
    (tmp_path / "secret").write_bytes(SECRET)
    name = name.format(root=tmp_path / "secret")
    _index(directory, {"a": "one.safetensors", "b": name})
    with pytest.raises(CheckpointError, match="points outside the checkpoint directory") as error:
        open_safetensors_dir(directory, alignment=8)
    # Today's message showed the file's first 8 bytes as a header length.
    leaked = struct.unpack("<Q", SECRET[:8])[0]
    assert str(leaked) not in str(error.value) and "root:x" not in str(error.value)


@pytest.mark.parametrize("name", ["", "one\0.safetensors", 7, None, ["one.safetensors"]])
def test_an_index_name_that_is_no_file_name_is_refused(tmp_path, name):
    directory = _checkpoint_dir(tmp_path)
    _index(directory, {"a": name})
    with pytest.raises(CheckpointError):
        open_safetensors_dir(directory, alignment=8)


def test_a_shard_in_a_subdirectory_is_found(tmp_path):
    directory = _checkpoint_dir(tmp_path)
    (directory / "sub").mkdir()
    shutil.move(directory / "one.safetensors", directory / "sub" / "one.safetensors")
    _index(directory, {"a": "sub/one.safetensors"})
    np.testing.assert_array_equal(open_safetensors_dir(directory, alignment=8)["a"], np.arange(4))


# ---- links ------------------------------------------------------------------------------------


def _link_shard_outside(tmp_path: Path) -> Path:
    directory = _checkpoint_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(directory / "one.safetensors", elsewhere)
    (directory / "one.safetensors").symlink_to(elsewhere)
    return directory


@pytest.mark.parametrize("indexed", [True, False])
def test_a_link_leading_outside_is_refused_unless_allowed(tmp_path, monkeypatch, indexed):
    monkeypatch.delenv(EXTERNAL_LINKS_ENV, raising=False)
    directory = _link_shard_outside(tmp_path)
    if indexed:
        _index(directory, {"a": "one.safetensors"})
    outside = f"outside the checkpoint directory.*{EXTERNAL_LINKS_ENV}"
    with pytest.raises(CheckpointError, match=outside):
        open_safetensors_dir(directory, alignment=8)
    assert "a" in open_safetensors_dir(directory, alignment=8, allow_external_links=True)
    monkeypatch.setenv(EXTERNAL_LINKS_ENV, "1")
    assert "a" in open_safetensors_dir(directory, alignment=8)
    with pytest.raises(CheckpointError):
        open_safetensors_dir(directory, alignment=8, allow_external_links=False)


def test_a_config_linked_from_outside_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(EXTERNAL_LINKS_ENV, raising=False)
    directory = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), directory)
    shutil.move(directory / "config.json", tmp_path / "config.json")
    (directory / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(directory)
    assert load_checkpoint(directory, allow_external_links=True).config.hidden_size == 128


COMPANIONS = ["tokenizer.json", "chat_template.jinja", "generation_config.json"]


@pytest.mark.parametrize("name", COMPANIONS)
def test_tokenizer_template_and_sampling_files_follow_the_same_rules(tmp_path, monkeypatch, name):
    """The tokenizer, template and sampling defaults are read after load_checkpoint, which
    holds them to the rules first: an outside link or a FIFO is refused by name."""
    monkeypatch.delenv(EXTERNAL_LINKS_ENV, raising=False)
    directory = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), directory)
    (directory / name).unlink(missing_ok=True)
    (tmp_path / name).write_text("{}")
    (directory / name).symlink_to(tmp_path / name)
    with pytest.raises(CheckpointError, match=f"{name} is a link to .*outside"):
        load_checkpoint(directory)
    assert load_checkpoint(directory, allow_external_links=True).path == directory
    (directory / name).unlink()
    os.mkfifo(directory / name)
    with pytest.raises(CheckpointError, match=f"{name} is not a regular file"):
        load_checkpoint(directory)


def test_links_inside_the_directory_are_followed(tmp_path):
    directory = _checkpoint_dir(tmp_path)
    (directory / "store").mkdir()
    shutil.move(directory / "one.safetensors", directory / "store" / "blob")
    (directory / "one.safetensors").symlink_to("store/blob")
    assert "a" in open_safetensors_dir(directory, alignment=8)


def test_hugging_face_cache_blob_links_are_followed_and_nothing_else(tmp_path, monkeypatch):
    """The cache keeps each file once under blobs/ and links snapshots/<revision>/<file> to it."""
    monkeypatch.delenv(EXTERNAL_LINKS_ENV, raising=False)
    repo = tmp_path / "models--owner--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    save_file({"a": np.arange(4, dtype=np.float32)}, str(repo / "blobs" / "5e1f"))
    (snapshot / "one.safetensors").symlink_to("../../blobs/5e1f")
    assert "a" in open_safetensors_dir(snapshot, alignment=8)
    # A link from the snapshot to anywhere but the cache's blobs is an outside link.
    (repo / "elsewhere").mkdir()
    shutil.move(repo / "blobs" / "5e1f", repo / "elsewhere" / "5e1f")
    (snapshot / "one.safetensors").unlink()
    (snapshot / "one.safetensors").symlink_to("../../elsewhere/5e1f")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        open_safetensors_dir(snapshot, alignment=8)


def test_a_link_loop_is_refused(tmp_path):
    directory = _checkpoint_dir(tmp_path)
    (directory / "loop.safetensors").symlink_to("loop.safetensors")
    with pytest.raises(CheckpointError):
        open_safetensors_dir(directory, alignment=8)


# ---- only regular files -----------------------------------------------------------------------

LOAD = textwrap.dedent(
    """
    import sys
    from lily.checkpoint.loader import load_checkpoint
    from lily.errors import CheckpointError
    try:
        load_checkpoint(sys.argv[1])
    except CheckpointError as e:
        print("refused:", e)
    """
)


@pytest.mark.parametrize("name", ["model.safetensors", INDEX_FILE, "config.json"])
def test_a_fifo_is_refused_not_waited_on(tmp_path, name):
    directory = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), directory)
    (directory / name).unlink()
    os.mkfifo(directory / name)
    # In a subprocess: opening a FIFO for reading blocks until a writer comes, forever.
    result = subprocess.run(
        [sys.executable, "-c", LOAD, str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused:") and name in result.stdout, result.stdout


def test_a_directory_named_like_a_shard_is_refused(tmp_path):
    directory = _checkpoint_dir(tmp_path)
    (directory / "two.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="two.safetensors is not a regular file"):
        open_safetensors_dir(directory, alignment=8)


def test_a_directory_named_config_json_is_refused(tmp_path):
    directory = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), directory)
    (directory / "config.json").unlink()
    (directory / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(directory)


# ---- fuzz: malformed configs, indexes and headers ---------------------------------------------

STRANGE_VALUES = [
    None, True, -1, 0, 2**64, 10**400, 1.5, -0.0, float("nan"), float("inf"), "", "x", [], [1],
    {}, {"a": 1}, [[[[[]]]]],
]  # fmt: skip


def _mutations(value: object, depth: int = 0):
    """Copies of a JSON value with one entry replaced by each strange value, removed, or (for
    containers) mutated further down."""
    if isinstance(value, dict):
        for key in value:
            for strange in STRANGE_VALUES:
                yield {**value, key: strange}
            yield {k: v for k, v in value.items() if k != key}
            if depth < 2 and isinstance(value[key], (dict, list)):
                for inner in _mutations(value[key], depth + 1):
                    yield {**value, key: inner}
    elif isinstance(value, list) and value:
        for strange in STRANGE_VALUES:
            yield [strange, *value[1:]]
        yield value[:-1]


def _dump(value: object) -> str:
    return json.dumps(value, allow_nan=True)


def _refused(load: Callable[[], object]) -> bool:
    """Whether `load` raised a CheckpointError (ConfigError and ValidationError are kinds of
    it); any other exception fails the test."""
    try:
        load()
    except CheckpointError:
        return True
    return False


def test_fuzzed_configs_give_named_errors_only(tmp_path):
    directory = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), directory)
    good = json.loads((directory / "config.json").read_text())
    good["quantization"] = dict(list(good["quantization"].items())[:4])  # fewer, faster cases
    good.pop("quantization_config")
    cases = list(_mutations(good))
    assert len(cases) > 800
    refused = 0
    for case in cases:
        (directory / "config.json").write_text(_dump(case))
        refused += _refused(lambda: load_checkpoint(directory))
    assert refused > len(cases) // 2


def test_fuzzed_indexes_give_named_errors_only(tmp_path):
    directory = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), directory)
    good = json.loads((directory / INDEX_FILE).read_text())
    good["weight_map"] = dict(list(good["weight_map"].items())[:6])
    cases = [*_mutations(good), [], "weight_map", 3, {"weight_map": {"x": "config.json"}}]
    refused = 0
    for case in cases:
        (directory / INDEX_FILE).write_text(_dump(case))
        refused += _refused(lambda: load_checkpoint(directory))
    assert refused > len(cases) // 2


def test_fuzzed_shard_headers_give_named_errors_only(tmp_path):
    directory = tmp_path / "shards"
    directory.mkdir()
    path = directory / "one.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.int32)}, str(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    rng = random.Random(2)
    cases = [struct.pack("<Q", len(h)) + h + body for h in
             (_dump(m).encode() for m in _mutations(header))]  # fmt: skip
    cases += [
        struct.pack("<Q", 2**64 - 1) + data[8:],
        struct.pack("<Q", 10**6) + b"[" * 10**6,
        struct.pack("<Q", 5) + b"\xff\xfe\xfd\xfc\xfb",
        struct.pack("<Q", 9) + b'{"a": 1e9' + body,
        data[:5],
        data[: len(data) // 2],
    ]
    for _ in range(200):
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(8 + length)] = rng.randrange(256)
        cases.append(bytes(flipped))
    refused = 0
    for case in cases:
        path.write_bytes(case)
        refused += _refused(lambda: open_safetensors_dir(directory, alignment=1))
    assert refused > len(cases) // 2
