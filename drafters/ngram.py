"""`ngram`: prompt lookup. Find earlier places where the context's last n tokens occurred (longest
n first) and propose the tokens that followed them. Several matches that continue differently
become branches of one tree. Proposals are deterministic, so verification is exact at any
temperature."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import DETERMINISTIC, Drafter, DraftTree
from .path_bans import PathBans
from .registry import register


@dataclass
class _Trie:
    tokens: list[int]
    parents: list[int]
    _nodes: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node

    def insert(self, continuation: list[int]) -> None:
        parent = -1
        for tok in continuation:
            found = self._nodes.get((parent, tok))
            if found is None:
                self.tokens.append(tok)
                self.parents.append(parent)
                found = self._nodes[(parent, tok)] = len(self.tokens) - 1
            parent = found

    def tree(self, device) -> DraftTree:
        """The continuations merged so far as one deterministic draft tree."""
        n = len(self.tokens)
        return DraftTree(torch.tensor(self.tokens, dtype=torch.long, device=device),
                         torch.tensor(self.parents, dtype=torch.long, device=device),
                         torch.full((n,), DETERMINISTIC, dtype=torch.long, device=device))


class _NgramIndex:
    """For one row: n-gram -> end positions (most recent last) where at least one token follows."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # end positions < indexed are in the table

    def update(self, ctx: list[int]) -> None:
        for end in range(max(self.indexed, 1), len(ctx)):  # an end needs a following token
            for n in self.sizes:
                if end - n >= 0:
                    self.ends.setdefault(tuple(ctx[end - n: end]), []).append(end)
        self.indexed = max(self.indexed, len(ctx))

    def continuations(self, ctx: list[int], k: int, branches: int) -> list[list[int]]:
        found: list[list[int]] = []
        for n in reversed(self.sizes):  # longest match first: it predicts best
            if n > len(ctx):
                continue
            for end in reversed(self.ends.get(tuple(ctx[-n:]), [])):  # most recent first
                cont = ctx[end: end + k]
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == branches:
                        return found
        return found


@register
class NgramDrafter(Drafter):
    name = "ngram"

    @dataclass
    class Options:
        k: int = 6  # tokens proposed per branch
        min_ngram: int = 2  # shortest suffix worth matching (1 proposes on any repeated token: more rounds wasted)
        max_ngram: int = 3  # longest suffix tried first
        branches: int = 3  # distinct continuations merged into one tree (a tree costs about what a chain does at batch 1)

        def __post_init__(self):
            if self.k < 1 or self.branches < 1:
                raise ValueError(f"ngram: k and branches must be >= 1 (got k={self.k}, branches={self.branches})")
            if not 1 <= self.min_ngram <= self.max_ngram:
                raise ValueError(f"ngram: need 1 <= min_ngram <= max_ngram (got {self.min_ngram}, {self.max_ngram})")

    def __init__(self, options: "NgramDrafter.Options", target=None):
        self.options = options or NgramDrafter.Options()
        self.device = target.device if target is not None else "cpu"
        self.indexes: list[_NgramIndex] = []

    def max_depth(self) -> int:
        return self.options.k

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        o = self.options
        self.indexes = [_NgramIndex(o.min_ngram, o.max_ngram) for _ in prompts]
        self.prompt_lengths = [len(p) for p in prompts]
        # A continuation ends before a token its row bans there: a -100 logit_bias, a bad word, a
        # repeated n-gram (drafters/path_bans.py).
        self.path_bans = PathBans(everywhere=True)

    def keep_rows(self, indices):
        self.indexes = [self.indexes[i] for i in indices]
        self.prompt_lengths = [self.prompt_lengths[i] for i in indices]
        self.path_bans.select_rows(indices)

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        o = self.options
        self.indexes += [_NgramIndex(o.min_ngram, o.max_ngram) for _ in prompts]
        self.prompt_lengths += [len(p) for p in prompts]

    def propose(self, contexts):
        o = self.options
        trees = []
        minimums = self.min_new_tokens_per_row(len(contexts))
        path_bans = self.path_bans.round(self.draft_sampling(), contexts, self.grammar)
        for b, (index, ctx, prompt_length, least) in enumerate(zip(self.indexes, contexts, self.prompt_lengths,
                                                                   minimums)):
            index.update(ctx)
            trie = _Trie([], [])
            # Under min_new_tokens the target cannot emit EOS as new token <= min_new_tokens, nor a
            # token the row bans: a continuation ends before either (the tree is deterministic, so
            # cutting it is exact).
            banned_depths = least - (len(ctx) - prompt_length)
            if self.grammar is not None:  # what the grammar forces next, first (drafters/path_bans.py)
                trie.insert(self.grammar.forced(b)[:o.k])
            for cont in index.continuations(ctx, o.k, o.branches):
                trie.insert(draftable(cont, banned_depths, self.eos_token_ids, path_bans, b))
            trees.append(trie.tree(self.device))
        return trees


def draftable(continuation: list[int], banned_depths: int, eos_token_ids, path_bans, row: int) -> list[int]:
    """The part of a copied continuation a row may draft (the copying drafters: ngram, retrieval,
    suffix): up to an EOS the target cannot emit there (depth <= banned_depths, under
    min_new_tokens), then up to the first token the row bans after its own path (path_bans: a
    PathBanRound, or None without bans)."""
    continuation = _before_eos(continuation, banned_depths, eos_token_ids)
    return continuation if path_bans is None else path_bans.cut(row, continuation)


def _before_eos(continuation: list[int], banned_depths: int, eos_token_ids) -> list[int]:
    """The continuation up to its first EOS at depth <= banned_depths (depth 1 = its first token)."""
    for j, token in enumerate(continuation):
        if j < banned_depths and token in eos_token_ids:
            return continuation[:j]
    return continuation
