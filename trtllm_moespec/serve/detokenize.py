"""Incremental detokenization for streaming: text deltas that never need taking back.

A delta is withheld while the decoded text ends in U+FFFD (a byte-level token that
completes a UTF-8 character is still to come) and, when the request has stop
strings, for the last `max(len(stop)) - 1` characters (they may turn out to begin
a stop string, which the engine then cuts). `finish` sends the rest of the final
text, so the concatenated deltas equal the non-streamed completion.
"""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    """Turns a growing token list into text deltas."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] | None = None):
        self.decode = decode
        self.hold = max((len(s) for s in stop), default=1) - 1 if stop else 0
        self.sent = ""

    def push(self, output_ids: Sequence[int]) -> str:
        """The new text safe to send, given all output tokens so far."""
        text = self.decode(output_ids)
        end = len(text) - self.hold
        while end > len(self.sent) and text[end - 1] == "\ufffd":
            end -= 1
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):end], text[:end]
        return delta

    def finish(self, output_ids: Sequence[int]) -> str:
        """The rest of the final text (after the engine applied stop strings)."""
        text = self.decode(output_ids)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta
