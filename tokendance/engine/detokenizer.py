"""A request's output text, decoded incrementally, and the stop strings found in it.

Decoding the whole output at every step (and searching all of it for stop strings) costs O(length)
per token, O(length^2) per request. Here each new token decodes a short window: the text of
tokens [prefix_offset, read_offset) is already known, so the text of [prefix_offset, end) minus it
is the new text (held back while it ends in an incomplete UTF-8 character), and stop strings are
only searched where they could end in the new text.
"""

from __future__ import annotations

from collections.abc import Sequence

INCOMPLETE = "\ufffd"  # what a byte-level decoder yields for a cut UTF-8 sequence


class IncrementalDetokenizer:
    """Invariant: `text` == decode(token_ids[:read_offset]) (with special tokens skipped), and
    `stop_text_end` is where the earliest stop string found starts in `text` (None: none yet)."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.longest_stop = max(map(len, stop_strings), default=0)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_text_end: int | None = None

    def update(self, token_ids: Sequence[int]) -> str:
        """Take the tokens appended since the last call; returns the new text (may be empty)."""
        decode = self.tokenizer.decode
        known = decode(token_ids[self.prefix_offset:self.read_offset])
        window = decode(token_ids[self.prefix_offset:])
        if len(window) <= len(known) or window.endswith(INCOMPLETE):
            return ""
        new_text = window[len(known):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        searched_from = max(0, len(self.text) - self.longest_stop + 1)
        self.text += new_text
        if self.stop_strings and self.stop_text_end is None:
            found = [i for i in (self.text.find(s, searched_from) for s in self.stop_strings) if i >= 0]
            if found:
                self.stop_text_end = min(found)
        return new_text

    def finish(self, token_ids: Sequence[int]) -> None:
        """The final text, decoded once in full (it may end in an incomplete character)."""
        self.text = self.tokenizer.decode(token_ids)
        self.read_offset = self.prefix_offset = len(token_ids)

    @property
    def output_text(self) -> str:
        return self.text if self.stop_text_end is None else self.text[: self.stop_text_end]
