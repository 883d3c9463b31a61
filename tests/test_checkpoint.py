"""Loading mlx-lm-converted tiny checkpoints, refusing damaged files, and resolving model names."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint import loader as checkpoint_module
from lily.checkpoint.loader import (
    DEFAULT_REPO,
    DEFAULT_REVISION,
    CheckpointError,
    load_checkpoint,
    resolve_model,
    write_aligned_checkpoint,
)
from lily.checkpoint.safetensors_mmap import Shard

SHARD = "model.safetensors"


@pytest.fixture(scope="module")
def aligned() -> dict[str, Path]:
    """The tiny checkpoints, rewritten 16-byte aligned (mlx writes unpadded files)."""
    return {name: tiny_checkpoint(name) for name in ("small", "wide")}


def read_with_mlx(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of mlx-lm's own output, read by mlx (bf16 as raw uint16 bits)."""
    import mlx.core as mx

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, array in mx.load(str(path)).items():
            if array.dtype == mx.bfloat16:
                array = array.view(mx.uint16)
            out[name] = np.array(array)
    return out


@pytest.fixture
def small_copy(aligned, tmp_path) -> Path:
    return Path(shutil.copytree(aligned["small"], tmp_path / "small"))


def rewrite_header(path: Path, mutate) -> None:
    """Apply `mutate` to a shard's parsed header, keeping the data section byte for byte."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    mutate(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(8 + len(encoded)) % 16)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


@pytest.mark.parametrize("name", ["small", "wide"])
def test_tiny_checkpoints_load_as_family_members(aligned, name):
    checkpoint = load_checkpoint(aligned[name])
    assert checkpoint.level == "family"
    assert checkpoint.config.hidden_size == {"small": 128, "wide": 256}[name]
    # Every tensor mlx-lm wrote, read independently, equals the view Lily hands out.
    independent = read_with_mlx(tiny_checkpoint(name, aligned=False))
    assert set(checkpoint.tensors) == set(independent)
    for tensor_name, expected in independent.items():
        view = checkpoint.tensors[tensor_name]
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, expected, err_msg=tensor_name)
        location = checkpoint.locations[tensor_name]
        assert location.offset % 16 == 0
        shard = checkpoint.shards[location.shard]
        assert np.shares_memory(view, shard.buffer)


def test_real_mlx_lm_output_is_refused_for_misalignment_when_asked():
    # What mlx writes is packed without padding, so the device could not bind it by offset.
    with pytest.raises(CheckpointError, match=r"tensor '[\w.]+' starts at byte \d+, not aligned"):
        load_checkpoint(tiny_checkpoint("small", aligned=False), unaligned="refuse")


def test_real_mlx_lm_output_loads_with_its_unaligned_tensors_listed(aligned):
    original = tiny_checkpoint("small", aligned=False)
    checkpoint = load_checkpoint(original)
    offsets = {n: info.offset for n, info in checkpoint.locations.items()}
    assert checkpoint.unaligned == {n for n, offset in offsets.items() if offset % 16}
    assert len(checkpoint.unaligned) > len(offsets) // 2  # mlx packs without padding
    reference = load_checkpoint(aligned["small"])
    assert reference.unaligned == frozenset()
    for name in reference.tensors:
        np.testing.assert_array_equal(checkpoint.tensors[name], reference.tensors[name])


def test_aligned_copy_holds_the_same_tensors(tmp_path):
    original = tiny_checkpoint("wide", aligned=False)
    copy = write_aligned_checkpoint(original, tmp_path / "copy")
    assert (copy / "config.json").read_bytes() == (original / "config.json").read_bytes()
    before = Shard(original / SHARD, alignment=1)
    after = Shard(copy / SHARD)
    assert before.tensors.keys() == after.tensors.keys()
    for name in before.tensors:
        assert after.tensors[name].offset % 16 == 0
        assert after.tensors[name].dtype == before.tensors[name].dtype
        np.testing.assert_array_equal(after.array(name), before.array(name))


def test_strict_refuses_a_tiny_model(aligned):
    with pytest.raises(CheckpointError, match="hidden_size is 128, the real model has 2048"):
        load_checkpoint(aligned["small"], level="strict")


def test_missing_shard(small_copy):
    (small_copy / SHARD).unlink()
    with pytest.raises(CheckpointError, match=r"missing shard file .*model\.safetensors"):
        load_checkpoint(small_copy)


def test_truncated_shard(small_copy):
    path = small_copy / SHARD
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated file"):
        load_checkpoint(small_copy)


def test_invalid_header_json(small_copy):
    path = small_copy / SHARD
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"not json at "
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: invalid header JSON"):
        load_checkpoint(small_copy)


def test_offsets_out_of_range(small_copy):
    name = "language_model.model.layers.0.linear_attn.A_log"

    def move_far(header):
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + (1 << 30), end + (1 << 30)]

    rewrite_header(small_copy / SHARD, move_far)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' data_offsets .* out of range"):
        load_checkpoint(small_copy)


def test_overlapping_offsets(small_copy):
    q = "language_model.model.layers.3.self_attn.q_norm.weight"
    k = "language_model.model.layers.3.self_attn.k_norm.weight"

    def alias(header):
        header[k]["data_offsets"] = header[q]["data_offsets"]

    rewrite_header(small_copy / SHARD, alias)
    with pytest.raises(
        CheckpointError, match=r"tensors '.*_norm.weight' and '.*_norm.weight' overlap"
    ):
        load_checkpoint(small_copy)


def test_misaligned_offset(small_copy):
    name = "language_model.model.norm.weight"
    path = small_copy / SHARD
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    begin, end = header[name]["data_offsets"]
    # Move this one tensor 4 bytes into the free space at the end of the data section.
    data = raw[8 + length :]
    header[name]["data_offsets"] = [len(data) + 4, len(data) + 4 + end - begin]
    data += bytes(4) + data[begin:end]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(8 + len(encoded)) % 16)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' starts at byte \d+, not aligned"):
        load_checkpoint(small_copy, unaligned="refuse")
    assert load_checkpoint(small_copy).unaligned == {name}


def test_missing_config(small_copy):
    (small_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(small_copy)


def test_unknown_level(aligned):
    with pytest.raises(ValueError, match="level must be"):
        load_checkpoint(aligned["small"], level="loose")


# --- resolve_model ------------------------------------------------------------------------


def test_aligned_local_directory_is_used_as_is(aligned):
    assert resolve_model(str(aligned["small"])) == aligned["small"]


def test_unaligned_local_directory_resolves_to_an_aligned_copy(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LILY_CACHE", str(tmp_path))
    original = tiny_checkpoint("small", aligned=False)
    resolved = resolve_model(str(original))
    assert resolved.parent == tmp_path / "aligned"
    assert "not 16-byte aligned" in capsys.readouterr().err
    checkpoint = load_checkpoint(resolved)
    assert set(checkpoint.tensors) == set(Shard(original / SHARD, alignment=1).tensors)
    # Made once: the second resolution reuses the copy without rewriting it.
    written = (resolved / SHARD).stat().st_mtime_ns
    assert resolve_model(str(original)) == resolved
    assert (resolved / SHARD).stat().st_mtime_ns == written
    assert capsys.readouterr().err == ""


def test_without_disk_room_for_the_aligned_copy_the_original_is_loaded(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv("LILY_CACHE", str(tmp_path))
    needed = []

    def little_free(path):
        needed.append(path)
        return 10**6

    monkeypatch.setattr(checkpoint_module, "free_disk_bytes", little_free)
    original = tiny_checkpoint("small", aligned=False)
    assert resolve_model(str(original)) == original
    assert needed == [tmp_path / "aligned"]
    err = capsys.readouterr().err
    assert "only 0.00 GB are free" in err and "copying its tensors into memory" in err
    assert not (tmp_path / "aligned").exists()


def test_free_disk_bytes_looks_at_the_nearest_existing_directory(tmp_path):
    free = checkpoint_module.free_disk_bytes(tmp_path / "not" / "yet")
    assert abs(free - shutil.disk_usage(tmp_path).free) < 2**30  # other writers on the disk


def test_demo_comes_from_lily_demo(monkeypatch, tmp_path):
    fake = types.ModuleType("lily.checkpoint.demo")
    fake.demo_checkpoint_dir = lambda: tmp_path
    monkeypatch.setitem(sys.modules, "lily.checkpoint.demo", fake)
    assert resolve_model("demo") == tmp_path


@pytest.fixture
def recorded_downloads(monkeypatch, tmp_path):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("lily.checkpoint.hub.hub_reachable", lambda: True)  # CI has no network
    return calls


def test_default_model_is_the_pinned_repo(recorded_downloads, tmp_path):
    assert resolve_model(None) == tmp_path
    [(repo, kwargs)] = recorded_downloads
    assert repo == DEFAULT_REPO == "mlx-community/Qwen3.6-35B-A3B-4bit"
    assert kwargs["revision"] == DEFAULT_REVISION == "38740b847e4cb78f352aba30aa41c76e08e6eb46"
    assert kwargs["local_files_only"] is False


def test_repo_download_fetches_only_what_lily_reads(recorded_downloads):
    resolve_model("someone/some-model", revision="v1")
    [(repo, kwargs)] = recorded_downloads
    assert (repo, kwargs["revision"]) == ("someone/some-model", "v1")
    patterns = kwargs["allow_patterns"]
    # With the image processor's values: Lily reads images (docs/vision.md); not video's.
    wanted = ("model-00001-of-00004.safetensors", "config.json", "tokenizer.json")
    for needed in (*wanted, "preprocessor_config.json"):
        assert any(Path(needed).match(p) for p in patterns), needed
    for unwanted in ("README.md", "video_preprocessor_config.json"):
        assert not any(Path(unwanted).match(p) for p in patterns), unwanted


def test_offline_and_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        CheckpointError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE"
    ):
        resolve_model("someone/not-cached")


def test_unreachable_hub_uses_the_cache_only(recorded_downloads, monkeypatch):
    monkeypatch.setattr("lily.checkpoint.hub.hub_reachable", lambda: False)
    resolve_model("someone/some-model")
    [(_, kwargs)] = recorded_downloads
    assert kwargs["local_files_only"] is True


def test_unreachable_hub_and_not_cached_says_how_to_download(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("lily.checkpoint.hub.hub_reachable", lambda: False)
    with pytest.raises(CheckpointError, match="cannot be reached") as raised:
        resolve_model("someone/not-cached", revision="v2")
    assert "hf download someone/not-cached --revision v2" in str(raised.value)
    assert "local checkpoint directory" in str(raised.value)


@pytest.mark.parametrize("bad", ["./no/such/dir", "/no/such/dir", "a/b/c", "plainname"])
def test_neither_directory_nor_repo_id(bad):
    with pytest.raises(CheckpointError, match="neither an existing directory nor"):
        resolve_model(bad)


def test_checkpoint_module_names_its_public_api():
    assert set(checkpoint_module.__all__) >= {"load_checkpoint", "resolve_model", "Checkpoint"}


# --- the small files beside the weights ------------------------------------------------------


def nested_json(depth: int) -> str:
    return '{"a": ' + "[" * depth + "1" + "]" * depth + "}"


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        ("tokenizer_config.json", nested_json(100_000), "nested too deeply"),
        ("tokenizer_config.json", b'{"eos_token": "\xff"}', "not UTF-8 text"),
        ("tokenizer_config.json", "[1, 2]", "not a JSON object"),
        ("generation_config.json", nested_json(100_000), "nested too deeply"),
        ("generation_config.json", b'{"temperature": "\xff"}', "not UTF-8 text"),
        ("chat_template.jinja", b"{{ '\xff' }}", "not UTF-8 text"),
        ("chat_template.jinja", "{% if x %}" * 20_000 + "{% endif %}" * 20_000, "too deeply"),
        ("chat_template.jinja", "{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", "too deeply"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "",
)
def test_a_damaged_small_file_is_a_named_error_at_load(tmp_path, name, content, error):
    import lily
    from lily.checkpoint.loader import resolve_model

    model = Path(shutil.copytree(resolve_model("demo"), tmp_path / "demo"))
    path = model / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=error) as raised:
        lily.load(str(model), device="reference", max_seq=32)
    # A named Lily error (CheckpointError, TokenizerError, ChatTemplateError), not Python's own.
    assert type(raised.value).__module__.startswith("lily."), type(raised.value)
