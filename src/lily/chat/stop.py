"""Stop strings: end generation at the first occurrence of any of them, without emitting it.

A stop string can be split across tokens (and so across the text pieces fed here), so the end
of the text is held back while it could still be the start of a stop string, and only for as
long as that: the held-back part is the longest suffix that is a proper prefix of some stop
string, never more.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`.

    That suffix may turn into a marker once more text arrives, so streaming parsers hold it
    back; everything before it can be emitted.
    """
    markers = tuple(markers)
    longest = max((len(m) for m in markers), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        tail = text[-length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0


class StopStringMatcher:
    """Filters a stream of text pieces, cutting it before the first stop string.

    `feed` returns the text that is safe to emit now. Once a stop string is found, `stopped` is
    true, `matched` names it, and everything from it on is dropped. If the stream ends without a
    stop, `flush` returns the held-back tail.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        self.stopped = False
        self.matched: str | None = None
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of `held + text` that can no longer be the start of a stop string."""
        if self.stopped:
            return ""
        if not self.stop_strings:
            return text
        buffer = self._held + text
        cut, matched = len(buffer), None
        for stop in self.stop_strings:
            # Stop strings may overlap; the one that starts first wins.
            at = buffer.find(stop)
            if 0 <= at < cut:
                cut, matched = at, stop
        if matched is not None:
            self.stopped, self.matched, self._held = True, matched, ""
            return buffer[:cut]
        hold = partial_marker_length(buffer, self.stop_strings)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
