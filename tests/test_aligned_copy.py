"""The aligned copy of an unaligned checkpoint (`lily.checkpoint.loader.aligned_checkpoint`): keyed
on
the content of every file it serves, so an edit to any of them is served (even one that keeps
the modification time), without rewriting shards whose content did not change; and built aside,
so an interrupted or killed copy leaves no partial files behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_models import tiny_checkpoint

import lily.checkpoint.loader as checkpoint_module
from lily.checkpoint.loader import load_checkpoint, resolve_model

SHARD = "model.safetensors"


@pytest.fixture
def source(tmp_path, monkeypatch) -> Path:
    """A private copy of mlx-lm's (unaligned) tiny checkpoint, and a private Lily cache."""
    monkeypatch.setenv("LILY_CACHE", str(tmp_path / "cache"))
    return Path(shutil.copytree(tiny_checkpoint("small", aligned=False), tmp_path / "small"))


def _edit_keeping_times(path: Path, text: str) -> None:
    """Rewrites a file and sets its access and modification times back, as `cp -p` or an
    rsync with times would leave it."""
    status = path.stat()
    path.write_text(text)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


def _shard_rewrites(capsys) -> bool:
    return "writing an aligned copy" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json", "tokenizer.json"])
def test_an_edited_file_is_served_without_rewriting_the_shards(source, capsys, name):
    first = resolve_model(str(source))
    assert _shard_rewrites(capsys)
    edited = (source / name).read_text().replace("{", '{"edited": true, ', 1)
    _edit_keeping_times(source / name, edited)
    second = resolve_model(str(source))
    assert second != first
    assert (second / name).read_text() == edited
    assert (first / name).read_text() != edited  # a copy already served is never changed
    assert not _shard_rewrites(capsys)
    assert (second / SHARD).stat().st_ino == (first / SHARD).stat().st_ino
    load_checkpoint(second)


def test_a_template_added_later_is_served(source):
    first = resolve_model(str(source))
    for name, text in (("chat_template.jinja", "{{ messages }}"), ("generation_config.json", "{}")):
        (source / name).write_text(text)
        resolved = resolve_model(str(source))
        assert (resolved / name).read_text() == text
    assert resolved != first and not (first / "generation_config.json").exists()


def test_a_shard_changed_in_place_is_aligned_again(source, capsys):
    first = resolve_model(str(source))
    capsys.readouterr()
    data = bytearray((source / SHARD).read_bytes())
    data[-1] ^= 0xFF  # last byte of the last tensor: same size, same header
    status = (source / SHARD).stat()
    (source / SHARD).write_bytes(bytes(data))
    os.utime(source / SHARD, ns=(status.st_atime_ns, status.st_mtime_ns))
    second = resolve_model(str(source))
    assert second != first and _shard_rewrites(capsys)
    assert (second / SHARD).read_bytes()[-1] != (first / SHARD).read_bytes()[-1]


def test_a_second_resolution_reuses_everything(source, capsys):
    first = resolve_model(str(source))
    capsys.readouterr()
    assert resolve_model(str(source)) == first
    assert capsys.readouterr().err == ""


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_an_interrupted_copy_leaves_nothing_behind(source, monkeypatch, tmp_path):
    def interrupted(source, destination, progress=None):
        Path(destination).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "write_aligned_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(source))
    assert not [p for p in _files(tmp_path / "cache") if "digests" not in p.parts]


KILLED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import lily.checkpoint.loader as checkpoint_module

    def stuck(source, destination, progress=None):
        Path(destination).write_bytes(b"partial")
        print("writing", flush=True)
        time.sleep(600)

    checkpoint_module.write_aligned_copy = stuck
    checkpoint_module.resolve_model(sys.argv[1])
    """
)


def test_a_killed_copy_leaves_no_partial_files_once_the_next_copy_runs(source, tmp_path):
    env = {**os.environ, "LILY_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(source)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "writing\n"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    partial = [p for p in _files(tmp_path / "cache") if p.read_bytes() == b"partial"]
    assert partial, "the killed copy wrote nothing: the test does not test anything"
    resolved = resolve_model(str(source))
    assert not any(p.exists() for p in partial)
    assert not [p for p in (tmp_path / "cache").rglob(".*")], "abandoned work directories"
    load_checkpoint(resolved)
