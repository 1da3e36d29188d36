"""Where a context's suffix occurred before, for the `suffix` drafter (drafters/suffix.py).

An index holds token sequences and, for a few n-gram sizes, every place each n-gram ends with a
token after it. A lookup tries the largest size first, reads the latest `max_reads` places it
ended, and extends each match backwards token by token: what a suffix tree's deepest node gives,
without a suffix tree's memory (a few table entries per token).

The cache's sequences leave in the order they came (first in, first out), so each n-gram's places
are in that order and an evicted sequence's places are at their front (remove_oldest). The
running rows end in any order: their index forgets a row lazily (remove, compacted).

Memory and garbage collection: an n-gram is keyed by its hash, and a place is one int, (sequence
id << 32) + end. An n-gram seen once (most long ones) keeps its place as that int; one seen more
often, an int64 array. Ints are not objects the garbage collector walks, arrays are: with an
array for every n-gram, a full collection took 82 ms longer with 1000 cached rows. Two n-grams
sharing a hash share an entry; every place read is checked against the tokens, so a collision
costs a comparison, never a wrong draft.
"""
from __future__ import annotations

from array import array
from itertools import islice

Place = tuple[int, int]  # (sequence id, index of the token after the n-gram)
_SHIFT = 32  # a place in the tables: (sequence id << _SHIFT) + end


class SuffixIndex:
    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = tuple(sorted(sizes))
        self.sequences: dict[int, list[int]] = {}
        self.places: dict[int, int | array] = {}  # n-gram hash -> its place, or its places oldest first
        self._indexed: dict[int, int] = {}  # per sequence: places ending before this are in the table
        self.tokens = 0  # held in all sequences (the cache's size)
        self.stale_tokens = 0  # of sequences removed but still in the tables (remove())

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
                key, place = hash(tuple(tokens[end - n:end])), (sequence_id << _SHIFT) + end
                held = self.places.get(key)
                if held is None:
                    self.places[key] = place
                elif type(held) is int:
                    self.places[key] = array("q", (held, place))
                else:
                    held.append(place)
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
                key = hash(tuple(tokens[end - n:end]))
                places = self.places.get(key)
                if places is None:  # emptied by an earlier window with the same n-gram
                    continue
                if type(places) is int:
                    if places >> _SHIFT == sequence_id:
                        del self.places[key]
                    continue
                count = 0
                while count < len(places) and places[count] >> _SHIFT == sequence_id:
                    count += 1
                del places[:count]
                if len(places) <= 1:  # one place left is kept as an int, as if it had come alone
                    if places:
                        self.places[key] = places[0]
                    else:
                        del self.places[key]

    def remove(self, sequence_id: int) -> None:
        """Forget any one sequence (running rows end in any order), lazily: its places stay in the
        tables, where lookups skip them, until compacted() builds the index again. Filtering
        them out at once cost O(rows) per n-gram the rows share (6000 rows of one prompt: 7x
        slower generation)."""
        tokens = self.sequences.pop(sequence_id)
        del self._indexed[sequence_id]
        self.tokens -= len(tokens)
        self.stale_tokens += len(tokens)

    def compacted(self) -> "SuffixIndex":
        """The same sequences, indexed again without the places of removed ones."""
        fresh = SuffixIndex(self.sizes)
        for sequence_id, tokens in self.sequences.items():
            fresh.extend(sequence_id, tokens)
        return fresh

    def longest_matches(self, context: list[int], max_match: int, max_reads: int,
                        exclude: int | None = None) -> tuple[int, list[Place]]:
        """(m, places): the longest suffix of `context` (at most max_match tokens) found, and the
        places it ended, latest first; (0, []) when not even the smallest size occurs. Only the
        latest max_reads places of the largest size found are read. exclude: a sequence not to
        look in (a row's own, in the index of running rows)."""
        for n in reversed(self.sizes):
            if n > len(context):
                continue
            suffix = context[-n:]
            places = self.places.get(hash(tuple(suffix)))
            if places is None:
                continue
            best, found, seen = 0, [], set()
            for place in (places,) if type(places) is int else islice(reversed(places), max_reads):
                if place in seen:  # the same place under an n-gram of another size with the same hash
                    continue
                seen.add(place)
                sequence_id, end = place >> _SHIFT, place & ((1 << _SHIFT) - 1)
                sequence = self.sequences.get(sequence_id)
                if sequence is None or sequence_id == exclude:  # removed, or the row's own
                    continue
                if sequence[end - n:end] != suffix:  # another n-gram with the same hash
                    continue
                m = self._match_length(sequence, end, context, n, max_match)
                if m > best:
                    best, found = m, []
                if m == best:
                    found.append((sequence_id, end))
            if found:
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
