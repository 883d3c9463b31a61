"""Finding a checkpoint (local directory, Hugging Face repo, or the demo) and loading it.

Loading maps every shard read-only, validates names, shapes, dtypes and bit widths against the
config, and hands out the tensors as read-only numpy views: no weight bytes are read or copied.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from lily.checkpoint.cache import build_once, cache_root
from lily.checkpoint.config import ModelConfig, load_config
from lily.checkpoint.files import checkpoint_file, open_regular
from lily.checkpoint.mtp import MTP_SHARD, write_mtp_index
from lily.checkpoint.safetensors_mmap import (
    DATA_ALIGNMENT,
    INDEX_FILE,
    SHARD_KIND,
    CheckpointError,
    Shard,
    TensorInfo,
    open_safetensors_dir,
    write_aligned_copy,
)
from lily.checkpoint.validate import claims_real_model, has_mtp_head, validate

__all__ = [
    "DEFAULT_REPO",
    "DEFAULT_REVISION",
    "Checkpoint",
    "aligned_checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "resolve_model",
    "write_aligned_checkpoint",
]

DEFAULT_REPO = "mlx-community/Qwen3.6-35B-A3B-4bit"
# The revision the reference engine was measured on; used when no revision is asked for.
DEFAULT_REVISION = "38740b847e4cb78f352aba30aa41c76e08e6eb46"
DEMO = "demo"

# The files besides the weights and config.json that Lily reads from a checkpoint (the
# tokenizer, the chat template, the sampling defaults, the image processor): load_checkpoint
# holds them to the same rules as the rest (lily.checkpoint.files) before anything reads them.
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "preprocessor_config.json",
)
# Only what Lily reads: weights, config, tokenizer, chat template and image processor.
DOWNLOAD_PATTERNS = ["*.safetensors", INDEX_FILE, "config.json", *COMPANION_FILES]

LoadLevel = Literal["strict", "family", "auto"]
# Disk left free after the aligned copy is written.
ALIGNED_COPY_MARGIN_BYTES = 10**9
# The one file of an entry of the aligned-shard store, `$LILY_CACHE/aligned/shards/<sha256>/`.
ALIGNED_SHARD = "shard.safetensors"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(model: str | None, revision: str | None = None) -> Path:
    """The local directory of a model argument, downloading it from Hugging Face if needed.

    `None` is the default repo at its pinned revision; an existing directory is used as is;
    `"demo"` is the built-in random-weight demo model; anything else is a Hugging Face repo id.
    With `HF_HUB_OFFLINE` set, only the local Hugging Face cache is consulted. A directory
    whose shards are not 16-byte aligned (anything mlx wrote) resolves to an aligned copy of it
    (see `aligned_checkpoint`).
    """
    if model is None:
        model, revision = DEFAULT_REPO, revision or DEFAULT_REVISION
    if model == DEMO:
        from lily.checkpoint.demo import demo_checkpoint_dir

        return Path(demo_checkpoint_dir())
    local = Path(model).expanduser()
    if local.is_dir():
        return aligned_checkpoint(local)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise CheckpointError(
            f"model {model!r} is neither an existing directory nor a Hugging Face repo id "
            "(owner/name)"
        )

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    from lily.checkpoint.hub import download_hint, hub_endpoint, hub_reachable

    offline = _offline()
    # Checked up front: without a network the Hub client retries for ~25 s before failing.
    unreachable = not offline and not hub_reachable()
    try:
        path = snapshot_download(
            model,
            revision=revision,
            allow_patterns=DOWNLOAD_PATTERNS,
            local_files_only=offline or unreachable,
        )
    except LocalEntryNotFoundError as e:
        where = f"{model} (revision {revision or 'main'}) is not in the local Hugging Face cache"
        if offline:
            raise CheckpointError(
                f"{where} and HF_HUB_OFFLINE is set: {download_hint(model, revision)}"
            ) from None
        if unreachable:
            raise CheckpointError(
                f"{where} and {hub_endpoint()} cannot be reached (no network?): "
                f"{download_hint(model, revision)}"
            ) from None
        raise CheckpointError(f"could not download {model}: {e}") from e
    except HFValidationError as e:
        raise CheckpointError(f"{model!r} is not a valid Hugging Face repo id: {e}") from e
    return aligned_checkpoint(Path(path))


def _is_aligned(shard_path: Path) -> bool:
    try:
        shard = Shard(shard_path, alignment=1)
    except CheckpointError:
        return True  # not ours to judge here: load_checkpoint reports the defect
    return all(info.offset % DATA_ALIGNMENT == 0 for info in shard.tensors.values())


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path`, or would (its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def _copied_files(path: Path, allow_external_links: bool | None) -> list[Path]:
    """The files of a checkpoint directory its aligned copy holds: every regular file in it,
    checked as lily.checkpoint.files requires."""
    files = [checkpoint_file(path, item.name, allow_external_links) for item in path.iterdir()]
    return sorted(f for f in files if f.is_file())


def _content_digest(path: Path) -> str:
    """SHA-256 of a file's content, remembered under `$LILY_CACHE/digests` so that 20 GB of
    shards are not read again at every load. The memory is keyed by the file's identity, size,
    and modification and change times: any write to the file changes its change time (which,
    unlike the modification time, no tool can set back), so a remembered digest is always that
    of the file's current content."""
    with open_regular(path) as f:
        status = os.fstat(f.fileno())
        identity = [str(path.resolve()), status.st_dev, status.st_ino, status.st_size]
        identity += [status.st_mtime_ns, status.st_ctime_ns]
        key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]
        remembered = cache_root() / "digests" / key / "sha256"
        if remembered.is_file():
            return remembered.read_text()
        digest = hashlib.sha256()
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    build_once(remembered.parent, lambda out: _write_text(out / "sha256", hexdigest))
    return hexdigest


def shard_digest(path: Path) -> str:
    """A SHA-256 naming a shard's content, for what is computed from the weights (the prefix
    cache's files are keyed by it). A shard of an aligned copy is a hard link to its entry of
    the aligned-shard store, named by the digest of the shard it was rewritten from: nothing is
    read. Any other file is hashed once and remembered (`_content_digest`), or, when nothing
    can be written to `$LILY_CACHE`, hashed again at every call."""
    status = os.stat(path)
    store = cache_root() / "aligned" / "shards"
    try:
        with os.scandir(store) as entries:
            for entry in entries:
                if not re.fullmatch("[0-9a-f]{64}", entry.name):
                    continue  # a build under way
                try:
                    stored = os.stat(Path(entry.path) / ALIGNED_SHARD)
                except OSError:
                    continue
                if (stored.st_dev, stored.st_ino) == (status.st_dev, status.st_ino):
                    return entry.name
    except OSError:
        pass  # no store: nothing was ever aligned
    try:
        return _content_digest(path)
    except OSError:
        digest = hashlib.sha256()
        with open_regular(path) as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
        return digest.hexdigest()


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(text)


def aligned_checkpoint(path: Path, allow_external_links: bool | None = None) -> Path:
    """`path` if every tensor of its shards is 16-byte aligned, else a cached aligned copy.

    mlx writes safetensors without padding, so mlx-community uploads and mlx-lm conversions
    generally have tensors at unaligned offsets, which the device cannot bind in place. The
    copy is made under `$LILY_CACHE/aligned` (default `~/.cache/lily`): each shard is rewritten
    once (streamed, same tensors; it takes as much disk as the weights) into a store keyed by
    its content, and the directory served is keyed by the content of every file it holds, so
    an edit to any file of `path` (a template, the config, a later generation_config.json) is
    served at once without rewriting the shards again. Copies are built aside and renamed into
    place, so an interrupted one leaves nothing behind that is served. Without room for the
    shards (their size plus 1 GB), `path` itself is returned, saying so: the device then
    copies the unaligned tensors into its own memory at every load (see
    `Checkpoint.unaligned`), as the reference engine always does.
    """
    shards = [
        checkpoint_file(path, shard.name, allow_external_links, SHARD_KIND)
        for shard in sorted(path.glob("*.safetensors"))
    ]
    if all(_is_aligned(shard) for shard in shards):
        return path
    files = _copied_files(path, allow_external_links)
    shards = [f for f in files if f.suffix == ".safetensors"]
    digests = {f.name: _content_digest(f) for f in files}
    key = hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()[:16]
    aligned = cache_root() / "aligned"
    target = aligned / f"{path.name}-{key}"
    if target.is_dir():
        return target
    stored = {s.name: aligned / "shards" / digests[s.name] for s in shards}
    missing = [s for s in shards if not stored[s.name].is_dir()]
    total = sum(s.stat().st_size for s in missing)
    free = free_disk_bytes(aligned)
    if missing and free < total + ALIGNED_COPY_MARGIN_BYTES:
        print(
            f"lily: {path} is not 16-byte aligned and its aligned copy needs {total / 1e9:.2f} "
            f"GB, but only {free / 1e9:.2f} GB are free at {aligned}: loading it as it "
            "is, copying its tensors into memory at every load (slower to load). To make the "
            "copy once instead, free disk space or point LILY_CACHE at a disk with room.",
            file=sys.stderr,
        )
        return path
    if missing:
        print(
            f"lily: {path} is not 16-byte aligned; writing an aligned copy "
            f"({total / 1e9:.2f} GB) to {aligned} (once)",
            file=sys.stderr,
        )
        from huggingface_hub.utils import tqdm

        with tqdm(total=total, unit="B", unit_scale=True, desc="aligning checkpoint") as bar:
            for shard in missing:
                build_once(
                    stored[shard.name],
                    lambda out, shard=shard: _write_aligned_shard(shard, out, bar.update),
                )

    def serve(out: Path) -> None:
        out.mkdir(parents=True)
        for item in files:
            if item.name in stored:
                _link_or_copy(stored[item.name] / ALIGNED_SHARD, out / item.name)
            else:
                _copy_regular(item, out / item.name)

    return build_once(target, serve)


def with_mtp_head(path: Path, head: Path, allow_external_links: bool | None = None) -> Path:
    """A directory in Lily's cache serving the checkpoint at `path` with the MTP head sidecar
    in `head` (`hub.fetch_mtp_head`) beside its shards and listed in its index: every file is a
    hard link (a copy across disks), so it costs no room for the weights. Keyed by the content
    of what it holds, like the aligned copies."""
    files = _copied_files(path, allow_external_links)
    sidecar = checkpoint_file(head, MTP_SHARD, allow_external_links, SHARD_KIND)
    digests = {f.name: shard_digest(f) for f in [*files, sidecar]}
    key = hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()[:16]
    target = cache_root() / "with-mtp" / f"{path.name}-{key}"

    def serve(out: Path) -> None:
        out.mkdir(parents=True)
        for item in files:
            if item.name == INDEX_FILE:
                _copy_regular(item, out / item.name)  # rewritten below: never a shared inode
            else:
                _link_or_copy(item, out / item.name)
        _link_or_copy(sidecar, out / MTP_SHARD)
        head_names = Shard(sidecar).tensors
        write_mtp_index(out, head_names)

    return build_once(target, serve)


def ensure_mtp_head(
    path: Path, checkpoint: Checkpoint, required: bool, repo: str | None = None
) -> tuple[Path, Checkpoint]:
    """The checkpoint with the multi-token-prediction head: as it is when it has one, else with
    the head of `repo` (default: the real model's original release) fetched and quantized once
    (`hub.fetch_mtp_head`) and served beside it (`with_mtp_head`). When that fails, raises if
    the head is `required`, else says why on stderr and goes on without it."""
    from lily.checkpoint.hub import MTP_SOURCE_REPO, fetch_mtp_head

    if checkpoint.has_mtp_head:
        return path, checkpoint
    try:
        head = fetch_mtp_head(checkpoint.config.num_experts, repo or MTP_SOURCE_REPO)
    except CheckpointError as e:
        if required:
            raise
        print(f"lily: drafting without the MTP head: {e}", file=sys.stderr)
        return path, checkpoint
    served = with_mtp_head(path, head)
    return served, load_checkpoint(served, level=checkpoint.level)


def _write_aligned_shard(source: Path, out: Path, progress: Callable[[int], object]) -> None:
    out.mkdir(parents=True)
    write_aligned_copy(source, out / ALIGNED_SHARD, progress=progress)


def _link_or_copy(source: Path, destination: Path) -> None:
    """A hard link (the store and the served directories share one disk), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)


def _check_regular(path: Path) -> None:
    """Refuses anything but a regular file, without opening it (a FIFO would block)."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise CheckpointError(f"{path} is not a regular file")


def _copy_regular(source: Path, destination: Path) -> None:
    with open_regular(source) as f, open(destination, "wb") as out:
        shutil.copyfileobj(f, out)


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint. `tensors` are read-only views over the memory-mapped shards.

    BF16 tensors are `np.uint16` arrays of raw bits (see lily.checkpoint.safetensors_mmap).
    `locations`
    gives each tensor's shard file and absolute byte offset; `shards` keeps each shard's map
    (`Shard.buffer` spans the whole file) so a device can wrap a shard without copying it.
    """

    path: Path
    config: ModelConfig
    tensors: Mapping[str, np.ndarray]
    locations: Mapping[str, TensorInfo]
    shards: Mapping[Path, Shard]
    level: Literal["strict", "family"]
    # Tensors that do not start on a 16-byte boundary: a device cannot bind them in place, so
    # lily.engine.device_weights copies them into device memory. Empty for an aligned checkpoint.
    unaligned: frozenset[str] = frozenset()

    @property
    def has_mtp_head(self) -> bool:
        """Whether the checkpoint carries the multi-token-prediction head (`mtp.*`, validated
        whole on load), which speculative decoding can draft with."""
        return has_mtp_head(self.locations)


def load_checkpoint(
    path: str | Path,
    level: LoadLevel = "auto",
    unaligned: Literal["copy", "refuse"] = "copy",
    allow_external_links: bool | None = None,
) -> Checkpoint:
    """Open and validate the checkpoint in a directory.

    `level`: "strict" (the real model), "family" (same architecture, any size), or "auto"
    (strict if the config has the real model's dimensions, else family). `unaligned`: tensors
    not on 16-byte boundaries (mlx writes them so) are listed in `Checkpoint.unaligned` to be
    copied to the device ("copy"), or make loading fail ("refuse"). Files must stay inside the
    directory (see lily.checkpoint.files); `allow_external_links=True` (default: the
    `LILY_ALLOW_EXTERNAL_LINKS` environment variable) also follows links leading elsewhere.
    """
    path = Path(path)
    if level not in ("strict", "family", "auto"):
        raise ValueError(f"level must be 'strict', 'family' or 'auto', not {level!r}")
    if unaligned not in ("copy", "refuse"):
        raise ValueError(f"unaligned must be 'copy' or 'refuse', not {unaligned!r}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = load_config(path, allow_external_links)
    for name in COMPANION_FILES:
        if os.path.lexists(path / name):
            _check_regular(checkpoint_file(path, name, allow_external_links))
    if level == "auto":
        level = "strict" if claims_real_model(config) else "family"
    files = open_safetensors_dir(
        path, 1 if unaligned == "copy" else DATA_ALIGNMENT, allow_external_links
    )
    locations = files.infos
    validate(config, locations, level)
    return Checkpoint(
        path=path,
        config=config,
        tensors=files,
        locations=locations,
        shards=files.shards,
        level=level,
        unaligned=frozenset(n for n, info in locations.items() if info.offset % DATA_ALIGNMENT),
    )


def write_aligned_checkpoint(
    source: str | Path,
    destination: str | Path,
    progress: Callable[[int], object] | None = None,
    allow_external_links: bool | None = None,
) -> Path:
    """Copy a checkpoint directory with every shard rewritten 16-byte aligned.

    Files written by mlx (mlx-lm conversions, mlx-community uploads) pack the header and the
    tensors without padding, so their tensors generally do not start on 16-byte boundaries and
    a device cannot bind them in place (it would copy them at every load). The copy holds the
    same tensors; other regular files are copied as they are.
    """
    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for item in _copied_files(source, allow_external_links):
        if item.suffix == ".safetensors":
            write_aligned_copy(item, destination / item.name, progress=progress)
        else:
            _copy_regular(item, destination / item.name)
    return destination


def default_checkpoint_status() -> str:
    """Whether the pinned revision of the default repo is in the Hugging Face cache, as one line
    for `lily info` and `lily doctor` (looked up on disk only: it never downloads)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    label = f"{DEFAULT_REPO}@{DEFAULT_REVISION[:10]}"
    path = (
        Path(constants.HF_HUB_CACHE)
        / repo_folder_name(repo_id=DEFAULT_REPO, repo_type="model")
        / "snapshots"
        / DEFAULT_REVISION
    )
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return f"{label}: not downloaded (the first `lily.load()` fetches it)"
    shards = set(json.loads(index.read_text())["weight_map"].values())
    missing = sum(not (path / name).is_file() for name in shards)
    if missing:
        return f"{label}: partly downloaded at {path} ({missing} of {len(shards)} shards missing)"
    size = sum((path / name).stat().st_size for name in shards)
    return f"{label}: cached at {path} ({size / 2**30:.1f} GiB)"
