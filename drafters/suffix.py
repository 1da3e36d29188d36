"""`suffix`: SuffixDecoding (Oliaro et al., 2024, "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications"; vLLM's `method: suffix`). `ngram` looks in the row's own tokens and
`retrieval` in a fixed datastore; this drafter also remembers what the target wrote before: every
finished row goes into a cache kept across generate calls and server requests (the oldest leave
first), so agent loops, repeated tasks and rewrites of similar text draft from past outputs. Rows
still running share their outputs so far: a request that joins a batch while a similar one runs
drafts from it.

Each round, per row: find the longest suffix of the context (at most max_tree_depth tokens) that
occurred before, in the row's own tokens, in the other running rows' outputs or in the cache
(drafters/suffix_index.py). What
followed its occurrences is merged into one tree, and a node's score is the share of occurrences
that continue through it (frequency, as the paper's suffix tree counts it). The nodes scoring at
least min_token_prob are kept, best first, at most max_spec_tokens of them and no deeper than
max_spec_factor x the match length + max_spec_offset: a long match earns a long draft, a short
one a short draft. Proposals are deterministic, so verification is exact at any temperature.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import tokenizer_fingerprint
from .base import DETERMINISTIC, Drafter, DraftTree
from .memory_file import KeepsMemory, integers, within
from .ngram import draftable
from .path_bans import PathBans
from .registry import register
from .suffix_index import SuffixIndex

_OWN = 0  # the one sequence of a row's own index


@register
class SuffixDrafter(KeepsMemory, Drafter):
    name = "suffix"

    @dataclass
    class Options:
        max_tree_depth: int = 24  # longest suffix matched, and deepest draft
        max_spec_tokens: int = 16  # nodes in a tree at most (the target pass's size)
        max_spec_factor: float = 1.0  # a draft goes at most this x the match length deep ...
        max_spec_offset: float = 0.0  # ... plus this many tokens
        min_token_prob: float = 0.1  # keep nodes that at least this share of the occurrences continue through
        min_match: int = 2  # shortest suffix worth matching
        max_cached_requests: int = 1000  # finished rows remembered (first in, first out); 0 = the row's own tokens only
        max_cached_tokens: int = 1_000_000  # and at most this many tokens in them (about 0.3 KB of memory each)
        max_reads: int = 64  # occurrences read per lookup (the latest ones)
        memory_file: str | None = None  # the cache kept across restarts: loaded at start, saved on exit / when asked

        def __post_init__(self):
            if min(self.max_tree_depth, self.max_spec_tokens, self.min_match, self.max_reads) < 1:
                raise ValueError("suffix: max_tree_depth, max_spec_tokens, min_match and max_reads must be >= 1 (got "
                                 f"{self.max_tree_depth}, {self.max_spec_tokens}, {self.min_match}, {self.max_reads})")
            if self.min_match > self.max_tree_depth:
                raise ValueError(f"suffix: min_match ({self.min_match}) cannot exceed max_tree_depth "
                                 f"({self.max_tree_depth})")
            if self.max_spec_factor <= 0 or self.max_spec_offset < 0:
                raise ValueError(f"suffix: need max_spec_factor > 0 and max_spec_offset >= 0 (got "
                                 f"{self.max_spec_factor}, {self.max_spec_offset})")
            if not 0.0 <= self.min_token_prob <= 1.0:
                raise ValueError(f"suffix: min_token_prob must be in [0, 1], got {self.min_token_prob}")
            if self.max_cached_requests < 0 or self.max_cached_tokens < 0:
                raise ValueError(f"suffix: max_cached_requests and max_cached_tokens must be >= 0, got "
                                 f"{self.max_cached_requests} and {self.max_cached_tokens}")
            if self.memory_file and min(self.max_cached_requests, self.max_cached_tokens) == 0:
                raise ValueError("suffix: memory_file keeps the cache of earlier outputs, but max_cached_requests or "
                                 "max_cached_tokens is 0 (no cache): raise them, or drop memory_file")

    def __init__(self, options: "SuffixDrafter.Options", target=None):
        self.options = o = options or SuffixDrafter.Options()
        self.device = target.device if target is not None else "cpu"
        # Table sizes: the shortest match, then doublings; a lookup extends a match beyond them.
        self.sizes = tuple(n for n in (o.min_match, 2 * o.min_match, 4 * o.min_match, 8 * o.min_match)
                           if n <= o.max_tree_depth)
        self.cache = SuffixIndex(self.sizes)  # finished rows, kept across generate calls
        self.running = SuffixIndex(self.sizes)  # the rows still running, as far as they got
        self._next_id = 0  # sequence ids, in both indexes
        # Each active row: its prompt's last max_tree_depth tokens and its output so far (what the
        # other rows and, once it ends, the cache look in), its sequence id, its prompt's length.
        self.rows: list[list[int]] = []
        self.row_ids: list[int] = []
        self.prompt_lengths: list[int] = []
        self.own: list[SuffixIndex] = []  # each active row's whole context
        if o.memory_file:
            if target is None:
                raise ValueError("suffix: memory_file needs the target (its tokenizer says what the ids mean)")
            self.memory_identity = _ids_identity(target)
            self.vocab_size = target.vocab_size  # a loaded cache's ids must lie below it
            self.load_memory()

    def max_depth(self) -> int:
        return min(self.options.max_tree_depth, self.options.max_spec_tokens)

    def _shares(self) -> bool:
        """Whether rows draft from other rows' outputs (the cache, the running rows) at all."""
        return min(self.options.max_cached_requests, self.options.max_cached_tokens) > 0

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self._remember(range(len(self.rows)))  # rows a stopped stream left: their tokens stand
        self.running = SuffixIndex(self.sizes)
        self.rows, self.row_ids, self.prompt_lengths, self.own = [], [], [], []
        self.add_rows(prompts, [])
        self.path_bans = PathBans(everywhere=True)  # as ngram: a draft ends before a banned token
        self.counts = {"from_own_tokens": 0, "from_other_rows": 0, "from_cache": 0, "no_match": 0}

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        for prompt in prompts:
            self.rows.append(list(prompt[-self.options.max_tree_depth:]))
            self.row_ids.append(self._next_id)
            self._next_id += 1
            self.prompt_lengths.append(len(prompt))
            self.own.append(SuffixIndex(self.sizes))

    def observe(self, feedback):
        for row, row_id, emitted in zip(self.rows, self.row_ids, feedback.emitted):
            row += emitted
            if emitted and self._shares():  # the others may draft from it from the next round
                self.running.extend(row_id, row)

    def keep_rows(self, indices):
        kept = set(indices)
        self._remember(i for i in range(len(self.rows)) if i not in kept)
        self.rows = [self.rows[i] for i in indices]
        self.row_ids = [self.row_ids[i] for i in indices]
        self.prompt_lengths = [self.prompt_lengths[i] for i in indices]
        self.own = [self.own[i] for i in indices]
        self.path_bans.select_rows(indices)
        if self.running.stale_tokens > max(self.running.tokens, 4096):  # as much stale as live: build it again
            self.running = self.running.compacted()

    def forget_outputs(self):
        self.cache = SuffixIndex(self.sizes)

    memory_written_for = "tokenizer"

    def memory_tensors(self):
        """The cached outputs, oldest first, as one array of tokens and their lengths; the index
        over them is built again at load (drafters/memory_file.py). A stream stopped early leaves
        its rows out of the cache until the next call begins (begin()): they are saved with it."""
        left = [row for row, row_id in zip(self.rows, self.row_ids) if row_id in self.running.sequences]
        rows = list(self.cache.sequences.values()) + left
        return {"tokens": torch.tensor([t for row in rows for t in row], dtype=torch.int32),
                "lengths": torch.tensor([len(row) for row in rows], dtype=torch.int64)}

    def memory_mismatch(self, identity):
        if identity == self.memory_identity:
            return None
        if "tokenizer" in identity and "tokenizer" in self.memory_identity:
            return "the tokenizer's vocabulary or splitting differs"
        return f"it records {identity}, this target is {self.memory_identity}"

    def memory_damage(self, tensors):
        tokens, lengths = tensors.get("tokens"), tensors.get("lengths")
        if tokens is None or lengths is None or tokens.dim() != 1 or lengths.dim() != 1:
            return "tensors without the shapes a cache is saved in"
        if not integers(tokens, lengths):
            return f"{tokens.dtype} tokens and {lengths.dtype} lengths, not integers"
        if (lengths < 0).any() or int(lengths.sum()) != tokens.numel():
            return "row lengths that do not add up to its tokens"
        if not within(tokens, 0, self.vocab_size):
            return "token ids outside the target's vocabulary"
        return None

    def restore_memory(self, tensors):
        o = self.options
        rows = [row.tolist() for row in tensors["tokens"].split(tensors["lengths"].tolist())]
        # Today's limits may be lower than when it was saved: only the newest rows they keep are
        # indexed (what _evict() would leave, without indexing the others first).
        kept, held = 0, 0
        for row in reversed(rows):
            if kept == o.max_cached_requests or held + len(row) > o.max_cached_tokens:
                break
            kept, held = kept + 1, held + len(row)
        for row in rows[len(rows) - kept:]:
            self.cache.extend(self._next_id, row)
            self._next_id += 1

    def _remember(self, finished) -> None:
        """Move finished rows from the running ones to the cache: each output after its prompt's
        last max_tree_depth tokens (what an output's first tokens follow)."""
        for i in finished:
            if self.row_ids[i] in self.running.sequences:  # it has an output: it wrote something
                self.running.remove(self.row_ids[i])
                self.cache.extend(self.row_ids[i], self.rows[i])
            self._evict()

    def _evict(self) -> None:
        o = self.options
        while len(self.cache.sequences) > o.max_cached_requests or self.cache.tokens > o.max_cached_tokens:
            self.cache.remove_oldest()  # a row longer than max_cached_tokens leaves at once

    def propose(self, contexts):
        trees = []
        minimums = self.min_new_tokens_per_row(len(contexts))
        path_bans = self.path_bans.round(self.draft_sampling(), contexts, self.grammar)
        for b, (ctx, own, row_id, prompt_length, least) in enumerate(zip(contexts, self.own, self.row_ids,
                                                                          self.prompt_lengths, minimums)):
            own.extend(_OWN, ctx)
            banned_depths = least - (len(ctx) - prompt_length)  # EOS held back (min_new_tokens)
            continuations = [draftable(c, banned_depths, self.eos_token_ids, path_bans, b)
                             for c in self._continuations(ctx, own, row_id)]
            # What the grammar forces is all but certain: as deep as a draft may go, whatever the match.
            forced = self.grammar.forced(b)[:self._deepest()] if self.grammar is not None else []
            trees.append(self._tree(continuations, forced))
        return trees

    def _deepest(self) -> int:
        """The deepest draft this round: max_depth(), or less where adaptive speculation asks."""
        return self.max_depth() if self.depth_limit is None else min(self.max_depth(), self.depth_limit)

    def _continuations(self, ctx: list[int], own: SuffixIndex, row_id: int) -> list[list[int]]:
        """What followed the longest suffix of ctx found (own tokens, the other running rows and
        the cache pooled on a tie), each cut to the depth that match earns."""
        o = self.options
        sources = [("from_own_tokens", own, None), ("from_other_rows", self.running, row_id),
                   ("from_cache", self.cache, None)]
        matches = [(name, index, *index.longest_matches(ctx, o.max_tree_depth, o.max_reads, exclude))
                   for name, index, exclude in sources]
        m = max(length for _, _, length, _ in matches)
        if m == 0:
            self.counts["no_match"] += 1
            return []
        self.counts[next(name for name, _, length, _ in matches if length == m)] += 1
        depth = min(int(o.max_spec_factor * m + o.max_spec_offset), self._deepest())
        return [index.continuation(place, depth) for _, index, length, places in matches if length == m
                for place in places]

    def _tree(self, continuations: list[list[int]], forced: list[int]) -> DraftTree:
        """The continuations counted into a tree; the nodes that at least min_token_prob of them
        pass through, best first, up to max_spec_tokens. The grammar's forced tokens count as
        every continuation passing through them."""
        tokens, parents, counts, children = [], [], [], [{}]  # children[0]: the root's
        for continuation, weight in [(forced, max(1, len(continuations)))] + [(c, 1) for c in continuations]:
            node = -1
            for token in continuation:
                child = children[node + 1].get(token)
                if child is None:
                    child = children[node + 1][token] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    counts.append(0)
                    children.append({})
                counts[child] += weight
                node = child
        total = max(1, len(continuations))
        # A child never counts more than its parent, which comes first: the kept set is connected.
        ranked = sorted((i for i in range(len(tokens)) if counts[i] >= self.options.min_token_prob * total),
                        key=lambda i: (-counts[i], i))
        kept = sorted(ranked[:self.options.max_spec_tokens])
        new_index = {old: new for new, old in enumerate(kept)}
        return DraftTree(torch.tensor([tokens[i] for i in kept], dtype=torch.long, device=self.device),
                         torch.tensor([new_index.get(parents[i], -1) for i in kept], dtype=torch.long,
                                      device=self.device),
                         torch.full((len(kept),), DETERMINISTIC, dtype=torch.long, device=self.device))

    def report(self) -> dict:
        """Row-rounds drafted from the row's own tokens, from the other running rows' outputs,
        from the cache, or not at all (no suffix found); and what the cache holds."""
        return {**self.counts, "cache": {"requests": len(self.cache.sequences), "tokens": self.cache.tokens}}


def _ids_identity(target) -> dict:
    """What the cached ids mean: the target's tokenizer (its vocabulary and how it splits text),
    or, for a target folder without one, only the vocabulary's size."""
    if target.tokenizer is None:
        return {"vocab_size": target.vocab_size}
    return {"tokenizer": tokenizer_fingerprint(target.tokenizer)}
