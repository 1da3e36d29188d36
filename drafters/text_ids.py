"""Each row's text so far in the draft model's ids, for `cross_tokenizer`, updated a round at a time.

Decoding a row's whole output and encoding all its text again every round cost O(length) per
round and row: 1.4 ms at 500 tokens, 6.5 ms at 2000, 30 ms at 8000 with the bundled tokenizer
(measured here), more than a small draft model's forward. Per round this instead
- decodes only the new target tokens (with a window before them: `IncrementalText`), and
- encodes again only the text from the last few draft ids on: tokens at the end of a text may
  merge with what follows it ("pri" + "nt"), tokens further back do not in practice.

The re-encoded piece starts at the start of an anchor id; its first ids after the anchor must be
the ones the row already held there, else the row's whole text is encoded again. The anchor
absorbs what encoding a text from its middle does to its first token: a SentencePiece tokenizer
prepends a space, offsets trimmed of whitespace start a token late. Tokenizers without offsets
(the slow, Python ones) always encode the whole text.

Whichever ids a row gets, drafts stay drafts: the verifier keeps the target's distribution. The
ids decide only how well the draft model guesses.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..detokenize import IncrementalText

REENCODED = 8  # a row's last draft ids, encoded again with each round's new text
CONFIRMED = 4  # the first of them must come out as they were, or the whole text is encoded again
ANCHOR_IDS = 3  # ids the anchor (the id before the re-encoded ones) may come out as


@dataclass
class _Row:
    text: IncrementalText  # the target tokens seen (text.tokens) and their text (text.text)
    ids: list[int]  # that text in the draft model's ids
    spans: list[tuple[int, int]]  # each id's characters in the text ((0, 0) for special tokens)


class TextIds:
    """ids(row, context) -> the row's text in the draft model's ids. Counts the rounds that
    encoded only the end of the text (`extended`) and those that encoded all of it (`whole`)."""

    def __init__(self, target_tokenizer, draft_tokenizer):
        self.decode = lambda ids: target_tokenizer.decode(ids, skip_special_tokens=True)
        self.tokenizer = draft_tokenizer
        self.incremental = bool(getattr(draft_tokenizer, "is_fast", False))  # offsets need a fast tokenizer
        self.rows: list[_Row | None] = []
        self.extended = self.whole = 0

    def reset(self, rows: int) -> None:
        self.rows = [None] * rows
        self.extended = self.whole = 0

    def keep_rows(self, indices) -> None:
        self.rows = [self.rows[i] for i in indices]

    def add_rows(self, rows: int) -> None:
        self.rows += [None] * rows

    def ids(self, b: int, context: list[int]) -> list[int]:
        row = self.rows[b]
        seen = 0 if row is None else len(row.text.tokens)
        if row is None or context[:seen] != row.text.tokens:  # a new row, or one whose tokens changed
            row = self.rows[b] = _Row(IncrementalText(self.decode), [], [])
            row.text.add(list(context))
            self._encode_whole(row)
        elif len(context) > seen and row.text.add(context[seen:]):
            self._extend(row)
        return row.ids

    def _encode(self, text: str, special: bool):
        # (verbose=False: a text longer than the draft model's context is cut by the caller, not warned about)
        if not self.incremental:
            return self.tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"], []
        enc = self.tokenizer(text, add_special_tokens=special, verbose=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(span) for span in enc["offset_mapping"]]

    def _encode_whole(self, row: _Row) -> None:
        self.whole += 1
        row.ids, row.spans = self._encode(row.text.text, special=True)
        if self.incremental and len(row.ids) > 1 and row.spans[-1] == (0, 0):
            self.incremental = False  # the tokenizer ends a text with a special token: nothing can follow it

    def _extend(self, row: _Row) -> None:
        """Encode the text from the anchor on; keep the row's ids before the re-encoded ones."""
        if not self.incremental:
            return self._encode_whole(row)
        ids, spans = row.ids, row.spans
        first = len(ids) - REENCODED
        anchor = first - 1
        while anchor > 0 and spans[anchor][1] <= spans[anchor][0]:  # whitespace trimmed to nothing
            anchor -= 1
        if anchor < 1 or first - anchor > ANCHOR_IDS:
            return self._encode_whole(row)  # a short text, or no anchor with characters near the end
        start = spans[anchor][0]
        piece, piece_spans = self._encode(row.text.text[start:], special=False)
        piece_spans = [(a + start, z + start) for a, z in piece_spans]
        confirmed = slice(first, first + CONFIRMED)
        for at in range(first - anchor + ANCHOR_IDS):  # where the piece's ids after the anchor begin
            # The same ids over the same characters: ids alone may repeat ("▁", "▁", "▁").
            if piece[at: at + CONFIRMED] == ids[confirmed] and piece_spans[at: at + CONFIRMED] == spans[confirmed]:
                row.ids, row.spans = ids[:first] + piece[at:], spans[:first] + piece_spans[at:]
                self.extended += 1
                return
        self._encode_whole(row)
