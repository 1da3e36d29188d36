"""The `recycling` drafter's memory and the drafts it reads from it (drafters/recycling.py).

CandidateMatrix: for each token id, the target's top_k next tokens the last time it verified that
token, with their probabilities. Two ways to draft below a root from it:

  StaticTemplate   the paper's tree: a fixed set of paths of candidate ranks, read breadth-first
                   (for greedy rows).
  sampled_chain    for sampled rows: a chain drawn from the recorded probabilities, carrying
                   the distributions it was drawn from (not in the paper).

Both take the row's rules (bans, grammar, an EOS the target cannot emit yet) as a check on a
node's whole path: a candidate the row may not draft is left out, and the next takes its place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..verifier.sampling import draw, tempered
from .base import DETERMINISTIC, IID, DraftTree
from .ngram import _Trie
from .rank_trees import sorted_tree


@dataclass
class Proposal:
    """A row's tree, and for each node its depth and candidate rank (for the report's rank
    accuracy); ranks None where the tree does not map onto ranks (a grammar's forced tokens)."""

    tree: DraftTree
    depths: list[int] | None = None
    ranks: list[int] | None = None


class CandidateMatrix:
    def __init__(self, vocab_size: int, top_k: int, device):
        self.vocab_size, self.top_k, self.device = vocab_size, top_k, device
        self.forget()

    def forget(self) -> None:
        # int32 ids, float32 probabilities: 8 bytes a candidate (a 150k vocabulary at top_k 8: 9.6 MB)
        self.ids = torch.full((self.vocab_size, self.top_k), -1, dtype=torch.int32, device=self.device)
        self.probs = torch.zeros((self.vocab_size, self.top_k), dtype=torch.float32, device=self.device)

    def known_tokens(self) -> int:
        return int((self.ids[:, 0] >= 0).sum())

    def write(self, tokens: torch.Tensor, top: torch.Tensor, probs: torch.Tensor) -> None:
        """ids[token], probs[token] = its candidates; a token given twice keeps its last."""
        tokens, last = _last_of(tokens)
        self.ids[tokens] = top[last].to(torch.int32)
        self.probs[tokens] = probs[last].float()

    def seed(self, prompt: list[int]) -> None:
        """Tokens of the prompt the target has not ranked yet get the token that follows them in
        the prompt as their one candidate (the target's own replace it once it verifies them)."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        tokens, following = ids[:-1], ids[1:]
        unseen = self.ids[tokens, 0] < 0
        tokens, following = tokens[unseen], following[unseen]
        if tokens.numel():
            tokens, last = _last_of(tokens)
            # No probability: a seed is a chain's only candidate (q one-hot) and the tree reads ranks.
            self.ids[tokens, 0] = following[last].to(torch.int32)

    def candidates(self, token: int) -> list[tuple[int, float]]:
        """(candidate, probability) of a token, best first; [] for a token never ranked."""
        return [(c, p) for c, p in zip(self.ids[token].tolist(), self.probs[token].tolist()) if c >= 0]


def sampled_chain(matrix: CandidateMatrix, root: int, depth: int, temperature: float, generator: torch.Generator,
                  allowed: Callable[[list[int]], bool] | None = None) -> DraftTree:
    """For a row sampled at `temperature`: a chain drawn step by step from the recorded
    candidates of the token above, q proportional to their probabilities ** (1 / temperature)
    (what the target gave them, warped as the row's own distribution is). The chain carries each
    q, so the verifier accepts a draft with probability min(1, p / q): far more often than a
    fixed token's p. allowed(path): whether the row may draft a path (None: every path); a
    forbidden candidate is left out of q. The chain ends where the matrix knows nothing."""
    tokens: list[int] = []
    qs: list[torch.Tensor] = []
    last = root
    while len(tokens) < depth:
        candidates = [(c, p) for c, p in matrix.candidates(last) if allowed is None or allowed(tokens + [c])]
        if not candidates:
            break
        ids = torch.tensor([c for c, _ in candidates], device=matrix.device)
        weights = torch.tensor([p for _, p in candidates], dtype=torch.float64, device=matrix.device)
        weights = tempered(weights.clamp_min(1e-30).log(), temperature).softmax(-1)  # p ** (1 / T), normalised
        q = torch.zeros(matrix.vocab_size, dtype=torch.float32, device=matrix.device)
        q[ids] = weights.float()
        last = int(ids[draw(weights[None], generator)[0]])
        tokens.append(last)
        qs.append(q)
    if not tokens:
        return DraftTree.empty(matrix.device)
    return DraftTree.chain(tokens, IID, torch.stack(qs), device=matrix.device)


class StaticTemplate:
    """Paths of candidate ranks (e.g. (0,), (1,), (0, 0)), read breadth-first from the matrix."""

    def __init__(self, paths: list[tuple[int, ...]], device):
        self.paths, parents = sorted_tree(paths, "recycling")
        self.device = device
        self.parents = torch.tensor(parents, dtype=torch.long, device=device)
        self.ranks = torch.tensor([p[-1] for p in self.paths], dtype=torch.long, device=device)
        self.depths = [len(p) for p in self.paths]  # ascending: sorted_tree puts shorter paths first
        self.kinds = torch.full((len(self.paths),), DETERMINISTIC, dtype=torch.long, device=device)

    def nodes_within(self, depth_limit: int | None) -> int:
        """How many of the template's nodes are no deeper than depth_limit (they come first)."""
        return len(self.paths) if depth_limit is None else sum(d <= depth_limit for d in self.depths)

    def read(self, matrix: CandidateMatrix, roots: torch.Tensor, n: int) -> torch.Tensor:
        """(rows, n): every row's first n template nodes read from the matrix, one gather per
        depth for the whole batch; -1 where the matrix knows nothing (and below such a node)."""
        tokens = torch.full((roots.shape[0], n), -1, dtype=torch.long, device=self.device)
        start = 0
        while start < n:
            depth = self.depths[start]
            end = next((j for j in range(start, n) if self.depths[j] != depth), n)
            above = roots[:, None].expand(-1, end - start) if depth == 1 else tokens[:, self.parents[start:end]]
            found = matrix.ids[above.clamp(min=0), self.ranks[start:end]].long()
            tokens[:, start:end] = torch.where(above >= 0, found, -1)
            start = end
        return tokens

    def known(self, tokens: torch.Tensor) -> Proposal:
        """One row's read template without the nodes the matrix knew nothing for."""
        n = tokens.shape[0]
        known = tokens >= 0
        depths = [d for d, k in zip(self.depths[:n], known.tolist()) if k]
        ranks = self.ranks[:n][known].tolist()
        if len(depths) == n:
            return Proposal(DraftTree(tokens, self.parents[:n], self.kinds[:n]), depths, ranks)
        # Unknown nodes take their subtrees with them (a child of -1 reads -1), so every kept
        # node's parent is kept: its new index is its rank among the kept.
        new_index = torch.cumsum(known, 0) - 1
        parents = self.parents[:n][known]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], -1)
        return Proposal(DraftTree(tokens[known], parents, self.kinds[:n][known]), depths, ranks)

    def within_rules(self, matrix: CandidateMatrix, root: int, n: int, allowed: Callable[[list[int]], bool],
                     forced: list[int] = ()) -> Proposal:
        """The template read top-down, a node's rank taken among the candidates the row may draft
        after the node's own path, plus what a grammar forces next."""
        trie = _Trie([], [])
        trie.insert(list(forced))
        paths: list[list[int] | None] = []
        allowed_after: dict[int, list[int]] = {}  # parent node -> its candidates the rules allow
        for j in range(n):
            parent = int(self.parents[j])
            above = [] if parent < 0 else paths[parent]
            if above is None:
                paths.append(None)
                continue
            if parent not in allowed_after:
                last = root if parent < 0 else above[-1]
                allowed_after[parent] = [c for c, _ in matrix.candidates(last) if allowed(above + [c])]
            candidates, rank = allowed_after[parent], int(self.ranks[j])
            paths.append(above + [candidates[rank]] if rank < len(candidates) else None)
            if paths[-1] is not None:
                trie.insert(paths[-1])
        return Proposal(trie.tree(self.device))


def _last_of(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each distinct token, the index of its last occurrence). Writing through it keeps the
    last: index_put_ with repeated indices leaves the winner unspecified, and drafts must not
    depend on chance."""
    ids, inverse = torch.unique(tokens, return_inverse=True)
    order = torch.arange(tokens.shape[0], device=tokens.device)
    last = torch.full((ids.shape[0],), -1, dtype=torch.long, device=tokens.device)
    return ids, last.scatter_reduce(0, inverse, order, reduce="amax")
