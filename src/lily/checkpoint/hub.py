"""Is the Hugging Face Hub reachable? One quick request, asked before a download. And the
downloads Lily makes besides the checkpoint: the real model's multi-token-prediction head, and
the DFlash drafter (docs/dflash.md).

Without a network, `huggingface_hub` retries for about 25 seconds and then fails with a long
chain of connection errors. One request with a short timeout (through the same proxies,
`HTTPS_PROXY` and friends, and to the same `HF_ENDPOINT`) tells Lily at once to look in the
local cache only, and to say how to get the checkpoint when it is not there.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lily.checkpoint.config import ModelConfig

# Long enough for a slow link to answer a HEAD request, far shorter than the Hub client's retries.
PROBE_TIMEOUT_SECONDS = 5.0


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_reachable(timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """True when the Hub's endpoint answers at all (any HTTP status counts as an answer)."""
    request = urllib.request.Request(hub_endpoint(), method="HEAD")
    # A fresh opener reads the proxy variables now (`urlopen` caches the first ones it saw).
    opener = urllib.request.build_opener()
    try:
        with opener.open(request, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):  # no route, no name resolution, refused, timed out, bad URL
        return False


def download_hint(repo: str, revision: str | None) -> str:
    """How to get a checkpoint onto this machine without Lily downloading it."""
    pinned = f" --revision {revision}" if revision else ""
    return (
        f"download it once with `hf download {repo}{pinned}` where there is a network, or pass "
        "a local checkpoint directory as the model (`--model DIR`, `lily.load(DIR)`); the demo "
        "model (`--model demo`) needs no download"
    )


class _HubFiles:
    """Files of one Hub repository at one revision, through the Hugging Face cache (its local
    copy only when HF_HUB_OFFLINE is set or the Hub cannot be reached). A file missing from the
    local cache raises a CheckpointError saying what it makes (`what`), the `hf download`
    command that fetches it where there is a network (of that file alone when `file_by_file`,
    else of the repository), and how to do without it (`instead`)."""

    def __init__(
        self, repo: str, revision: str | None, what: str, instead: str, file_by_file: bool
    ) -> None:
        self.repo, self.revision = repo, revision
        self.what, self.instead, self.file_by_file = what, instead, file_by_file
        self.offline = bool(os.environ.get("HF_HUB_OFFLINE"))
        self.local_only = self.offline or not hub_reachable()

    def download(self, filename: str, may_be_absent: bool = False) -> Path:
        """The file's path in the cache. With `may_be_absent`, a file the repository does not
        have raises huggingface_hub's EntryNotFoundError, for the caller to do without it."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
        )

        from lily.checkpoint.safetensors_mmap import CheckpointError

        repo = self.repo
        try:
            return Path(
                hf_hub_download(
                    repo, filename, revision=self.revision, local_files_only=self.local_only
                )
            )
        except LocalEntryNotFoundError:
            why = "HF_HUB_OFFLINE is set" if self.offline else f"{hub_endpoint()} cannot be reached"
            pinned = f" --revision {self.revision}" if self.revision else ""
            command = f"hf download {repo}{pinned}" + (f" {filename}" if self.file_by_file else "")
            raise CheckpointError(
                f"{self.what} comes from {filename} of {repo}, which is not in the local Hugging "
                f"Face cache, and {why}: download it once with `{command}`, or {self.instead}"
            ) from None
        except (HFValidationError, OSError) as e:
            if may_be_absent and isinstance(e, EntryNotFoundError):
                raise
            raise CheckpointError(f"could not download {filename} of {repo}: {e}") from e


# Where the real model's multi-token-prediction head comes from: the original (bf16) release,
# whose shards hold `mtp.*` (mlx-community's 4-bit conversion dropped it).
MTP_SOURCE_REPO = "Qwen/Qwen3.6-35B-A3B"


def fetch_mtp_head(
    num_experts: int, repo: str = MTP_SOURCE_REPO, revision: str | None = None
) -> Path:
    """A directory in Lily's cache holding the MTP head of `repo` quantized into Lily's sidecar
    shard (lily.checkpoint.mtp), made once: the repo's index says which shards hold `mtp.*`,
    only those are downloaded (through the Hugging Face cache, with its progress bars), and the
    head's tensors are read from them and quantized. Raises CheckpointError, saying what to do,
    when the Hub cannot be reached and the shards are not in the local cache, or when the
    repo has no head."""
    from lily.checkpoint.cache import build_once, cache_root
    from lily.checkpoint.demo import write_safetensors
    from lily.checkpoint.mtp import MTP_SHARD, is_mtp, quantize_mtp_head
    from lily.checkpoint.safetensors_mmap import INDEX_FILE, CheckpointError, Shard

    target = cache_root() / "mtp" / f"{repo.replace('/', '--')}-{revision or 'main'}"
    if (target / MTP_SHARD).is_file():
        return target
    files = _HubFiles(
        repo,
        revision,
        "the MTP head",
        "load with speculative='ngram' (or 'off') to do without the head",
        file_by_file=True,
    )
    download = files.download
    index = json.loads(download(INDEX_FILE).read_text())
    weight_map = index.get("weight_map", {}) if isinstance(index, dict) else {}
    shards = sorted({shard for name, shard in weight_map.items() if is_mtp(name)})
    if not shards:
        raise CheckpointError(f"{repo} has no multi-token-prediction head (no mtp.* in its index)")
    print(
        f"lily: fetching the multi-token-prediction head from {repo} ({len(shards)} of its "
        f"shards hold it) and quantizing it to 4-bit into {target} (once)",
        file=sys.stderr,
    )
    original: dict[str, np.ndarray] = {}
    for shard_name in shards:
        shard = Shard(download(shard_name), alignment=1)
        original.update({n: shard.array(n) for n in shard.tensors if is_mtp(n)})
    head = quantize_mtp_head(original, num_experts)

    def write(out: Path) -> None:
        out.mkdir(parents=True)
        write_safetensors(out / MTP_SHARD, head, {"format": "mlx", "source": repo})

    return build_once(target, write)


def fetch_dflash(target: ModelConfig, repo: str | None = None, revision: str | None = None) -> Path:
    """A directory in Lily's cache holding the DFlash drafter of `repo` (default DFLASH_REPO at
    DFLASH_REVISION) as Lily's sidecar (lily.checkpoint.dflash: its config.json and its tensors
    quantized to 8 bits), made once from the repo's config.json and safetensors (one file, or
    the shards its index names) through the Hugging Face cache, and checked against `target`.
    Raises CheckpointError, naming the `hf download` command, when the Hub cannot be reached
    and the files are not in the local cache; ConfigError or CheckpointError naming what
    differs when the drafter does not fit `target`."""
    from huggingface_hub.errors import EntryNotFoundError

    from lily.checkpoint.cache import build_once, cache_root
    from lily.checkpoint.dflash import (
        DFLASH_REPO,
        DFLASH_REVISION,
        DFLASH_SHARD,
        check_against_target,
        parse_dflash_config,
        quantize_dflash,
        write_dflash,
    )
    from lily.checkpoint.safetensors_mmap import INDEX_FILE, CheckpointError, Shard

    if repo is None:
        repo, revision = DFLASH_REPO, revision or DFLASH_REVISION
    directory = cache_root() / "dflash" / f"{repo.replace('/', '--')}-{revision or 'main'}"
    if (directory / DFLASH_SHARD).is_file():
        return directory  # load_dflash checks it against the target
    files = _HubFiles(
        repo,
        revision,
        "the DFlash drafter",
        "load without speculative='dflash'",
        file_by_file=False,
    )
    download = files.download
    raw = json.loads(download("config.json").read_text())
    if not isinstance(raw, dict):
        raise CheckpointError(f"the config.json of {repo} is not a JSON object")
    config = parse_dflash_config(raw)
    check_against_target(config, target)
    try:
        index = json.loads(download(INDEX_FILE, may_be_absent=True).read_text())
        shards = sorted(set(index.get("weight_map", {}).values()))
    except EntryNotFoundError:  # one file, no index
        shards = ["model.safetensors"]
    print(
        f"lily: fetching the DFlash drafter {repo} and quantizing it to 8-bit into {directory} "
        "(once)",
        file=sys.stderr,
    )
    original: dict[str, np.ndarray] = {}
    for shard_name in shards:
        shard = Shard(download(shard_name), alignment=1)
        original.update({n: shard.array(n) for n in shard.tensors})
    tensors = quantize_dflash(original, config)
    return build_once(directory, lambda out: write_dflash(out, raw, tensors, repo))
