"""Will a run fit in the GPU memory of this Mac? The arithmetic of the Metal memory preflight.

Metal's ``recommendedMaxWorkingSetSize`` is only Apple's approximation of what the GPU can use
without hurting performance. A run that needs more is stopped before anything is allocated,
with concrete advice: the ``iogpu.wired_limit_mb`` value that lets it run, or, when wiring that
much would leave macOS and other apps too little RAM, that it does not fit on this Mac.
``csrc/metal/metal_device.h`` computes the same message for the metal device's own check
(``tests/test_preflight.py`` compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
GIB = 2**30
# Headroom above the caller's estimate (Metal's own allocations, rounding).
WIRED_MARGIN_MIB = 1024


def system_reserve(physical: int) -> int:
    """Bytes of RAM left to macOS and other apps: 4 GiB, or an eighth of RAM on larger Macs."""
    return max(4 * GIB, physical // 8)


@dataclass(frozen=True)
class WiredPlan:
    """What a run of `needed` bytes asks of a Mac."""

    needed: int
    recommended: int
    physical: int

    @property
    def fits(self) -> bool:
        """Within Metal's recommended working set: nothing to do."""
        return self.needed <= self.recommended

    @property
    def wired_limit_mib(self) -> int:
        """The ``iogpu.wired_limit_mb`` value that lets the run wire what it needs."""
        return -(-self.needed // MIB) + WIRED_MARGIN_MIB

    @property
    def safe_limit_mib(self) -> int:
        """The largest wired limit that still leaves macOS its reserve."""
        return max(0, self.physical - system_reserve(self.physical)) // MIB

    @property
    def raisable(self) -> bool:
        """Runs after raising the wired limit, within the safe limit."""
        return self.wired_limit_mib <= self.safe_limit_mib


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


# spec/model.md section 1: layer i is full attention iff (i + 1) % 4 == 0.
REAL_ATTENTION_INTERVAL = 4


def real_kv_bytes_per_token(kv_cache: str) -> int:
    """The real model's KV cache per context token in the format `kv_cache` (what the memory
    preflight's estimate grows by per token of max_seq)."""
    from lily.checkpoint.validate import REAL_MODEL
    from lily.kernels.attention import cache_bytes

    layers = int(REAL_MODEL["num_hidden_layers"]) // REAL_ATTENTION_INTERVAL
    return 2 * layers * cache_bytes(int(REAL_MODEL["num_key_value_heads"]), 1, kv_cache)


def kv_cache_summary() -> str:
    """One line for `lily info`: the real model's KV cache per context token and at the
    model's longest context, in each format."""
    from lily.checkpoint.validate import REAL_MODEL
    from lily.kernels.attention import KV_CACHE_TYPES

    longest = int(REAL_MODEL["max_position_embeddings"])
    parts = [
        f"{kv_cache} {real_kv_bytes_per_token(kv_cache):,} B per token "
        f"({_gib(longest * real_kv_bytes_per_token(kv_cache))} at {longest:,})"
        for kv_cache in KV_CACHE_TYPES
    ]
    return "; ".join(parts)


def preflight_message(needed: int, recommended: int, physical: int) -> str:
    """Empty when `needed` bytes fit in Metal's `recommended` working set; otherwise the advice
    (the same text as the metal device's own check)."""
    plan = WiredPlan(needed, recommended, physical)
    if plan.fits:
        return ""
    message = (
        f"this run needs {_gib(needed)} of GPU memory, but Metal recommends at most "
        f"{_gib(recommended)} on this Mac (recommendedMaxWorkingSetSize). "
    )
    if not plan.raisable:
        return message + (
            f"It does not fit even with a raised limit: of this Mac's {_gib(physical)} of RAM, "
            f"at most {_gib(plan.safe_limit_mib * MIB)} can be wired safely (macOS and other "
            f"apps need {_gib(system_reserve(physical))}). Ask for less memory, for example a "
            "shorter maximum sequence length (max_seq) or an int8 KV cache (kv_cache='int8')."
        )
    left = physical - plan.wired_limit_mib * MIB
    return message + (
        "Ask for less memory (for example a shorter maximum sequence length, max_seq, or an int8 "
        "KV cache, kv_cache='int8'), or let the GPU wire more until the next reboot with:\n"
        f"  sudo sysctl iogpu.wired_limit_mb={plan.wired_limit_mib}\n"
        f"That is the need plus {WIRED_MARGIN_MIB} MiB of headroom, and leaves macOS and other "
        f"apps {_gib(left)} of the {_gib(physical)} of RAM; "
        "`sudo sysctl iogpu.wired_limit_mb=0` restores the default."
    )
