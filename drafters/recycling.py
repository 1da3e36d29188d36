"""`recycling`: Token Recycling (Luo et al., 2024, "Turning Trash into Treasure: Accelerating
Inference of Large Language Models with Token Recycling", arXiv 2408.08696). No training, no
second model, no datastore: every target pass already ranks the whole vocabulary after every token
of its block, rejected drafts included, and those candidates are what the next rounds draft from.

An adjacency matrix keeps, for each token id, the target's `top_k` most likely next tokens the
last time it saw that token (the engine hands them back: TargetNeeds.top_tokens). A draft tree is a
fixed template of candidate ranks below the root, read from the matrix breadth-first: path (0, 1)
is the root's best candidate, then that token's second best. Tokens the target has not seen yet
have no candidates, so nothing is drafted below them. The matrix is shared by the rows of a batch
and outlives a generate call (the paper's hot start): what one request taught the target's
neighbourhood of a token helps the next. Not in the paper: a token the target has not ranked yet
takes the token that follows it in the prompt as its one candidate (`seed_from_prompt`), so a
cold start drafts from its first round. Every node is deterministic, so the shared verifier keeps
the output exact at any temperature.

The template comes from a table of how often the rank-r candidate is right at each depth (the
`report()` measures it on your prompts as `rank_accuracy`), reduced to the `tree_budget` likeliest
paths, as Medusa trees are built (drafters/medusa.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DETERMINISTIC, Drafter, DraftTree, TargetNeeds
from .medusa import _sorted_tree, tree_from_accuracies
from .ngram import _Trie, draftable
from .path_bans import PathBans
from .registry import register

# How often the rank-r candidate (columns) is accepted at each depth below the root (rows) when
# its parent was: measured on the bundled Python target at T=0, 24 held-out prompts x 96 tokens,
# through a 120-node tree (`python scripts/recycling_experiment.py --rank-accuracy`). Depths 6-8
# were never reached there and repeat depth 5. Only the order of the products matters: it decides
# which paths a tree of `tree_budget` nodes holds.
DEFAULT_RANK_ACCURACY = [
    [0.71, 0.088, 0.045, 0.016, 0.014, 0.008, 0.002, 0.004],
    [0.674, 0.08, 0.025, 0.023, 0.018, 0.012, 0.015, 0.002],
    [0.792, 0.059, 0.027, 0.003, 0.006, 0.004, 0.001, 0.004],
    [0.792, 0.05, 0.004, 0.013, 0.001, 0.001, 0.001, 0.001],
] + [[0.845, 0.036, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001]] * 4


@register
class RecyclingDrafter(Drafter):
    name = "recycling"

    @dataclass
    class Options:
        top_k: int = 8  # candidates kept per token id (the matrix's width)
        tree_budget: int = 24  # nodes of the tree built from rank_accuracy
        tree: list | None = None  # explicit paths of candidate ranks instead, e.g. [[0], [1], [0, 0]]
        rank_accuracy: list | None = None  # per depth, per rank (a report's `rank_accuracy`); None = built in
        seed_from_prompt: bool = True  # tokens the target has not ranked yet: the prompt's next token as candidate

        def __post_init__(self):
            if self.top_k < 1 or self.tree_budget < 1:
                raise ValueError(f"recycling: top_k and tree_budget must be >= 1 (got {self.top_k}, "
                                 f"{self.tree_budget})")
            for path in self.tree or []:
                if not path or any(not isinstance(r, int) or not 0 <= r < self.top_k for r in path):
                    raise ValueError(f"recycling: tree path {path} needs ranks in [0, top_k={self.top_k}); "
                                     "raise top_k or use lower ranks")
            if self.rank_accuracy is not None and not (
                    self.rank_accuracy and all(isinstance(row, list) and row for row in self.rank_accuracy)):
                raise ValueError("recycling: rank_accuracy is a list per depth of a list per rank, "
                                 "e.g. [[0.6, 0.1], [0.65, 0.1]] (a report's `rank_accuracy`)")

    def __init__(self, options: "RecyclingDrafter.Options", target):
        self.options = options
        self.device = target.device
        self.vocab_size = target.vocab_size
        self.needs = TargetNeeds(top_tokens=options.top_k)
        # A report's table holds None where a rank was never tried: it counts as never right.
        table = [[a or 0.0 for a in row[:options.top_k]] for row in options.rank_accuracy or DEFAULT_RANK_ACCURACY]
        self.paths, parents = _sorted_tree(options.tree or tree_from_accuracies(table, options.tree_budget))
        self.parents = torch.tensor(parents, dtype=torch.long, device=self.device)
        self.ranks = torch.tensor([p[-1] for p in self.paths], dtype=torch.long, device=self.device)
        self.depths = [len(p) for p in self.paths]  # ascending: _sorted_tree puts shorter paths first
        self.kinds = torch.full((len(self.paths),), DETERMINISTIC, dtype=torch.long, device=self.device)
        self.forget_outputs()
        self._reset_counts()

    def max_depth(self) -> int:
        return self.depths[-1]

    def forget_outputs(self):
        # int32: 4 bytes per candidate (a 150k vocabulary at top_k 8 is 4.8 MB); -1 = not seen yet
        self.matrix = torch.full((self.vocab_size, self.options.top_k), -1, dtype=torch.int32, device=self.device)

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.prompt_lengths = [len(p) for p in prompts]
        self.proposed: list[torch.Tensor | None] = [None] * len(prompts)  # the template's tokens per row
        self.path_bans = PathBans(everywhere=True)
        self._reset_counts()
        self._seed(prompts)

    def _seed(self, prompts: list[list[int]]) -> None:
        """Tokens of the prompts the target has not ranked yet get the token that follows them in
        the prompt as their one candidate (the target's own replace it once it sees them): a
        request drafts from its first round, not only once the target has seen its tokens."""
        if not self.options.seed_from_prompt:
            return
        for prompt in prompts:
            ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
            tokens, following = ids[:-1], ids[1:]
            unseen = self.matrix[tokens, 0] < 0
            tokens, following = tokens[unseen], following[unseen]
            if tokens.numel():
                ids, last = _last_of(tokens)
                self.matrix[ids, 0] = following[last].to(torch.int32)

    def keep_rows(self, indices):
        self.prompt_lengths = [self.prompt_lengths[i] for i in indices]
        self.proposed = [self.proposed[i] for i in indices]
        self.path_bans.select_rows(indices)

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        self.prompt_lengths += [len(p) for p in prompts]
        self.proposed += [None] * len(prompts)
        self._seed(prompts)

    def observe(self, feedback):
        if not feedback.target_top:  # another child of a cascade asked for fewer candidates: none
            return
        self._count_ranks(feedback)
        # The roots and accepted drafts of every row go last, so where a token appears twice the
        # candidates that win are those seen in text a row really continues (among those, the
        # later row's; among the rest, likewise).
        rejected, kept = [], []
        for b, ((slot_tokens, _), path) in enumerate(zip(feedback.target_top, feedback.accepted_nodes)):
            on_path = [0] + [n + 1 for n in path]
            kept += [(b, slot) for slot in on_path]
            rejected += [(b, slot) for slot in sorted(set(range(slot_tokens.shape[0])) - set(on_path))]
        order = rejected + kept
        tokens = torch.stack([feedback.target_top[b][0][slot] for b, slot in order])
        top = torch.stack([feedback.target_top[b][1][slot, : self.options.top_k] for b, slot in order])
        self._write(tokens.to(self.device), top.to(self.device))

    def _write(self, tokens: torch.Tensor, top: torch.Tensor) -> None:
        """matrix[token] = its candidates; a token given twice keeps its last."""
        ids, last = _last_of(tokens)
        self.matrix[ids] = top[last].to(torch.int32)

    @torch.no_grad()
    def propose(self, contexts):
        n = len(self.paths) if self.depth_limit is None else sum(d <= self.depth_limit for d in self.depths)
        roots = torch.tensor([ctx[-1] for ctx in contexts], dtype=torch.long, device=self.device)
        tokens = self._read_template(roots, n)  # (rows, n), -1 where nothing is known
        minimums = self.min_new_tokens_per_row(len(contexts))
        path_bans = self.path_bans.round(self.draft_sampling(), contexts, self.grammar)
        trees = []
        for b, ctx in enumerate(contexts):
            banned_depths = minimums[b] - (len(ctx) - self.prompt_lengths[b])
            if path_bans is not None or (banned_depths > 0 and self.eos_token_ids):
                trees.append(self._tree_within_rules(b, ctx[-1], n, banned_depths, path_bans))
                self.proposed[b] = None
            else:
                trees.append(self._known(tokens[b]))
                self.proposed[b] = tokens[b]
        return trees

    def _read_template(self, roots: torch.Tensor, n: int) -> torch.Tensor:
        """Every row's template read from the matrix, one gather per depth for the whole batch."""
        tokens = torch.full((roots.shape[0], n), -1, dtype=torch.long, device=self.device)
        start = 0
        while start < n:
            depth = self.depths[start]
            end = next((j for j in range(start, n) if self.depths[j] != depth), n)
            above = roots[:, None].expand(-1, end - start) if depth == 1 else tokens[:, self.parents[start:end]]
            found = self.matrix[above.clamp(min=0), self.ranks[start:end]].long()
            tokens[:, start:end] = torch.where(above >= 0, found, -1)
            start = end
        return tokens

    def _known(self, tokens: torch.Tensor) -> DraftTree:
        """One row's template without the nodes the matrix knows nothing for (and those below them)."""
        n = tokens.shape[0]
        known = tokens >= 0
        if bool(known.all()):
            return DraftTree(tokens, self.parents[:n], self.kinds[:n])
        # Unknown nodes take their subtrees with them (a child of -1 reads -1), so every kept
        # node's parent is kept: its new index is its rank among the kept.
        new_index = torch.cumsum(known, 0) - 1
        parents = self.parents[:n][known]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], -1)
        return DraftTree(tokens[known], parents, self.kinds[:n][known])

    def _tree_within_rules(self, row: int, root: int, n: int, banned_depths: int, path_bans) -> DraftTree:
        """Under bans, a grammar or an EOS the target cannot emit yet: the template read top-down,
        a node's rank taken among the candidates the row may draft after the node's own path (a
        forbidden candidate would only be rejected), plus what the grammar forces next."""
        trie = _Trie([], [])
        if self.grammar is not None:
            trie.insert(draftable(self.grammar.forced(row)[: self.depths[n - 1] if n else 0], banned_depths,
                                  self.eos_token_ids, path_bans, row))
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
                candidates = [c for c in self.matrix[last].tolist() if c >= 0]
                allowed_after[parent] = [c for c in candidates if len(draftable(
                    above + [c], banned_depths, self.eos_token_ids, path_bans, row)) == len(above) + 1]
            allowed, rank = allowed_after[parent], int(self.ranks[j])
            paths.append(above + [allowed[rank]] if rank < len(allowed) else None)
            if paths[-1] is not None:
                trie.insert(paths[-1])
        return trie.tree(self.device)

    def _count_ranks(self, feedback) -> None:
        """Per depth and rank: how often a node whose parent was accepted was accepted too. Only
        rows whose verified tree is this drafter's whole template reading (not another cascade
        child's, not one cut under rules or by the engine)."""
        for b, ((slot_tokens, _), path) in enumerate(zip(feedback.target_top, feedback.accepted_nodes)):
            mine = self.proposed[b] if b < len(self.proposed) else None  # (template,), -1 = not drafted
            if mine is None or not torch.equal(slot_tokens[1:].to(mine.device), mine[mine >= 0]):
                continue
            known = (mine >= 0).nonzero().flatten().tolist()  # template nodes in the tree, in order
            accepted = {known[i] for i in path}
            for j in known:
                parent = int(self.parents[j])
                if parent < 0 or parent in accepted:
                    depth, rank = self.depths[j] - 1, int(self.ranks[j])
                    self.trials[depth][rank] += 1
                    self.hits[depth][rank] += j in accepted
        self.proposed = [None] * len(self.proposed)

    def _reset_counts(self) -> None:
        depth = self.depths[-1]
        self.trials = [[0] * self.options.top_k for _ in range(depth)]
        self.hits = [[0] * self.options.top_k for _ in range(depth)]

    def report(self) -> dict:
        """rank_accuracy[d][r]: the share of depth-(d+1) rank-r nodes accepted when their parent
        was (None where none was tried), to pass back as the `rank_accuracy` option; the matrix's
        known tokens."""
        accuracy = [[round(h / t, 4) if t else None for h, t in zip(hits, trials)]
                    for hits, trials in zip(self.hits, self.trials)]
        return {"rank_accuracy": accuracy, "rank_trials": self.trials,
                "known_tokens": int((self.matrix[:, 0] >= 0).sum())}


def _last_of(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each distinct token, the index of its last occurrence). Writing through it keeps the
    last: index_put_ with repeated indices leaves the winner unspecified, and drafts must not
    depend on chance."""
    ids, inverse = torch.unique(tokens, return_inverse=True)
    order = torch.arange(tokens.shape[0], device=tokens.device)
    last = torch.full((ids.shape[0],), -1, dtype=torch.long, device=tokens.device)
    return ids, last.scatter_reduce(0, inverse, order, reduce="amax")
