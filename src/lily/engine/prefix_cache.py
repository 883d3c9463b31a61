"""Which prompt prefixes an engine can resume from, and what it costs to keep them.

The Gated DeltaNet state cannot be trimmed back like a KV cache, so resuming after a prefix needs
a snapshot of the recurrent state (conv windows and GDN state) taken exactly there, plus the KV
rows [0, n) of the attention layers. A `PrefixCache` keeps several *cached sequences*, each with
its tokens, its recurrent-state snapshots at some positions, and its KV rows up to its last
snapshot:

- the *live* sequence's rows are the ones the engine's own KV cache holds: they are not copied
  until another sequence needs that cache (then they are copied out to host memory, and the
  other sequence's rows copied in);
- a prompt resumes from the longest snapshot it starts with in any sequence (token equality,
  always); on equal lengths the sequence named by `prompt_cache_key` wins, then the live one (no
  copy), then the most recent. A prompt that continues a sequence from its last snapshot extends
  it in place; one that branches off (an edited or regenerated message) starts a new sequence
  from the shared prefix, leaving the old one intact;
- every sequence is accounted as if its rows were on the host (the live one's will be, once
  another sequence is used), plus its snapshots; past `budget_bytes`, the least recently used
  snapshots are evicted (taken or resumed from: a conversation's old turns go before another
  conversation's last one), and with a sequence's last snapshot the sequence and its rows.

An engine talks to it through `LiveRows`, the host view of its KV cache. With a `DiskPrefixCache`
(`prefix_disk.py`), snapshots of long prefixes are also written to disk and read back after a
restart.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from lily.device import physical_memory
from lily.engine.prefix_disk import (
    DEFAULT_DISK_BYTES,
    DEFAULT_MIN_TOKENS,
    DiskPrefixCache,
    StateLayout,
)

if TYPE_CHECKING:
    from lily.checkpoint.loader import Checkpoint

logger = logging.getLogger("lily.engine.prefix_cache")

# Long prompts are also snapshotted at every multiple of this many tokens, so that a long shared
# prefix (a coding agent's system prompt) is reusable when what follows it differs. On the real
# model a snapshot is 63 MB and 4096 tokens of KV rows 80 MB.
DEFAULT_SNAPSHOT_INTERVAL = 4096
# No snapshot after fewer tokens: feeding them again costs less than keeping the state (a
# conversation's first message header, shared by every conversation, would otherwise be one).
MIN_SNAPSHOT_TOKENS = 8

# The default budget is half the memory left after the weights and the working KV cache, at
# most this much: host copies of KV rows share the unified memory with the GPU.
DEFAULT_MEMORY_CAP = 8 << 30

# Arrays of one state: a recurrent snapshot, or KV rows (one array per cache, tokens on axis 1).
Arrays = list[np.ndarray]


def default_cache_memory(device_bytes: int) -> int:
    """The memory budget when none is given: half of what this machine's memory leaves after
    `device_bytes` (weights and working KV cache), capped at DEFAULT_MEMORY_CAP."""
    physical = physical_memory() or 0  # unknown: keep nothing rather than guess
    return max(0, min(DEFAULT_MEMORY_CAP, (physical - device_bytes) // 2))


@dataclass(frozen=True)
class CacheOptions:
    """What `lily.load` and `lily serve` take to size the prefix cache (see their docs)."""

    cache_memory: int | None = None  # bytes; None: default_cache_memory
    cache_dir: str | Path | None = None  # None: nothing on disk
    cache_disk_size: int = DEFAULT_DISK_BYTES
    cache_disk_min_tokens: int = DEFAULT_MIN_TOKENS

    def build(
        self, checkpoint: Checkpoint, engine_kind: str, kv_bytes_per_token: int, working: int
    ) -> PrefixCache:
        """The cache for an engine whose state layout is `engine_kind`, which keeps `working`
        bytes on its device."""
        from lily.engine.prefix_disk import model_identity

        memory = default_cache_memory(working) if self.cache_memory is None else self.cache_memory
        disk = None
        if self.cache_dir is not None:
            try:
                identity = model_identity(checkpoint, engine_kind)
            except Exception as error:  # a shard that cannot be read again: no disk cache
                logger.warning("prefix cache: %s not used: %s", self.cache_dir, error)
            else:
                disk = DiskPrefixCache(
                    self.cache_dir, identity, self.cache_disk_size, self.cache_disk_min_tokens
                )
        return PrefixCache(memory, kv_bytes_per_token, disk=disk)


class LiveRows(Protocol):
    """The engine's KV cache, seen from the host."""

    def copy_out(self, tokens: int) -> Arrays:
        """Host copies of rows [0, tokens) of every KV cache array."""
        ...

    def copy_in(self, rows: Arrays, tokens: int) -> None:
        """Writes rows [0, tokens) of `rows` into the KV cache."""
        ...


@dataclass(eq=False)
class CachedSequence:
    tokens: list[int]  # up to its last snapshot: its KV rows cover exactly these
    snapshots: dict[int, Arrays] = field(default_factory=dict)  # position -> recurrent state
    rows: Arrays | None = None  # host copy of the KV rows; None while only the engine holds them
    key: str | None = None  # the prompt_cache_key of the request that last used it
    last_used: int = 0
    snapshot_used: dict[int, int] = field(default_factory=dict)  # position -> when last used

    def matches(self, prompt: Sequence[int], length: int) -> bool:
        return length <= len(self.tokens) and list(prompt[:length]) == self.tokens[:length]


@dataclass(frozen=True)
class PrefixMatch:
    """A prompt resumes after `length` tokens from `state` (the recurrent state there)."""

    length: int
    state: Arrays


class PrefixCache:
    def __init__(
        self,
        budget_bytes: int,
        kv_bytes_per_token: int,
        snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
        disk: DiskPrefixCache | None = None,
    ) -> None:
        """`kv_bytes_per_token`: the KV rows of one position, over all attention layers."""
        if budget_bytes < 0:
            raise ValueError(f"the cache budget must be >= 0 bytes, got {budget_bytes}")
        if snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1, got {snapshot_interval}")
        self.budget_bytes = budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.snapshot_interval = snapshot_interval
        self.disk = disk
        self.sequences: list[CachedSequence] = []
        # The sequence whose rows the engine's KV cache holds, cached or not (None: none).
        self._live: CachedSequence | None = None
        self._clock = itertools.count(1)
        # Snapshots of the current generation still to be written to disk (positions).
        self._to_disk: list[int] = []
        self.layout: StateLayout | None = None  # the engine's, once `set_layout` is told

    def set_layout(self, kv_cache: str, rows: Arrays, state: Arrays) -> None:
        """Tells the cache what the engine's states look like (the KV cache's format, KV rows
        of any length, a recurrent state): files on disk, and sequences given to
        `add_sequence`, are used only if they have exactly this layout."""
        self.layout = StateLayout.of(kv_cache, rows, state)
        if self.disk is not None:
            self.disk.layout = self.layout

    # -- accounting -----------------------------------------------------------------------------

    def sequence_bytes(self, sequence: CachedSequence) -> int:
        rows = len(sequence.tokens) * self.kv_bytes_per_token
        return rows + sum(_nbytes(state) for state in sequence.snapshots.values())

    @property
    def used_bytes(self) -> int:
        """What the cached sequences take, the live one's rows counted as if copied out."""
        return sum(self.sequence_bytes(s) for s in self.sequences)

    # -- lookup ---------------------------------------------------------------------------------

    def _best(self, prompt: Sequence[int], key: str | None) -> tuple[CachedSequence, int] | None:
        """The sequence and snapshot position of the longest reusable prefix of `prompt`,
        leaving at least one token to feed (the last one predicts the next)."""
        best: tuple[tuple[int, bool, bool, int], CachedSequence, int] | None = None
        for sequence in self.sequences:
            for length in sequence.snapshots:
                if length < len(prompt) and sequence.matches(prompt, length):
                    rank = (
                        length,
                        key is not None and sequence.key == key,
                        sequence is self._live,
                        sequence.last_used,
                    )
                    if best is None or rank > best[0]:
                        best = (rank, sequence, length)
        return None if best is None else (best[1], best[2])

    def cached_length(self, prompt: Sequence[int], key: str | None = None) -> int:
        """How many leading tokens of `prompt` `begin` would spare feeding. A longer prefix on
        disk is read now (and checked), and kept in memory for `begin`."""
        found = self._best(prompt, key)
        length = 0 if found is None else found[1]
        if self.disk is not None and self.budget_bytes > 0:
            try:
                entry = self.disk.load_longest(prompt, longer_than=length)
            except Exception:  # a cache: whatever goes wrong there costs a recompute only
                logger.exception("prefix cache: reading %s failed", self.disk.directory)
                entry = None
            if entry is not None and self._keep(entry.tokens, entry.rows, entry.state):
                length = len(entry.tokens)
        return length

    def add_sequence(self, tokens: Sequence[int], rows: Arrays, state: Arrays) -> bool:
        """Keeps a prefix the engine did not feed itself: `rows` [0, len(tokens)) of every KV
        cache array, in the engine's format, and the recurrent state after `tokens`, as
        `set_layout` described them. A later prompt starting with `tokens` resumes after them,
        as after a prefix the engine fed (`benchmarks/full_size_check.py --context` seeds a long
        context this way instead of feeding it). Returns whether the budget keeps it."""
        if self.layout is None:
            raise ValueError("the engine has not told the cache its state layout yet")
        if not self.layout.fits(len(tokens), rows, state):
            raise ValueError(
                f"these rows and state are not the engine's layout for {len(tokens)} tokens "
                f"({self.layout.kv_cache} KV cache)"
            )
        return self._keep(tokens, rows, state)

    def _keep(self, tokens: Sequence[int], rows: Arrays, state: Arrays) -> bool:
        sequence = CachedSequence(list(tokens), {len(tokens): state}, rows=rows)
        self._touch(sequence, len(tokens))
        self._insert(sequence)
        return sequence in self.sequences

    # -- one generation -------------------------------------------------------------------------

    def begin(
        self, prompt: Sequence[int], live: LiveRows, key: str | None = None, reuse: bool = True
    ) -> PrefixMatch | None:
        """Prepares the engine's KV cache for `prompt`: returns the snapshot to restore (with
        rows [0, its length) in place), or None to start from scratch. Until `end`, the
        snapshots `add_snapshot` receives belong to this prompt's sequence."""
        self._to_disk = []
        if reuse:
            self.cached_length(prompt, key)  # brings a longer prefix in from disk
        found = self._best(prompt, key) if reuse else None
        if found is None:
            self._copy_out_live(live)
            self._live = CachedSequence([], key=key)
            return None
        sequence, length = found
        if sequence is not self._live:
            self._copy_out_live(live)
            assert sequence.rows is not None
            live.copy_in(sequence.rows, length)
        if length == len(sequence.tokens):
            # It continues from the sequence's last snapshot: extend it in place.
            sequence.rows = None
            self._live = sequence
        else:
            # It branches off: the old sequence keeps its rows beyond `length` on the host.
            if sequence is self._live:
                self._copy_out_live(live)
            self._live = CachedSequence(list(prompt[:length]))
        self._live.key = key if key is not None else sequence.key
        self._touch(sequence, length)
        self._live.last_used = sequence.last_used
        return PrefixMatch(length, sequence.snapshots[length])

    def snapshot_positions(
        self, first: int, prompt_length: int, requested: Collection[int]
    ) -> list[int]:
        """Where a generation that feeds prompt positions [first, prompt_length) saves the
        recurrent state: the `requested` positions and every multiple of the snapshot interval
        inside that range (none before MIN_SNAPSHOT_TOKENS)."""
        interval = self.snapshot_interval
        periodic = range((first // interval + 1) * interval, prompt_length, interval)
        inside = {p for p in requested if max(first, MIN_SNAPSHOT_TOKENS - 1) < p < prompt_length}
        return sorted(inside.union(periodic)) if self.budget_bytes > 0 else []

    def add_snapshot(self, prompt: Sequence[int], length: int, state: Arrays) -> None:
        """The recurrent state after `prompt[:length]`, fed in the engine's KV cache now."""
        sequence = self._live
        if sequence is None:
            return
        sequence.tokens = list(prompt[:length])
        sequence.snapshots[length] = state
        self._touch(sequence, length)
        self._insert(sequence)
        if self.disk is not None and length >= self.disk.min_tokens:
            self._to_disk.append(length)

    def end(self, live: LiveRows) -> None:
        """The generation is over, the engine's KV cache still holds what it fed: writes the
        long prefixes it snapshotted to disk."""
        sequence = self._live
        if self.disk is None or sequence is None or sequence not in self.sequences:
            return
        for length in self._to_disk:
            if length in sequence.snapshots:
                try:
                    self.disk.save_in_background(
                        sequence.tokens[:length], live.copy_out(length), sequence.snapshots[length]
                    )
                except Exception:
                    logger.exception("prefix cache: writing to %s failed", self.disk.directory)
        self._to_disk = []

    def close(self) -> None:
        """Waits for the disk writes still under way."""
        if self.disk is not None:
            try:
                self.disk.flush()
            except Exception:
                logger.exception("prefix cache: writing to %s failed", self.disk.directory)

    # -- internals ------------------------------------------------------------------------------

    def _touch(self, sequence: CachedSequence, length: int) -> None:
        sequence.last_used = sequence.snapshot_used[length] = next(self._clock)

    def _copy_out_live(self, live: LiveRows) -> None:
        """Copies the live sequence's rows to the host before the KV cache is overwritten."""
        sequence = self._live
        if sequence is not None and sequence in self.sequences and sequence.rows is None:
            sequence.rows = live.copy_out(len(sequence.tokens))
        self._live = None

    def _insert(self, sequence: CachedSequence) -> None:
        """Adds `sequence` (if new), then evicts the least recently used snapshots until the
        cache fits its budget."""
        if sequence not in self.sequences:
            self.sequences.append(sequence)
        while self.sequences and self.used_bytes > self.budget_bytes:
            oldest, length = min(
                ((s, p) for s in self.sequences for p in s.snapshots),
                key=lambda found: found[0].snapshot_used[found[1]],
            )
            del oldest.snapshots[length], oldest.snapshot_used[length]
            if not oldest.snapshots:
                self.sequences.remove(oldest)
                continue
            # Rows past its last remaining snapshot are of no use.
            keep = max(oldest.snapshots)
            oldest.tokens = oldest.tokens[:keep]
            if oldest.rows is not None:
                oldest.rows = [r[:, :keep].copy() for r in oldest.rows]


def _nbytes(arrays: Arrays) -> int:
    return sum(a.nbytes for a in arrays)
