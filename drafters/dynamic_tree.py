"""The EAGLE-2 dynamic draft tree, for any drafter that grows candidates through a CachedLM (the
`eagle` heads, the `draft_model` with `top_k > 1`).

Per row: the root's top_k tokens are depth 1. At each further depth the drafter expands the top_k
frontier nodes (by cumulative log-probability, the product of its confidences along the path),
each with its own top_k children; the best top_k of those children become the next frontier.
Finally every node drafted is reranked by that score and the best `total_tokens` form the tree. A
child never scores above its parent, so the kept set is connected. Every node is a deterministic
top-k choice: the shared verifier keeps the output exact at any temperature.

Growing a depth runs the frontier through the drafter's model without committing it: each node
sees the committed prefix, plus (`also_visible`) the uncommitted slots of its ancestors. The
caller drops those slots afterwards (`lm.rollback(lm.lengths.clone())`).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..verifier.cached_model import CachedLM
from ..verifier.tree import TreeBlock
from .base import DETERMINISTIC, DraftTree
from .repeats import DraftRepeats

# grow(parent_states (B, K, ...) or None, tokens (B, K), depth, visible (B, K, S) or None)
#   -> (states of the new nodes or None, logits (B, K, n))
Grow = Callable[[torch.Tensor | None, torch.Tensor, int, torch.Tensor | None], tuple[torch.Tensor | None, torch.Tensor]]


def grow_level(lm: CachedLM, tokens: torch.Tensor, depth: int, visible: torch.Tensor | None,
               hidden_layers: tuple[int, ...] = (), inputs_embeds: torch.Tensor | None = None):
    """Run one depth of nodes (B, K) through `lm` uncommitted. depth 1 = children of the root;
    visible (B, K, S) = slots of each node's ancestors from earlier calls (None at depth 1)."""
    B, K = tokens.shape
    S = lm.num_slots
    block = TreeBlock(tokens, torch.full_like(tokens, -1), torch.ones_like(tokens, dtype=torch.bool),
                      torch.eye(K, dtype=torch.bool, device=tokens.device).expand(B, K, K), torch.zeros_like(tokens))
    if visible is None:
        visible = torch.zeros(B, K, S, dtype=torch.bool, device=tokens.device)
    return lm.forward(block, hidden_layers, inputs_embeds=inputs_embeds, also_visible=visible[..., :S],
                      depth_offset=depth - 1)


def dynamic_tree(lm: CachedLM, grow: Grow, root_logits: torch.Tensor, root_state: torch.Tensor | None,
                 depth: int, top_k: int, total_tokens: int, ready: list[bool],
                 token_ids: Callable[[torch.Tensor], torch.Tensor] = lambda i: i,
                 score_scale: float = 1.0, repeats: DraftRepeats | None = None) -> list[DraftTree]:
    """root_logits (B, n): the drafter's logits for depth 1; root_state (B, ...) what grow needs of
    the root (EAGLE: its predicted feature) or None. token_ids maps logit indices to token ids (a
    reduced draft vocabulary). Rows with ready[b] False get an empty tree. repeats: each node's
    logits penalised for its own context under a repetition penalty (drafters/repeats.py)."""
    tokens, parents, scores = _expand(lm, grow, root_logits, root_state, depth, top_k, token_ids, score_scale,
                                      repeats)
    return _keep_best(tokens, parents, scores, total_tokens, ready)


def _expand(lm, grow, root_logits, root_state, depth, top_k, token_ids, score_scale, repeats=None):
    """Every drafted node, (B, n) each: tokens, parent node index (-1 = root), cumulative log-prob."""
    device = root_logits.device
    K = min(top_k, root_logits.shape[-1])
    B = root_logits.shape[0]
    rows = torch.arange(B, device=device)[:, None]
    if repeats is not None:
        root_logits = repeats.penalise(root_logits, repeats.root_seen)
    score, index = (root_logits.float() * score_scale).log_softmax(-1).topk(K, dim=-1)  # (B, K)
    token = token_ids(index)
    # Under a repetition penalty: the tokens each frontier node's context holds (B, K, n).
    frontier_seen = None if repeats is None else repeats.plus(repeats.root_seen[:, None].expand(B, K, -1), index)
    all_tokens, all_parents, all_scores = [token], [torch.full_like(token, -1)], [score]
    frontier = torch.arange(K, device=device).expand(B, K)  # node index of each frontier node
    parent_state = None if root_state is None else root_state[:, None].expand(B, K, *root_state.shape[1:])
    visible = None
    count = K
    for d in range(1, depth):
        slots_before = lm.num_slots
        state, logits = grow(parent_state, token, d, visible)  # the frontier's outputs
        if frontier_seen is not None:
            logits = repeats.penalise(logits, frontier_seen)
        child_score, child_logit_index = (logits.float() * score_scale).log_softmax(-1).topk(K, dim=-1)  # (B, K, K)
        child_token = token_ids(child_logit_index)
        child_score = child_score + score[..., None]
        child_index = count + torch.arange(K * K, device=device).view(K, K)
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
        parent_state = None if state is None else state[rows, parent_of_pick]
        if frontier_seen is not None:
            frontier_seen = repeats.plus(frontier_seen[rows, parent_of_pick],
                                         child_logit_index.reshape(B, K * K).gather(1, pick))
        S = lm.num_slots
        grown = torch.zeros(B, K, S, dtype=torch.bool, device=device)
        if visible is not None:
            grown[..., : visible.shape[-1]] = visible[rows, parent_of_pick]
        grown[rows, torch.arange(K, device=device), slots_before + parent_of_pick] = True
        visible = grown
    return torch.cat(all_tokens, 1), torch.cat(all_parents, 1), torch.cat(all_scores, 1)


def _keep_best(tokens, parents, scores, total_tokens, ready) -> list[DraftTree]:
    """Keep the best total_tokens nodes per row; renumber them in creation order (parents first)."""
    B, n = tokens.shape
    device = tokens.device
    N = min(total_tokens, n)
    # Stable sort: on equal scores the earlier-created node (a parent before its child) wins.
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :N]
    kept = order.sort(dim=1).values  # creation order: topological, siblings best first
    new_index = torch.full((B, n), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, kept, torch.arange(N, device=device).expand(B, N))
    old_parents = parents.gather(1, kept)
    new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
    kept_tokens = tokens.gather(1, kept)
    kinds = torch.full((N,), DETERMINISTIC, dtype=torch.long, device=device)
    return [DraftTree(kept_tokens[b], new_parents[b], kinds) if ready[b] else DraftTree.empty(device)
            for b in range(B)]
