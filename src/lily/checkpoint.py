"""Finding a checkpoint (local directory, Hugging Face repo, or the demo) and loading it.

Loading maps every shard read-only, validates names, shapes, dtypes and bit widths against the
config, and hands out the tensors as read-only numpy views: no weight bytes are read or copied.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from lily.cache import build_once, cache_root
from lily.config import ModelConfig, load_config
from lily.safetensors_mmap import (
    DATA_ALIGNMENT,
    INDEX_FILE,
    CheckpointError,
    Shard,
    TensorInfo,
    open_safetensors_dir,
    write_aligned_copy,
)
from lily.validate import claims_real_model, validate

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

# Only what Lily reads: weights, config, tokenizer and chat template (not the vision files).
DOWNLOAD_PATTERNS = [
    "*.safetensors",
    INDEX_FILE,
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
]

LoadLevel = Literal["strict", "family", "auto"]
# Disk left free after the aligned copy is written.
ALIGNED_COPY_MARGIN_BYTES = 10**9


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
        from lily.demo import demo_checkpoint_dir

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

    from lily.hub import download_hint, hub_endpoint, hub_reachable

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


def aligned_checkpoint(path: Path) -> Path:
    """`path` if every tensor of its shards is 16-byte aligned, else a cached aligned copy.

    mlx writes safetensors without padding, so mlx-community uploads and mlx-lm conversions
    generally have tensors at unaligned offsets, which the device cannot bind in place. The
    copy is made once (streamed, same tensors; it takes as much disk as the weights) under
    `$LILY_CACHE/aligned` (default `~/.cache/lily`), keyed by the source path and the shards'
    sizes and modification times. Without room for the copy (its size plus 1 GB), `path` itself
    is returned, saying so: the device then copies the unaligned tensors into its own memory at
    every load (see `Checkpoint.unaligned`), as the reference engine always does.
    """
    shards = sorted(path.glob("*.safetensors"))
    if all(_is_aligned(shard) for shard in shards):
        return path
    stats = [(s.name, s.stat().st_size, s.stat().st_mtime_ns) for s in shards]
    key = hashlib.sha256(json.dumps([str(path.resolve()), stats]).encode()).hexdigest()[:16]
    target = cache_root() / "aligned" / f"{path.name}-{key}"
    if target.is_dir():
        return target
    from huggingface_hub.utils import tqdm

    total = sum(size for _, size, _ in stats)
    free = free_disk_bytes(target.parent)
    if free < total + ALIGNED_COPY_MARGIN_BYTES:
        print(
            f"lily: {path} is not 16-byte aligned and its aligned copy needs {total / 1e9:.2f} "
            f"GB, but only {free / 1e9:.2f} GB are free at {target.parent}: loading it as it "
            "is, copying its tensors into memory at every load (slower to load). To make the "
            "copy once instead, free disk space or point LILY_CACHE at a disk with room.",
            file=sys.stderr,
        )
        return path
    print(
        f"lily: {path} is not 16-byte aligned; writing an aligned copy ({total / 1e9:.2f} GB) "
        f"to {target} (once)",
        file=sys.stderr,
    )
    with tqdm(total=total, unit="B", unit_scale=True, desc="aligning checkpoint") as bar:
        return build_once(target, lambda out: write_aligned_checkpoint(path, out, bar.update))


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint. `tensors` are read-only views over the memory-mapped shards.

    BF16 tensors are `np.uint16` arrays of raw bits (see lily.safetensors_mmap). `locations`
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
    # lily.device_weights copies them into device memory. Empty for an aligned checkpoint.
    unaligned: frozenset[str] = frozenset()


def load_checkpoint(
    path: str | Path,
    level: LoadLevel = "auto",
    unaligned: Literal["copy", "refuse"] = "copy",
) -> Checkpoint:
    """Open and validate the checkpoint in a directory.

    `level`: "strict" (the real model), "family" (same architecture, any size), or "auto"
    (strict if the config has the real model's dimensions, else family). `unaligned`: tensors
    not on 16-byte boundaries (mlx writes them so) are listed in `Checkpoint.unaligned` to be
    copied to the device ("copy"), or make loading fail ("refuse").
    """
    path = Path(path)
    if level not in ("strict", "family", "auto"):
        raise ValueError(f"level must be 'strict', 'family' or 'auto', not {level!r}")
    if unaligned not in ("copy", "refuse"):
        raise ValueError(f"unaligned must be 'copy' or 'refuse', not {unaligned!r}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = load_config(path)
    if level == "auto":
        level = "strict" if claims_real_model(config) else "family"
    files = open_safetensors_dir(path, alignment=1 if unaligned == "copy" else DATA_ALIGNMENT)
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
) -> Path:
    """Copy a checkpoint directory with every shard rewritten 16-byte aligned.

    Files written by mlx (mlx-lm conversions, mlx-community uploads) pack the header and the
    tensors without padding, so their tensors generally do not start on 16-byte boundaries and
    a device cannot bind them in place (it would copy them at every load). The copy holds the
    same tensors; other files are copied as is.
    """
    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if item.suffix == ".safetensors":
            write_aligned_copy(item, destination / item.name, progress=progress)
        elif item.is_file():
            shutil.copy2(item, destination / item.name)
    return destination
