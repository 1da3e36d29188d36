"""Hugging Face's no_repeat_ngram_size and bad_words_ids: a token that would complete an n-gram
already in the sequence, or a banned word, gets probability 0 (its logit -inf), before the
warpers, at any temperature.

In a verification block each position has its own sequence: the row's committed tokens (the root
last) and its ancestors in the block, itself included. Rebuilding every position's n-grams would
cost O(context) per node; instead each row's committed n-grams are indexed once, as
{(n-1)-gram: next tokens}, and extended as the row grows, and a node adds only the few n-grams
that end on its own path. A banned word of several tokens is banned where the node's sequence
ends with all but its last token. Checked against Hugging Face's NoRepeatNGramLogitsProcessor
and NoBadWordsLogitsProcessor node by node (tests/test_ngram_ban.py).
"""
from __future__ import annotations

import torch

from .block_penalties import writable
from .tree import TreeBlock


def repeated_ngram_tokens(sequence: list[int], n: int) -> set[int]:
    """The tokens that would repeat an n-gram of `sequence` if they came next (the plain form,
    for one sequence: the audit's per-position check)."""
    index = _extend({}, sequence, 0, n)
    return set(index.get(_key(sequence, n), ()))


def _key(sequence: list[int], n: int) -> tuple[int, ...]:
    return tuple(sequence[len(sequence) - (n - 1):]) if len(sequence) >= n - 1 else (-1,)  # (-1,): no key


def _extend(index: dict, sequence: list[int], done: int, n: int) -> dict:
    """Add the n-grams of `sequence` that end at positions >= done."""
    for end in range(max(done, n - 1), len(sequence)):
        index.setdefault(tuple(sequence[end - n + 1:end]), set()).add(sequence[end])
    return index


class CommittedNgrams:
    """One row's committed n-grams, {(n-1)-gram: next tokens}, extended as the row grows; asked
    what a position below the row's newest token may not be (the verifier's tree nodes, and the
    drafters' own drafts: drafters/path_bans.py)."""

    def __init__(self, n: int):
        self.n = n
        self.indexed = 0  # tokens of the row indexed so far
        self.index: dict[tuple[int, ...], set[int]] = {}

    def update(self, context: list[int]) -> "CommittedNgrams":
        """Index the n-grams of `context` (the row's committed tokens, the root included) not yet in."""
        _extend(self.index, context, self.indexed, self.n)
        self.indexed = len(context)
        return self

    def head(self, context: list[int]) -> list[int]:
        """The row's last n-1 tokens: as far back as a path's new n-grams reach."""
        return context[max(0, len(context) - (self.n - 1)):]

    def banned(self, head: list[int], path: list[int]) -> set[int]:
        """The tokens that would complete a repeated n-gram after `path` (tokens below the root)
        when the row ends with `head` (head()): the committed n-grams, and those ending on the path."""
        # The end of this position's sequence: the row's last n-1 tokens, then its path. (A context
        # shorter than that is whole, so positions in `tail` are the sequence's.)
        n, tail = self.n, head + path
        key = _key(tail, n)
        banned = set(self.index.get(key, ()))
        for end in range(len(head), len(tail)):  # the n-grams that end on the path
            if end - n + 1 >= 0 and tuple(tail[end - n + 1:end]) == key:
                banned.add(tail[end])
        return banned


class RepeatedNgrams:
    """One generation's committed n-grams, per original row, kept as the rows grow."""

    def __init__(self, n: int):
        self.n = n
        self._rows: dict[int, CommittedNgrams] = {}  # original row -> its n-grams

    def ban_(self, logits: torch.Tensor, block: TreeBlock, rows: list[int], contexts: list[list[int]],
             which: list[int] | None = None) -> torch.Tensor:
        """Set to -inf, in (B, T, V) block logits (in place; in a float32 copy when lower, as the
        penalties), every token that would complete an n-gram already in its position's sequence,
        and return them. rows: each block row's original row (for its index); contexts: each row's
        committed tokens, the root included; which: the block rows to ban in (None: all)."""
        logits = writable(logits)
        at_b, at_j, at_v = [], [], []
        for b, row, context, nodes in node_paths(block, rows, contexts, which):
            if row not in self._rows:
                self._rows[row] = CommittedNgrams(self.n)
            ngrams = self._rows[row].update(context)
            head = ngrams.head(context)
            for j, path in nodes:
                banned = ngrams.banned(head, path)
                at_b += [b] * len(banned)
                at_j += [j] * len(banned)
                at_v += banned
        if at_b:
            logits[at_b, at_j, at_v] = float("-inf")
        return logits


class BadWords:
    """Hugging Face's bad_words_ids: a one-token word is banned everywhere; a longer one's last
    token is banned where the sequence ends with the rest of it. As in Hugging Face, a word that
    is just an EOS token is ignored (min_new_tokens holds EOS back)."""

    def __init__(self, words, eos_token_ids=()):
        words = [tuple(w) for w in words if not (len(w) == 1 and w[0] in eos_token_ids)]
        self.singles = sorted({w[0] for w in words if len(w) == 1})
        self.longer = [w for w in words if len(w) > 1]
        self.reach = max((len(w) - 1 for w in self.longer), default=0)  # context tokens a prefix can span

    def banned_after(self, sequence: list[int]) -> set[int]:
        """The tokens banned after `sequence` (the plain form, for one sequence: the audit's)."""
        return set(self.singles) | self.completing(sequence)

    def completing(self, sequence: list[int]) -> set[int]:
        """The last tokens of the longer words whose rest `sequence` ends with (only its last
        `reach` tokens matter)."""
        return {w[-1] for w in self.longer if _ends_with(sequence, w[:-1])}

    def ban_(self, logits: torch.Tensor, block: TreeBlock, rows: list[int], contexts: list[list[int]],
             which: list[int] | None = None) -> torch.Tensor:
        """As RepeatedNgrams.ban_, for the words."""
        logits = writable(logits)
        if self.singles:
            if which is None:
                logits[..., self.singles] = float("-inf")
            else:
                at_b = torch.tensor(which, device=logits.device)[:, None]
                logits[at_b, :, torch.tensor(self.singles, device=logits.device)[None, :]] = float("-inf")
        if not self.longer:
            return logits
        at_b, at_j, at_v = [], [], []
        for b, _, context, nodes in node_paths(block, rows, contexts, which):
            head = context[max(0, len(context) - self.reach):]
            for j, path in nodes:
                banned = self.completing(head + path)
                at_b += [b] * len(banned)
                at_j += [j] * len(banned)
                at_v += banned
        if at_b:
            logits[at_b, at_j, at_v] = float("-inf")
        return logits


def _ends_with(sequence: list[int], prefix: tuple[int, ...]) -> bool:
    return len(sequence) >= len(prefix) and tuple(sequence[len(sequence) - len(prefix):]) == prefix


def node_paths(block: TreeBlock, rows: list[int], contexts: list[list[int]], which: list[int] | None = None):
    """Per block row (of `which`; None: all): (b, its original row, its context, [(position, path)]
    for its valid positions), a path being the position's tokens after the root (the root is in
    the context)."""
    tokens, parents, valid = block.tokens.tolist(), block.parents.tolist(), block.valid.tolist()
    for b in range(len(rows)) if which is None else which:
        row, context = rows[b], contexts[b]
        paths: list[list[int]] = []
        nodes = []
        for j, token in enumerate(tokens[b]):
            paths.append([] if j == 0 else paths[parents[b][j]] + [token])
            if valid[b][j]:
                nodes.append((j, paths[j]))
        yield b, row, context, nodes


class BlockBans:
    """Each row's own bans in one batch (rows may differ in no_repeat_ngram_size and
    bad_words_ids, verifier/sampling.py's BAN_FIELDS): one RepeatedNgrams per n and one BadWords
    per word list, made when a row first needs them and kept for the generation, each applied
    to its own rows. A ban depends only on a position's own sequence, so each row is banned
    exactly as alone."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = eos_token_ids
        self._ngrams: dict[int, RepeatedNgrams] = {}
        self._words: dict[tuple, BadWords] = {}

    def ban_(self, logits: torch.Tensor, block: TreeBlock, rows: list[int], contexts: list[list[int]],
             groups: tuple[dict, dict]) -> torch.Tensor:
        """RepeatedNgrams.ban_ and BadWords.ban_, each on its own rows (groups: verifier/sampling.py's
        row_bans)."""
        by_n, by_words = groups
        for n, which in by_n.items():
            if n not in self._ngrams:
                self._ngrams[n] = RepeatedNgrams(n)
            logits = self._ngrams[n].ban_(logits, block, rows, contexts, which)
        for words, which in by_words.items():
            if words not in self._words:
                self._words[words] = BadWords(words, self.eos_token_ids)
            logits = self._words[words].ban_(logits, block, rows, contexts, which)
        return logits
