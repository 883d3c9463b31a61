"""The hook through which something outside the sampler (a grammar, a forced tool call) limits
which tokens a generation may draw: `TokenConstraint`, and the bitmask it speaks.

Before every draw the engine asks the constraint for the allowed tokens; the sampler then treats
every other token as if its logit were -inf (not the greedy choice, not counted by top-k, top-p
or min-p, never drawn). Log-probabilities stay those of the model's own distribution. After the
draw the engine tells the constraint which token was taken. On a device the next step can only
be queued once the token is known, so a constrained generation runs one pass at a time.

Speculative decoding draws several tokens in one verify pass, row i after the first i drafted
tokens, so it needs the constraint's mask after each draft before any is accepted: the engine
asks and tells the constraint along the drafts as if they had been drawn, then takes back with
`rollback` those the pass did not accept. The constraint so goes through exactly the calls, in
the same order, that plain decoding of the accepted tokens makes.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from lily.errors import RequestError

MASK_WORD_BITS = 32


class TokenConstraint(Protocol):
    def allowed_tokens(self) -> np.ndarray | None:
        """The tokens the next draw may take: a uint32 bitmask of ceil(vocab/32) words (bit
        i % 32 of word i // 32 set = token i allowed), or None for no constraint on this draw."""
        ...

    def consume(self, token: int) -> None:
        """The token that was drawn (called for every generated token, in order)."""
        ...

    def rollback(self, tokens: int) -> None:
        """Takes back the last `tokens` consumed (at most a verify pass's drafts,
        `model_graph.MAX_DRAFT_TOKENS`): the constraint is then as it was just before the first
        of them was consumed."""
        ...


class NoAllowedTokenError(RequestError):
    """A constraint's mask allows none of the tokens the model can produce: no draw is
    possible, so the generation stops instead of emitting a token the constraint forbids."""

    def __init__(self, position: int):
        super().__init__(
            f"the constraint allows no token at position {position}", code="no_allowed_token"
        )
        self.position = position


def mask_words(vocab: int) -> int:
    """The uint32 words of a bitmask over `vocab` tokens."""
    return -(-vocab // MASK_WORD_BITS)


def mask_from_tokens(tokens: object, vocab: int) -> np.ndarray:
    """The bitmask allowing exactly `tokens` (ids below `vocab`)."""
    allowed = np.zeros(mask_words(vocab) * MASK_WORD_BITS, bool)
    allowed[np.asarray(tokens, np.int64)] = True
    return np.packbits(allowed, bitorder="little").view(np.uint32).copy()


def allowed_flags(mask: np.ndarray, vocab: int) -> np.ndarray:
    """Bool [vocab]: whether each token is allowed by `mask`."""
    bits = np.unpackbits(np.asarray(mask, np.uint32).view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def checked_mask(
    mask: np.ndarray, vocab: int, position: int, also: np.ndarray | None = None
) -> np.ndarray:
    """`mask` as the sampler reads it: its first `mask_words(vocab)` words (a mask must have at
    least those; later words are ignored) with the bits at or past `vocab` cleared, so that
    no padding row of the lm_head can be drawn, and intersected with the mask `also` if
    given. Refuses a mask that allows no token."""
    mask = np.asarray(mask)
    words = mask_words(vocab)
    if mask.dtype != np.uint32 or mask.ndim != 1 or mask.size < words:
        raise ValueError(
            f"a token mask is at least {words} uint32 words, got {mask.dtype} {mask.shape}"
        )
    checked = mask[:words].copy()
    if vocab % MASK_WORD_BITS:
        checked[-1] &= np.uint32((1 << (vocab % MASK_WORD_BITS)) - 1)
    if also is not None:
        checked &= also
    if not checked.any():
        raise NoAllowedTokenError(position)
    return checked


def ban_mask(banned: list[int], vocab: int) -> np.ndarray | None:
    """The mask allowing every token but `banned` (None when nothing is banned)."""
    if not banned:
        return None
    allowed = np.ones(vocab, bool)
    allowed[banned] = False
    return checked_mask(mask_from_tokens(np.flatnonzero(allowed), vocab), vocab, position=0)


def draw_mask(
    constraint: TokenConstraint | None, bans: np.ndarray | None, vocab: int, position: int
) -> np.ndarray | None:
    """The mask of the draw of the token at `position`: the constraint's (asked now), less the
    banned tokens; None when neither limits the draw."""
    allowed = None if constraint is None else constraint.allowed_tokens()
    if allowed is None:
        return bans
    return checked_mask(allowed, vocab, position, also=bans)
