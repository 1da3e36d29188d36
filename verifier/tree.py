"""Packing ragged per-row trees into padded tensors: one format for the model pass (TreeBlock) and
one for the accept/reject walk (PackedDrafts). Shapes are written once here.

A TreeBlock is what a cached model is fed in one forward: per row, T tokens whose parents are
either another token of the block or the committed prefix (parent -1). Padding slots have
valid=False, parent -1, and attend only to the prefix and themselves, so they never make NaNs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # drafters/ imports this module: importing its package here would be a cycle
    from ..drafters.base import DraftTree


def ancestors_and_depth(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) parent indices (-1 = prefix) -> ancestor-or-self mask (B, T, T) and depth (B, T),
    depth 0 for tokens attached to the prefix. Loops over depth, not over nodes."""
    B, T = parents.shape
    anc = torch.eye(T, dtype=torch.bool, device=parents.device).expand(B, T, T).clone()
    cur = parents.clone()
    rows = torch.arange(B, device=parents.device)[:, None].expand(B, T)
    cols = torch.arange(T, device=parents.device)[None, :].expand(B, T)
    for _ in range(T):
        has = cur >= 0
        if not bool(has.any()):
            break
        anc[rows[has], cols[has], cur[has]] = True
        cur = torch.where(has, parents.gather(1, cur.clamp(min=0)), cur)
    return anc, anc.sum(-1) - 1


@dataclass
class TreeBlock:
    tokens: torch.Tensor  # (B, T) long, padding = 0
    parents: torch.Tensor  # (B, T) long, -1 = attached to the committed prefix
    valid: torch.Tensor  # (B, T) bool
    ancestors: torch.Tensor | None = None  # (B, T, T) bool, ancestor-or-self; derived if None
    depth: torch.Tensor | None = None  # (B, T) long; derived if None

    def __post_init__(self):
        if self.ancestors is None or self.depth is None:
            self.ancestors, self.depth = ancestors_and_depth(self.parents)

    def is_full_chain(self) -> bool:
        """Every row is the same unpadded chain shape (a plain step is a chain of one)."""
        T = self.tokens.shape[1]
        if T == 1:
            return bool(self.valid.all())
        chain = torch.arange(-1, T - 1, device=self.parents.device)
        return bool(self.valid.all()) and bool((self.parents == chain).all())

    @staticmethod
    def column(tokens: torch.Tensor) -> "TreeBlock":
        """One token per row (a plain decoding step): (B,) tokens, already on their device."""
        B, device = tokens.shape[0], tokens.device
        return TreeBlock(tokens[:, None], torch.full((B, 1), -1, dtype=torch.long, device=device),
                         torch.ones(B, 1, dtype=torch.bool, device=device),
                         torch.ones(B, 1, 1, dtype=torch.bool, device=device),
                         torch.zeros(B, 1, dtype=torch.long, device=device))

    @staticmethod
    def chains(rows: list[list[int]], device: torch.device | str) -> "TreeBlock":
        """Each row a plain chain of tokens (prefill, or feeding a draft model)."""
        T = max((len(r) for r in rows), default=0)
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        valid = torch.zeros(len(rows), T, dtype=torch.bool)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            valid[b, : len(r)] = True
        parents = torch.arange(-1, T - 1).expand(len(rows), T).clone()
        parents[~valid] = -1  # padding hangs off the prefix on its own
        # A chain's ancestors are a lower triangle (drafting calls this every step: skip the walk).
        ancestors = torch.tril(torch.ones(T, T, dtype=torch.bool)) & valid[:, None, :] & valid[:, :, None]
        ancestors |= torch.eye(T, dtype=torch.bool)  # padding sees itself, so no row is empty
        depth = torch.where(valid, torch.arange(T), 0)
        return TreeBlock(tokens.to(device), parents.to(device), valid.to(device), ancestors.to(device), depth.to(device))


@dataclass
class PackedDrafts:
    """All rows' draft trees, padded. Node i of a row sits in block slot i + 1; slot 0 is the root.

    tokens       (B, N) long        kinds (B, N) long        valid (B, N) bool
    draft_probs  (B, N, V) float or None (rows/nodes without one hold zeros)
    children     (B, N + 1, C) long: node indices of each slot's children in production order, -1 pad
    depth        (B, N) long: 1 for children of the root
    """

    tokens: torch.Tensor
    kinds: torch.Tensor
    valid: torch.Tensor
    draft_probs: torch.Tensor | None
    children: torch.Tensor
    depth: torch.Tensor

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.depth.numel() else 0


def pack_drafts(trees: list[DraftTree], vocab_size: int, device, prob_dtype=torch.float32) -> PackedDrafts:
    from ..drafters.base import DETERMINISTIC  # here, not at the top: the drafters package imports this module

    B = len(trees)
    N = max((t.size for t in trees), default=0)
    tokens = torch.zeros(B, N, dtype=torch.long)
    kinds = torch.full((B, N), DETERMINISTIC, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    depth = torch.zeros(B, N, dtype=torch.long)
    child_lists = [[[] for _ in range(N + 1)] for _ in range(B)]
    any_probs = any(t.draft_probs is not None for t in trees)
    draft_probs = torch.zeros(B, N, vocab_size, dtype=prob_dtype, device=device) if any_probs else None
    for b, tree in enumerate(trees):
        n = tree.size
        if n == 0:
            continue
        tokens[b, :n] = tree.tokens.cpu()
        kinds[b, :n] = tree.kinds.cpu()
        valid[b, :n] = True
        depth[b, :n] = torch.tensor(tree.depths())
        for i, p in enumerate(tree.parents.tolist()):
            child_lists[b][p + 1].append(i)
        if tree.draft_probs is not None:
            if tree.draft_probs.shape[-1] != vocab_size:
                raise ValueError(f"draft_probs has {tree.draft_probs.shape[-1]} columns, the target's "
                                 f"vocabulary has {vocab_size}: drafter and target vocabularies differ")
            draft_probs[b, :n] = tree.draft_probs.to(device=device, dtype=prob_dtype)
    C = max((len(c) for rows in child_lists for c in rows), default=0)
    children = torch.full((B, N + 1, max(C, 1)), -1, dtype=torch.long)
    for b in range(B):
        for slot, kids in enumerate(child_lists[b]):
            if kids:
                children[b, slot, : len(kids)] = torch.tensor(kids)
    return PackedDrafts(tokens.to(device), kinds.to(device), valid.to(device), draft_probs,
                        children.to(device), depth.to(device))


def verification_block(roots: torch.Tensor, trees: list[DraftTree], device, chains: bool = False) -> TreeBlock:
    """The target's input for one round: per row the root (slot 0) followed by its draft nodes.
    chains=True: the caller checked every tree is a chain (root + chain is a chain: no ancestor walk)."""
    B = len(trees)
    T = 1 + max((t.size for t in trees), default=0)
    tokens = torch.zeros(B, T, dtype=torch.long)
    parents = torch.full((B, T), -1, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    tokens[:, 0] = roots.cpu()
    valid[:, 0] = True
    for b, tree in enumerate(trees):
        n = tree.size
        if n:
            tokens[b, 1 : n + 1] = tree.tokens.cpu()
            parents[b, 1 : n + 1] = tree.parents.cpu() + 1  # root children -> slot 0
            valid[b, 1 : n + 1] = True
    if not chains:
        return TreeBlock(tokens.to(device), parents.to(device), valid.to(device))
    ancestors = torch.tril(torch.ones(T, T, dtype=torch.bool)) & valid[:, None, :] & valid[:, :, None]
    ancestors |= torch.eye(T, dtype=torch.bool)  # padding sees itself, so no row is empty
    depth = torch.where(valid, torch.arange(T), 0)
    return TreeBlock(tokens.to(device), parents.to(device), valid.to(device), ancestors.to(device), depth.to(device))
