"""Speculative decoding's host side: where drafted tokens come from, and when a source pays.

A verify pass (`ModelGraph.verify_graph`) runs the model over the last accepted token and k
drafted tokens at once: row i of its logits is what the model predicts after the draft's first
i tokens. On the device, the decode step's sampler draws one token per row (row i with the
random numbers of its own position, the drafts before it counted for the penalties), and
`accept_drafts` (sampling.metal) keeps the drafted token of row i while row i's draw agrees,
then adds the draw of the first row that disagrees (or of the row after the last draft when
all agree). Every token it returns is therefore one the model's sampler draws from the same
logits, so drafting never changes what is generated, only how many tokens one pass yields:

- greedy: a draw is the argmax (ties to the lowest id), so the accepted drafts are the longest
  prefix matching the model's greedy tokens;
- sampling: this is the standard speculative rule for a deterministic draft (one that proposes
  token x with probability 1): x is accepted with probability p(x) under the model's processed
  distribution (adjustments, mask, temperature, filters), the chance that the row's draw is x,
  and a rejected row yields its draw, which given that it is not x is distributed as p with x
  removed and renormalised. A token is thus x with probability p(x) and y != x with
  probability (1 - p(x)) p(y) / (1 - p(x)) = p(y): exactly the model's distribution. The
  random numbers are keyed by (seed, position), so a seed reproduces a run.

Drafts come from a `Drafter`; `Speculation` is the one a generation uses: the checkpoint's
multi-token-prediction head (`mtp`: the engine runs it, see docs/architecture.md), prompt
lookup (`ngram`: the continuation of the longest recent n-gram of the prompt and output so far
that occurred earlier), a client's prediction (OpenAI's Predicted Outputs), or several, with
the counts a response reports and the "auto" policy that stops drafting when it does not pay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from lily.engine.model_graph import MAX_DRAFT_TOKENS

# What `lily.load(speculative=...)` accepts: "auto" drafts with the checkpoint's MTP head when it
# has one, else with prompt lookup; it never chooses the DFlash drafter (a separate download
# whose acceptance on this model is unmeasured, docs/dflash.md).
SPECULATIVE_MODES = ("auto", "mtp", "ngram", "dflash", "off")
DEFAULT_DRAFT_TOKENS = 4
# Prompt lookup matches the last 2 to 4 tokens; a single token matches too often by chance.
LOOKUP_MIN_N, LOOKUP_MAX_N = 2, 4
# "auto" judges a source after this many verify passes: it drops it when they yielded fewer
# tokens than they cost in decode steps (`Speculation.pass_cost`).
AUTO_PASSES = 4
# ... and before that as soon as its passes cost this many decode steps more than they yielded:
# what trying a source may lose (a pass of the demo's head, accepting nothing, measured 3 to 12
# steps on the sim).
AUTO_MAX_LOSS = 2.0
# ... and lets the head or prompt lookup draft one token in its first pass, then twice as many
# after a pass that kept all it drafted (up to `draft_tokens`), one more than it kept after
# one that did not: a source that does not pay costs a pass of one draft, not of all of them.
AUTO_FIRST_DRAFTS = 1
# ... and drops prompt lookup after this many lookups in a row found nothing: a generation that
# drafts runs one pass at a time, and one that never drafts is better off pipelined.
AUTO_IDLE_LOOKUPS = 32
# ... and carries its verdicts over to a model's later generations (`DraftingHistory`): a source
# it dropped sits out the next generation, twice as many after each further drop, at most this
# many. Trying the head is not free even before its first pass (it runs over the whole prompt,
# and the prompt's chunks run one at a time for it), so a head that never pays on this model's
# text must not be tried on every request; yet text changes, so it is tried again.
AUTO_MAX_REST = 32


def check_speculative(mode: str, draft_tokens: int) -> None:
    """Refuses a speculative mode or draft length `lily.load` cannot honour, by name."""
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}; got {mode!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int):
        raise ValueError(f"draft_tokens must be an integer, got {draft_tokens!r}")
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, got {draft_tokens}")


def lookup(
    context: Sequence[int],
    corpus: Sequence[int],
    limit: int,
    min_n: int,
    max_n: int,
    prefer_from: int | None = None,
) -> tuple[int, list[int]]:
    """(where in `corpus` they start, up to `limit` tokens) that followed in `corpus` the
    longest n-gram (n from `max_n` down to `min_n`) that `context` ends with; (0, []) when none
    occurs. Among the occurrences, the first whose continuation starts at `prefer_from` or
    later, else the latest. The corpus may be the context itself: its own ending, having no
    continuation, is no occurrence."""
    tokens = np.asarray(corpus, np.int64)
    if limit < 1:
        return 0, []
    for n in range(min(max_n, len(context), len(tokens) - 1), min_n - 1, -1):
        tail = np.asarray(context[-n:], np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(tokens, n)
        starts = np.flatnonzero((windows == tail).all(axis=1)) + n
        starts = starts[starts < len(tokens)]
        if not starts.size:
            continue
        later = starts[starts >= prefer_from] if prefer_from is not None else starts[:0]
        start = int(later[0] if later.size else starts[-1])
        return start, [int(t) for t in tokens[start : start + limit]]
    return 0, []


class NgramIndex:
    """Prompt lookup over a growing context in constant time per token: for each n-gram
    length, where the latest occurrence of each n-gram was followed. The same answer as
    `lookup(context, context, ...)`, without scanning the context at every draft."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed: list[int] = []

    def _extend(self, context: Sequence[int]) -> None:
        known = len(self._indexed)
        if known > len(context) or (known and context[known - 1] != self._indexed[-1]):
            self._after.clear()  # not the context indexed so far: start again
            self._indexed, known = [], 0
        self._indexed.extend(int(t) for t in context[known:])
        tokens = self._indexed
        # The n-gram ending just before position j is followed by token j: new for j >= known.
        for j in range(max(known, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self._after[tuple(tokens[j - n : j])] = j

    def draft(self, context: Sequence[int], limit: int) -> list[int]:
        self._extend(context)
        tokens = self._indexed
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + limit]
        return []


@dataclass(frozen=True)
class HeadDrafts:
    """`count` drafts of the MTP head that the engine takes on the device, in the verify pass's
    own submission (`ModelGraph.mtp_draft_graph`): the host learns them after the pass."""

    count: int

    def __len__(self) -> int:
        return self.count


class Drafter(Protocol):
    def draft(self, tokens: Sequence[int], limit: int) -> list[int] | HeadDrafts:
        """Up to `limit` tokens guessed to follow `tokens` (the prompt and the output so far),
        or the head's drafts the engine is to take on the device."""
        ...

    def verified(self, drafted: Sequence[int], accepted: int) -> None:
        """The last drafts' outcome: the first `accepted` of `drafted` were accepted."""
        ...

    @property
    def exhausted(self) -> bool:
        """Whether `draft` will return nothing for the rest of the generation."""
        ...


class Prediction(Protocol):
    """A client's guess at the reply (OpenAI's Predicted Outputs) as a draft source: it drafts
    where the reply so far lines up with the guess, nothing elsewhere. `PredictedTokens` lines
    them up by token ids; the chat layer's `PredictedText` by text."""

    @property
    def token_count(self) -> int:
        """The prediction's length in tokens, which OpenAI's accepted and rejected counts share."""
        ...

    @property
    def appeared_tokens(self) -> int:
        """OpenAI's accepted prediction tokens: those that appeared in the reply so far."""
        ...

    @property
    def from_reply_start(self) -> bool:
        """Whether it is expected to draft from the reply's first tokens on, rather than only
        after something it cannot draft (a think block)."""
        ...

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens of the prediction expected after `tokens` (the prompt and the
        reply so far); none where the reply does not line up with it."""
        ...

    def verified(self, accepted: int) -> None:
        """The last drafts' outcome: the first `accepted` were accepted."""
        ...


@dataclass
class PredictedTokens:
    """A prediction as token ids, lined up with the reply by looking the reply's last tokens up
    in `anchor` + `prediction` (the anchor: the tokens that precede the prediction in the
    reply, e.g. the end of the think block)."""

    prediction: Sequence[int]
    anchor: Sequence[int] = ()
    _corpus: list[int] = field(default_factory=list)
    # Where in anchor + prediction the reply is expected to continue.
    _pointer: int = 0
    _drafted_from: int = 0
    _accepted: int = 0

    def __post_init__(self) -> None:
        self._corpus = [*self.anchor, *self.prediction]

    @property
    def token_count(self) -> int:
        return len(self.prediction)

    @property
    def from_reply_start(self) -> bool:
        return True  # looked up wherever the reply is

    @property
    def appeared_tokens(self) -> int:
        """Those verify passes accepted: the reply's tokens that equal the prediction's where
        the model's own token continues it too are not counted."""
        return self._accepted

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        start, drafts = lookup(
            tokens, self._corpus, limit, LOOKUP_MIN_N, LOOKUP_MAX_N, self._pointer
        )
        self._drafted_from = start
        return drafts

    def verified(self, accepted: int) -> None:
        self._pointer = self._drafted_from + accepted
        self._accepted += accepted


@dataclass
class SourceCounts:
    """One draft source's verified tokens over a generation."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class Speculation:
    """The drafter of one generation: the MTP head when `mtp`, the DFlash drafter when
    `dflash`, prompt lookup when `ngram`, the client's `prediction` when given, at most
    `draft_tokens` per pass. Prediction drafts come first: they are the client's knowledge of
    the answer; then the DFlash drafter's, the head's, then lookup's. With `auto`, the head or
    prompt lookup stops for the rest of the generation once, after its first AUTO_PASSES
    passes, its passes have yielded fewer tokens (accepted drafts and the model's own token)
    than they cost, each pass costing `pass_cost(drafts)` decode steps
    (`model_graph.verify_cost_ratio`: a pass of 4 drafts on the real model pays above about 2.3
    tokens); lookup also stops once AUTO_IDLE_LOOKUPS lookups in a row found nothing
    (a prediction is never dropped: the client asked for it). The head's drafts come from
    `head` (up to n greedy drafts after the newest token, or `HeadDrafts` the engine takes on
    the device), which the engine running it sets for the generation; without it the head
    drafts nothing."""

    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    mtp: bool = False
    head: Callable[[int], list[int] | HeadDrafts] | None = None
    # The DFlash drafter (docs/dflash.md): `block` gives up to n greedy drafts after the
    # newest token, set by the engine running it for the generation.
    dflash: bool = False
    block: Callable[[int], list[int]] | None = None
    ngram: bool = False
    prediction: Prediction | None = None
    auto: bool = False
    # Decode steps' time a verify pass of n drafts costs; "auto" needs it.
    pass_cost: Callable[[int], float] | None = None
    counts: dict[str, SourceCounts] = field(default_factory=dict)
    _costs: dict[str, float] = field(default_factory=dict)  # each source's passes' total cost
    _last_source: str | None = None
    _index: NgramIndex = field(default_factory=lambda: NgramIndex(LOOKUP_MIN_N, LOOKUP_MAX_N))
    _idle_lookups: int = 0  # prompt lookups in a row that found nothing
    _limits: dict[str, int] = field(default_factory=dict)  # under auto: the next pass's drafts

    def __post_init__(self) -> None:
        if self.auto and self.pass_cost is None:
            raise ValueError("auto drafting weighs what passes cost: give pass_cost")
        if self.prediction is not None:
            self.counts["prediction"] = SourceCounts()
        if self.mtp:
            self.counts["mtp"] = SourceCounts()
        if self.dflash:
            self.counts["dflash"] = SourceCounts()
        if self.ngram:
            self.counts["ngram"] = SourceCounts()

    def _pays(self, source: str) -> bool:
        """Whether `source` drafts: asked for, and under "auto" accepted often enough so far."""
        if source not in self.counts:
            return False
        if not self.auto:
            return True
        counts = self.counts[source]
        if counts.passes == 0:
            return True
        yielded = counts.accepted + counts.passes  # each pass adds the model's own token
        cost = self._costs[source]
        if cost - yielded >= AUTO_MAX_LOSS:
            return False
        return counts.passes < AUTO_PASSES or yielded >= cost

    def _lookup_enabled(self) -> bool:
        if self.auto and self._idle_lookups >= AUTO_IDLE_LOOKUPS:
            return False
        return self._pays("ngram")

    def _head_enabled(self) -> bool:
        return self.head is not None and self._pays("mtp")

    def _block_enabled(self) -> bool:
        return self.block is not None and self._pays("dflash")

    def verdict(self, source: str) -> bool | None:
        """Under auto, whether `source` paid in this generation: False if it was dropped for
        not paying, True if it paid through its first AUTO_PASSES passes, None if it was not
        judged (not asked for, or too few passes)."""
        if not self.auto or source not in self.counts:
            return None
        if not self._pays(source):
            return False
        return True if self.counts[source].passes >= AUTO_PASSES else None

    @property
    def head_drafts(self) -> bool:
        """Whether the head may draft again in this generation (the engine runs it over each
        pass's rows only while it may)."""
        return self._head_enabled()

    @property
    def exhausted(self) -> bool:
        """Whether nothing will be drafted for the rest of the generation."""
        return (
            self.prediction is None
            and not self._block_enabled()
            and not self._head_enabled()
            and not self._lookup_enabled()
        )

    def draft(self, tokens: Sequence[int], limit: int) -> list[int] | HeadDrafts:
        limit = min(limit, self.draft_tokens)
        self._last_source = None
        if self.prediction is not None:
            drafts = self.prediction.draft(tokens, limit)
            if drafts:
                self._last_source = "prediction"
                return drafts[:limit]
        if self._block_enabled():
            assert self.block is not None
            drafts = self.block(limit)
            if drafts:
                self._last_source = "dflash"
                return drafts[:limit]
        if self._head_enabled():
            assert self.head is not None
            drafts = self.head(self._limit("mtp", limit))
            if drafts:
                self._last_source = "mtp"
                return drafts
        if self._lookup_enabled():
            drafts = self._index.draft(tokens, self._limit("ngram", limit))
            self._idle_lookups = 0 if drafts else self._idle_lookups + 1
            if drafts:
                self._last_source = "ngram"
                return drafts
        return []

    def head_drafts_ahead(self, limit: int) -> int:
        """How many drafts the head makes (at most `limit`) for a pass the engine queues behind
        a pass of the head's drafts that the host has not read, taking them on the device: 0
        unless the next drafts would be the head's whatever that pass keeps (no prediction, no
        DFlash drafter, the head drafting). The count and, under "auto", whether the head still
        drafts, come from the passes read so far: one pass late."""
        if self.prediction is not None or self._block_enabled() or not self._head_enabled():
            return 0
        self._last_source = "mtp"
        return self._limit("mtp", min(limit, self.draft_tokens))

    def _limit(self, source: str, limit: int) -> int:
        """How many drafts `source` may make now: under auto, as far as it has earned."""
        if not self.auto:
            return limit
        return min(limit, self._limits.get(source, AUTO_FIRST_DRAFTS))

    def verified(self, drafted: Sequence[int], accepted: int) -> None:
        if self._last_source is None:
            return
        if self._last_source == "prediction":
            assert self.prediction is not None
            self.prediction.verified(accepted)
        elif self.auto:
            kept_all = accepted == len(drafted)
            grown = 2 * len(drafted) if kept_all else accepted + 1
            self._limits[self._last_source] = max(1, min(self.draft_tokens, grown))
        counts = self.counts[self._last_source]
        if self.pass_cost is not None:
            cost = self._costs.get(self._last_source, 0.0)
            self._costs[self._last_source] = cost + self.pass_cost(len(drafted))
        counts.passes += 1
        counts.drafted += len(drafted)
        counts.accepted += accepted

    @property
    def total(self) -> SourceCounts:
        """All sources' counts summed: what `lily bench` reports (it drafts from one source,
        but a generation with a prediction and the head or prompt lookup has two)."""
        return SourceCounts(
            passes=sum(c.passes for c in self.counts.values()),
            drafted=sum(c.drafted for c in self.counts.values()),
            accepted=sum(c.accepted for c in self.counts.values()),
        )

    @property
    def has_sources(self) -> bool:
        """Whether anything can draft: without, a generation decodes plainly (pipelined)."""
        return bool(self.counts)

    @property
    def accepted_prediction_tokens(self) -> int:
        """OpenAI's count: the prediction's tokens that appeared in the completion."""
        return 0 if self.prediction is None else self.prediction.appeared_tokens

    @property
    def rejected_prediction_tokens(self) -> int:
        """OpenAI's count: the prediction's tokens that did not appear in the completion."""
        if self.prediction is None:
            return 0
        return max(0, self.prediction.token_count - self.accepted_prediction_tokens)


class DraftingHistory:
    """What "auto" learned of the head and prompt lookup over one model's generations: a source
    dropped for not paying sits out the next generation, then twice as many after each further
    drop (at most AUTO_MAX_REST); one that paid is back to resting one generation at its next
    drop."""

    def __init__(self) -> None:
        self._resting: dict[str, int] = {}  # source -> generations it still sits out
        self._rest: dict[str, int] = {}  # source -> generations its next drop costs it

    def next_generation(self, last: Speculation | None) -> frozenset[str]:
        """The sources that sit out the next generation, once `last` (the generation before
        it, None for the first) is counted."""
        for source in list(self._resting):
            self._resting[source] -= 1
            if self._resting[source] == 0:
                del self._resting[source]
        for source in ("mtp", "ngram"):
            verdict = None if last is None else last.verdict(source)
            if verdict is False:
                rest = self._rest.get(source, 1)
                self._resting[source] = rest
                self._rest[source] = min(2 * rest, AUTO_MAX_REST)
            elif verdict is True:
                self._rest.pop(source, None)
        return frozenset(self._resting)
