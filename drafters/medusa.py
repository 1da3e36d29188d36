"""`medusa`: a token tree from Medusa heads' top-k candidates (heads/medusa.py).

The heads read the target's last hidden state at the newest accepted position, which the verifier
hands back after each round (no extra target pass). Head i ranks candidates for depth i + 1 below
the root; the tree is a set of paths of candidate ranks, e.g. (0,), (1,), (0, 0), ... built by
`tree_from_accuracies` from the heads' measured accuracy per rank under a node budget. Every node
is deterministic, so the shared verifier keeps the output exact at any temperature.

Under bans that depend on the path or a grammar (drafters/path_bans.py), the tree is read top-down
instead: a node's rank is taken among what the row may draft after the node's own path, so a
forbidden candidate does not take a rank a draft the verifier can accept would have.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..heads.medusa import MedusaHeads
from .base import DETERMINISTIC, Drafter, DraftTree, TargetNeeds
from .draft_vocab import frequent_tokens, shrunk_linear
from .last_hidden import LastHiddenRows
from .path_bans import PathBanRound
from .rank_trees import sorted_tree, tree_from_accuracies  # noqa: F401  (tree_from_accuracies: its old home)
from .registry import register

# Used when the heads carry no measured accuracies: a main chain plus a few alternatives.
DEFAULT_TREE = [(0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1), (0, 2)]


@register
class MedusaDrafter(LastHiddenRows, Drafter):
    name = "medusa"
    needs = TargetNeeds(hidden_state_layers=(-1,))

    @dataclass
    class Options:
        path: str | None = None  # folder of trained heads (draftsman train medusa)
        tree: list[list[int]] | None = None  # explicit paths of candidate ranks, e.g. [[0], [1], [0, 0]]
        tree_budget: int | None = None  # rebuild the tree from the heads' accuracies with this many nodes
        draft_vocab: int | None = None  # rank candidates among the N tokens the target picks most (None = all)

        def __post_init__(self):
            if not self.path:
                raise ValueError("medusa: set drafter.path to a trained heads folder (draftsman train medusa)")
            if self.tree_budget is not None and self.tree_budget < 1:
                raise ValueError(f"medusa: tree_budget must be >= 1, got {self.tree_budget}")
            if self.tree is not None and not self.tree:
                raise ValueError("medusa: tree [] has no paths: give paths of candidate ranks, e.g. [[0], [1], "
                                 "[0, 0]], or leave tree out for the heads' own tree")
            if self.tree is not None and self.tree_budget is not None:  # (tree_budget was dropped without a word)
                raise ValueError("medusa: tree gives the paths itself and tree_budget builds a tree instead of it: "
                                 "drop one or the other")

    def __init__(self, options: "MedusaDrafter.Options", target):
        self.heads, config = MedusaHeads.load(options.path, target.model)
        self.target_vocab_size = target.vocab_size
        self.vocab_map = None
        if options.draft_vocab is not None:
            self.vocab_map = frequent_tokens(config, options.path, options.draft_vocab, target.vocab_size,
                                             self.name, "medusa", target.device)
            self.heads.restrict_vocabulary(self.vocab_map, shrunk_linear)
        accuracy = config.get("rank_accuracy")
        if options.tree is not None:
            paths = options.tree
        elif accuracy and options.tree_budget:
            paths = tree_from_accuracies(accuracy, options.tree_budget)
        else:
            paths = config.get("tree") or DEFAULT_TREE
        too_deep = [p for p in paths if len(p) > self.heads.config.num_heads]
        if too_deep:
            raise ValueError(f"medusa tree path {list(too_deep[0])} is deeper than the {self.heads.config.num_heads} heads")
        self.paths, parents = sorted_tree(paths, "medusa")
        device = target.device
        self.parents = torch.tensor(parents, dtype=torch.long, device=device)
        self.head_of_node = torch.tensor([len(p) - 1 for p in self.paths], device=device)
        self.rank_of_node = torch.tensor([p[-1] for p in self.paths], device=device)
        self.ranks = int(self.rank_of_node.max()) + 1
        self.device = device
        self._parameters = sum(p.numel() for p in self.heads.parameters())

    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    def extra_parameters(self) -> int:
        return self._parameters

    def _ranked_after_paths(self, logits: torch.Tensor, ready: list[int], bans: PathBanRound) -> list[DraftTree]:
        """Under path bans or a grammar (drafters/path_bans.py), each ready row's tree read top-down:
        a node's token is its head's candidate of the node's rank among what the row may draft
        after the node's path. A node with nothing left at its rank is dropped with the nodes below
        it. logits: (n, heads, width), one row per `ready` row."""
        n = len(ready)
        parents, heads, ranks = self.parents.tolist(), self.head_of_node.tolist(), self.rank_of_node.tolist()
        ranked: dict[tuple[int, int], tuple[list, list]] = {}  # (parent node, head) -> candidates' logits, ids
        paths: list[list[list[int] | None]] = []  # per node, per row: its path (None: dropped)
        for j, parent in enumerate(parents):
            if (parent, heads[j]) not in ranked:
                above = [[] if parent < 0 else paths[parent][i] or [] for i in range(n)]
                values, index = bans.mask(logits[:, heads[j]], above, rows=ready).topk(self.ranks, dim=-1)
                if self.vocab_map is not None:
                    index = self.vocab_map[index]
                ranked[(parent, heads[j])] = (values.tolist(), index.tolist())
            values, index = ranked[(parent, heads[j])]
            paths.append([None if (parent >= 0 and paths[parent][i] is None) or values[i][ranks[j]] == -math.inf
                          else (paths[parent][i] if parent >= 0 else []) + [index[i][ranks[j]]] for i in range(n)])
        trees = []
        for i in range(n):
            kept = [j for j in range(len(parents)) if paths[j][i] is not None]
            new_index = {j: k for k, j in enumerate(kept)}
            trees.append(DraftTree(torch.tensor([paths[j][i][-1] for j in kept], dtype=torch.long, device=self.device),
                                   torch.tensor([new_index.get(parents[j], -1) for j in kept], dtype=torch.long,
                                                device=self.device),
                                   torch.full((len(kept),), DETERMINISTIC, dtype=torch.long, device=self.device)))
        return trees

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.begin_rows(prompts, self.target_vocab_size)

    @torch.no_grad()
    def propose(self, contexts):
        trees = [DraftTree.empty(self.device) for _ in contexts]
        ready = [b for b, h in enumerate(self.last_hidden) if h is not None]  # round 1 has no hidden state yet
        if not ready:
            return trees
        hidden = torch.stack([self.last_hidden[b] for b in ready]).float()  # (n, d)
        index = torch.tensor(ready, device=self.device)
        sampling = self.draft_sampling()  # each row's own bias and penalties, when rows differ
        # (n, heads, width): rows first, as the per-row bias, penalties and EOS ban take them
        logits = self.draft_context.biased(sampling, self.heads(hidden).transpose(0, 1), self.vocab_map, rows=index)
        repeats = self.draft_context.round(sampling, contexts, logits.shape[-1], self.vocab_map)
        if repeats is not None:  # every head penalised for the committed text (not for the nodes above)
            repeats = repeats.rows(index)
            logits = repeats.penalise(logits, repeats.root_state[:, None, :].expand_as(logits))
        eos_ban = self.draft_context.eos_ban(self, contexts, logits.shape[-1], self.vocab_map)
        if eos_ban is not None:  # head h drafts depth h + 1
            logits = eos_ban.rows(index).apply(logits, torch.arange(1, logits.shape[1] + 1, device=self.device))
        bans = self.draft_context.path_bans(sampling, contexts, self.vocab_map, self.grammar)
        if bans is not None:
            for b, tree in zip(ready, self._ranked_after_paths(logits, ready, bans)):
                trees[b] = tree
            return trees
        candidates = logits.transpose(0, 1).topk(self.ranks, dim=-1).indices  # (heads, n, ranks)
        if self.vocab_map is not None:
            candidates = self.vocab_map[candidates]
        tokens = candidates[self.head_of_node, :, self.rank_of_node]  # (nodes, n)
        kinds = torch.full_like(self.parents, DETERMINISTIC)
        for i, b in enumerate(ready):
            trees[b] = DraftTree(tokens[:, i], self.parents, kinds)
        return trees
