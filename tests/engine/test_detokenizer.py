"""Incremental detokenization: the same text as decoding everything, stop strings found across
token boundaries, and a bounded amount of decoding per new token (not the whole output)."""

from __future__ import annotations

from tokendance.engine.detokenizer import IncrementalDetokenizer

TEXT = ("Les élèves ont vu 🦜 un perroquet — 鳥 — near the old mill; the harvest festival starts at "
        "noon, and STOP here is where a stop string sits. ") * 6


class CountingTokenizer:
    """The real tokenizer, counting how many token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, token_ids):
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids)


def test_text_matches_a_full_decode_at_every_step(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    for end in range(1, len(ids) + 1):
        detok.update(ids[:end])
        full = tokenizer.decode(ids[:end])
        assert full.startswith(detok.text)
        held_back = full[len(detok.text):]
        assert held_back == "" or full.endswith("\ufffd")  # only an incomplete character waits
    assert detok.text == tokenizer.decode(ids)


def test_decoding_per_token_is_bounded_and_stops_are_found(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(counting, stop_strings=("STOP here",))
    found_at = None
    for end in range(1, len(ids) + 1):
        detok.update(ids[:end])
        if detok.stop_text_end is not None and found_at is None:
            found_at = end
    assert detok.stop_text_end == TEXT.index("STOP here")
    assert detok.output_text == TEXT[: TEXT.index("STOP here")]
    assert found_at is not None and found_at < len(ids) // 6 + 5  # found in the first repetition
    # a full decode per step would decode ~len(ids)^2 / 2 ids; a window decodes a few per step
    assert counting.decoded <= 8 * len(ids)
