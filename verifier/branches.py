"""A tree block verified as chains, one row per root-to-leaf branch: how a target with recurrent
layers checks a draft tree.

A recurrent layer (verifier/recurrent_state.py) folds each token into one state, so it cannot
read a tree whose siblings must not see each other, as attention can under a tree mask. A chain
it can read. So each row's cache is copied once per branch, each copy reads its branch as a
chain, and each node's logits come from a branch that holds it (a node's logits depend on its
ancestors only, and every branch through it holds the same ones). After the verdict a row keeps
the copy whose branch holds its accepted path, with the state after that path's tokens.

What it costs: the row's cache is copied to as many rows as it has branches, and back, each
round; hybrids hold few attention layers, and a recurrent state is small. Nodes on several
branches are computed once per branch. `DraftTree.first_branches` bounds the branches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TreeBlock


@dataclass
class Branches:
    owners: list[int]  # per branch row: the block row it comes from
    nodes: list[list[int]]  # per branch row: its block nodes, root first, one per depth
    block: TreeBlock  # (R, D) the branches as chains
    flat_index: torch.Tensor  # (B, T): per block node, branch row * D + its depth there

    @staticmethod
    def of(block: TreeBlock) -> "Branches":
        """The root-to-leaf branches of each row of a block (its nodes in topological order)."""
        parents, valid = block.parents.tolist(), block.valid.tolist()
        owners, nodes = [], []
        for b, (row_parents, row_valid) in enumerate(zip(parents, valid)):
            live = [n for n, ok in enumerate(row_valid) if ok]
            has_child = {row_parents[n] for n in live}
            paths = []
            for leaf in (n for n in live if n not in has_child):
                path = [leaf]
                while row_parents[path[-1]] >= 0:
                    path.append(row_parents[path[-1]])
                paths.append(path[::-1])
            paths.sort()  # depth first, first children first: the first chain is the row's first branch
            owners += [b] * len(paths)
            nodes += paths
        tokens = block.tokens.tolist()
        chains = TreeBlock.chains([[tokens[b][n] for n in path] for b, path in zip(owners, nodes)],
                                  block.tokens.device)
        D = chains.tokens.shape[1]
        B, T = block.tokens.shape
        flat = [[-1] * T for _ in range(B)]
        for r, (b, path) in enumerate(zip(owners, nodes)):
            for depth, n in enumerate(path):
                if flat[b][n] < 0:
                    flat[b][n] = r * D + depth
        first_branch = {}
        for r, b in enumerate(owners):
            first_branch.setdefault(b, r)
        for b in range(B):  # padding nodes read their row's first root (any valid slot would do)
            flat[b] = [f if f >= 0 else first_branch[b] * D for f in flat[b]]
        return Branches(owners, nodes, chains, torch.tensor(flat, device=block.tokens.device))

    def to_tree(self, per_branch: torch.Tensor) -> torch.Tensor:
        """(R, D, ...) values of the branch rows -> (B, T, ...) values of the block's nodes."""
        R, D = per_branch.shape[:2]
        return per_branch.reshape(R * D, *per_branch.shape[2:])[self.flat_index.to(per_branch.device)]

    def kept(self, keep: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """keep[b]: block nodes row b keeps, root first, one per depth (a path). Returns what each
        branch row keeps (a prefix: the whole path in the branch that holds it, the root in the
        others) and, per block row, the branch row it goes on with."""
        chosen = {}
        for r, (b, path) in enumerate(zip(self.owners, self.nodes)):
            if b not in chosen and path[: len(keep[b])] == keep[b]:
                chosen[b] = r
        if len(chosen) != len(keep):
            missing = next(b for b in range(len(keep)) if b not in chosen)
            raise RuntimeError(f"row {missing} keeps the nodes {keep[missing]}, which no branch of its tree holds "
                               "from the root: a row keeps a path")
        counts = [len(keep[b]) if chosen[b] == r else 1 for r, b in enumerate(self.owners)]
        return [list(range(n)) for n in counts], [chosen[b] for b in range(len(keep))]
