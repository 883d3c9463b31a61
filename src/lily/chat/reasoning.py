"""Separating the model's reasoning (`<think>...</think>`) from its answer, while streaming.

With thinking on, the chat template's generation prompt already opened the block
(`<|im_start|>assistant\\n<think>\\n`), so the generated text starts inside the reasoning and the
model closes it with `</think>\\n\\n` before the answer. The parser is the inverse of how the
template renders a past assistant turn (`<think>\\n` + reasoning + `\\n</think>\\n\\n` + content):
newlines around the reasoning and before the content are dropped, nothing else is.
"""

from __future__ import annotations

from dataclasses import dataclass

from lily.chat.stop import partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningDelta:
    """What one piece of generated text added to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits generated text into reasoning and content, fed piece by piece.

    `thinking=True` (the default, like the model's template) means generation starts inside the
    think block; a `<think>` the model writes itself at the very start is accepted too. With
    `thinking=False` everything is content. If generation ends before `</think>`, everything is
    reasoning. Markers split across pieces are found: a possible partial `</think>` (and a
    trailing run of newlines) is held back until the next piece decides.
    """

    def __init__(self, *, thinking: bool = True) -> None:
        self.in_reasoning = thinking
        # Before any reasoning text: leading newlines and one `<think>` are still to be dropped.
        self._opening = thinking
        # Nothing of the current section emitted yet: its leading newlines are still dropped.
        self._section_start = True
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        buffer = self._held + text
        self._held = ""
        reasoning = ""
        if self._opening:
            buffer = buffer.lstrip("\n")
            if THINK_START.startswith(buffer) and buffer != THINK_START:
                self._held = buffer  # could still become `<think>`
                return ReasoningDelta()
            if buffer.startswith(THINK_START):
                buffer = buffer[len(THINK_START) :]
            self._opening = False
        if self.in_reasoning:
            if self._section_start:
                buffer = buffer.lstrip("\n")
                if not buffer:
                    return ReasoningDelta()
                self._section_start = False
            end = buffer.find(THINK_END)
            if end < 0:
                body = buffer[: len(buffer) - partial_marker_length(buffer, [THINK_END])]
                # Trailing newlines belong to the closing `\n</think>` if it follows.
                body = body.rstrip("\n")
                self._held = buffer[len(body) :]
                return ReasoningDelta(reasoning=body)
            reasoning = buffer[:end].rstrip("\n")
            buffer = buffer[end + len(THINK_END) :]
            self.in_reasoning = False
            self._section_start = True
        if self._section_start:
            buffer = buffer.lstrip("\n")
            if buffer:
                self._section_start = False
        return ReasoningDelta(reasoning=reasoning, content=buffer)

    def flush(self) -> ReasoningDelta:
        """End of stream: held-back text that never became a marker is reasoning after all."""
        held, self._held = self._held, ""
        if self.in_reasoning:
            return ReasoningDelta(reasoning=held.rstrip("\n"))
        return ReasoningDelta(content=held)
