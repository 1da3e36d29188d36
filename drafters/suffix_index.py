"""Where a context's suffix occurred before, for the `suffix` drafter (drafters/suffix.py).

An index holds token sequences and, for a few n-gram sizes, every place each n-gram ends with a
token after it. A lookup tries the largest size first, reads the latest `max_reads` places it
ended, and extends each match backwards token by token: what a suffix tree's deepest node gives,
without a suffix tree's memory (a few table entries per token).

Sequences leave in the order they came (the cache of finished rows is first in, first out), so
each n-gram's places are in sequence order and an evicted sequence's places are at their front.
"""
from __future__ import annotations

from collections import deque
from itertools import islice

Place = tuple[int, int]  # (sequence id, index of the token after the n-gram)


class SuffixIndex:
    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = tuple(sorted(sizes))
        self.sequences: dict[int, list[int]] = {}
        self.places: dict[tuple[int, ...], deque[Place]] = {}
        self._indexed: dict[int, int] = {}  # per sequence: places ending before this are in the table
        self.tokens = 0  # held in all sequences (the cache's size)

    def extend(self, sequence_id: int, tokens: list[int]) -> None:
        """Add a sequence, or index what a growing one gained (`tokens` is all of it so far)."""
        indexed = self._indexed.get(sequence_id, 0)
        self.tokens += len(tokens) - indexed
        self.sequences[sequence_id] = tokens
        start = max(indexed, 1)
        for end in range(start, len(tokens)):  # a place needs a token after it
            for n in self.sizes:
                if n > end:
                    break
                self.places.setdefault(tuple(tokens[end - n:end]), deque()).append((sequence_id, end))
        self._indexed[sequence_id] = len(tokens)

    def remove_oldest(self) -> None:
        """Forget the sequence that was added first."""
        sequence_id = next(iter(self.sequences))
        tokens = self.sequences.pop(sequence_id)
        del self._indexed[sequence_id]
        self.tokens -= len(tokens)
        for end in range(1, len(tokens)):
            for n in self.sizes:
                if n > end:
                    break
                key = tuple(tokens[end - n:end])
                places = self.places.get(key)
                while places and places[0][0] == sequence_id:
                    places.popleft()
                if places is not None and not places:
                    del self.places[key]

    def longest_matches(self, context: list[int], max_match: int, max_reads: int) -> tuple[int, list[Place]]:
        """(m, places): the longest suffix of `context` (at most max_match tokens) found, and the
        places it ended, latest first; (0, []) when not even the smallest size occurs. Only the
        latest max_reads places of the largest size found are read."""
        for n in reversed(self.sizes):
            if n > len(context):
                continue
            places = self.places.get(tuple(context[-n:]))
            if not places:
                continue
            best, found = 0, []
            for sequence_id, end in islice(reversed(places), max_reads):
                m = self._match_length(self.sequences[sequence_id], end, context, n, max_match)
                if m > best:
                    best, found = m, []
                if m == best:
                    found.append((sequence_id, end))
            return best, found
        return 0, []

    @staticmethod
    def _match_length(sequence: list[int], end: int, context: list[int], n: int, max_match: int) -> int:
        """How many tokens before `end` equal the context's last ones (n are known to)."""
        m = n
        limit = min(max_match, end, len(context))
        while m < limit and sequence[end - m - 1] == context[-m - 1]:
            m += 1
        return m

    def continuation(self, place: Place, k: int) -> list[int]:
        sequence_id, end = place
        return self.sequences[sequence_id][end:end + k]
