"""`eagle`: an EAGLE-2 dynamic draft tree from an EAGLE head (heads/feature_head.py, kind eagle).

Per round and row: the root's top_k tokens are depth 1. At each further depth the head expands the
top_k frontier nodes (by cumulative draft log-probability, the product of the head's confidences
along the path), each with its own top_k children; the best top_k of those children become the
next frontier. Finally every node drafted is reranked by that score and the best `total_tokens`
form the tree. A child never scores above its parent, so the kept set is connected. Every node is
a deterministic top-k choice: the shared verifier keeps the output exact at any temperature.

The scores are the head's log-probabilities; an EAGLE-3 head learns the target's distribution, so
at T=0 its logits are first multiplied by the `greedy_score_scale` fitted at training (how sure to
be that a token is the target's argmax, not how probable it is). Only the tree's shape changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DETERMINISTIC, DraftTree
from .feature_head import FeatureHeadDrafter
from .registry import register


@register
class EagleDrafter(FeatureHeadDrafter):
    name = "eagle"
    head_kinds = ("eagle", "eagle3")  # the same dynamic tree drafts from EAGLE-1/2 and EAGLE-3 heads

    @dataclass
    class Options:
        path: str | None = None  # folder of a trained EAGLE head (draftsman train eagle)
        depth: int = 5  # deepest draft token
        top_k: int = 4  # children per expanded node, and nodes expanded per depth
        total_tokens: int = 12  # nodes kept in the verified tree (the target pass's size)
        draft_vocab: int | None = None  # draft among the N tokens the target picks most (None = all)

        def __post_init__(self):
            if not self.path:
                raise ValueError("eagle: set drafter.path to a trained EAGLE head folder (draftsman train eagle)")
            for key in ("depth", "top_k", "total_tokens"):
                if getattr(self, key) < 1:
                    raise ValueError(f"eagle: {key} must be >= 1, got {getattr(self, key)}")

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.score_scale = self.head_config.get("greedy_score_scale", 1.0) if sampling.greedy else 1.0

    def draft(self, feature, logits, depth, ready):
        tokens, parents, scores = self._expand(feature, logits, depth)
        return self._trees(tokens, parents, scores, ready)

    def _expand(self, root_feature, root_logits, depth):
        """Grow the frontier depth by depth. Returns every drafted node, (B, n) each: tokens,
        parent node index (-1 = root) and cumulative log-probability."""
        K = min(self.options.top_k, root_logits.shape[-1])
        B = root_logits.shape[0]
        rows = torch.arange(B, device=self.device)[:, None]
        score, token = (root_logits.float() * self.score_scale).log_softmax(-1).topk(K, dim=-1)  # (B, K)
        token = self.token_ids(token)
        all_tokens, all_parents, all_scores = [token], [torch.full_like(token, -1)], [score]
        frontier = torch.arange(K, device=self.device).expand(B, K)  # node index of each frontier node
        parent_feature = root_feature[:, None].expand(B, K, root_feature.shape[-1])
        visible = None
        count = K
        for d in range(1, depth):
            slots_before = self.lm.num_slots
            feature, logits = self.grow(parent_feature, token, d, visible)  # the frontier's outputs
            child_score, child_token = (logits.float() * self.score_scale).log_softmax(-1).topk(K, dim=-1)
            child_token = self.token_ids(child_token)
            child_score = child_score + score[..., None]
            child_index = count + torch.arange(K * K, device=self.device).view(K, K)
            all_tokens.append(child_token.reshape(B, K * K))
            all_parents.append(frontier[..., None].expand(B, K, K).reshape(B, K * K))
            all_scores.append(child_score.reshape(B, K * K))
            count += K * K
            if d == depth - 1:
                break
            # The best K children form the next frontier; they see their parent's slot and its ancestors'.
            score, pick = child_score.reshape(B, K * K).topk(K, dim=-1)
            parent_of_pick = pick // K  # position in the old frontier
            token = child_token.reshape(B, K * K).gather(1, pick)
            frontier = child_index.reshape(-1)[pick]
            parent_feature = feature[rows, parent_of_pick]
            S = self.lm.num_slots
            grown = torch.zeros(B, K, S, dtype=torch.bool, device=self.device)
            if visible is not None:
                grown[..., : visible.shape[-1]] = visible[rows, parent_of_pick]
            grown[rows, torch.arange(K, device=self.device), slots_before + parent_of_pick] = True
            visible = grown
        return torch.cat(all_tokens, 1), torch.cat(all_parents, 1), torch.cat(all_scores, 1)

    def _trees(self, tokens, parents, scores, ready) -> list[DraftTree]:
        """Keep the best total_tokens nodes per row; renumber them in creation order (parents first)."""
        B, n = tokens.shape
        N = min(self.options.total_tokens, n)
        # Stable sort: on equal scores the earlier-created node (a parent before its child) wins.
        order = torch.sort(-scores, dim=1, stable=True).indices[:, :N]
        kept = order.sort(dim=1).values  # creation order: topological, siblings best first
        new_index = torch.full((B, n), -1, dtype=torch.long, device=self.device)
        new_index.scatter_(1, kept, torch.arange(N, device=self.device).expand(B, N))
        old_parents = parents.gather(1, kept)
        new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
        kept_tokens = tokens.gather(1, kept)
        kinds = torch.full((N,), DETERMINISTIC, dtype=torch.long, device=self.device)
        ready = ready.tolist()
        return [DraftTree(kept_tokens[b], new_parents[b], kinds) if ready[b] else DraftTree.empty(self.device)
                for b in range(B)]
