"""The EAGLE-2 dynamic draft tree, for any drafter that grows candidates through a CachedLM (the
`eagle` heads, the `draft_model` with `top_k > 1`).

Per row: the root's top_k tokens are depth 1. At each further depth the drafter expands the top_k
frontier nodes (by cumulative log-probability, the product of its confidences along the path),
each with its own top_k children; the best top_k of those children become the next frontier.
Finally every node drafted is reranked by that score and the best `total_tokens` form the tree. A
child never scores above its parent, so the kept set is connected, and growth stops early once
every frontier node scores below the `total_tokens`-th best node drafted so far (none of their
children could be kept). Every node is a deterministic top-k choice: the shared verifier keeps
the output exact at any temperature.

`min_confidence` bounds the tree by worth as well as by size: a node whose path confidence (the
exp of its score) is below it is not kept, and growth stops once no frontier node reaches it (its
children score lower still). A node is worth about its chance of being accepted, while each one
widens the target's pass, by about 0.4 ms per node on the 2-core CPU. With the bundled int8
EAGLE-3 head at T=0 (depth 6, 20 nodes) and 0.05, trees averaged 13.0-16.4 nodes and tau went
from 4.80 / 5.33 / 5.65 to 4.74 / 5.33 / 5.57 (docstrings / fresh code / copy-heavy code).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..verifier.cached_model import CachedLM
from ..verifier.tree import TreeBlock
from .base import DETERMINISTIC, DraftTree
from .eos_ban import EosBan
from .path_bans import PathBanRound
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


def check_min_confidence(drafter: str, min_confidence: float) -> None:
    if not 0.0 <= min_confidence < 1.0:
        raise ValueError(f"{drafter}: min_confidence must be in [0, 1) (0 = keep total_tokens nodes), "
                         f"got {min_confidence}")


def dynamic_tree(lm: CachedLM | None, grow: Grow, root_logits: torch.Tensor, root_state: torch.Tensor | None,
                 depth: int, top_k: int, total_tokens: int, ready: list[bool],
                 token_ids: Callable[[torch.Tensor], torch.Tensor] = lambda i: i,
                 score_scale: float = 1.0, repeats: DraftRepeats | None = None,
                 min_confidence: float = 0.0, eos_ban: EosBan | None = None,
                 bans: PathBanRound | None = None) -> list[DraftTree]:
    """root_logits (B, n): the drafter's logits for depth 1; root_state (B, ...) what grow needs of
    the root (EAGLE: its predicted feature) or None. lm: the cache grow adds the nodes to, or None
    for a drafter whose nodes keep no cache (mlp_speculator: grow sees no slots). token_ids maps
    logit indices to token ids (a reduced draft vocabulary). Rows with ready[b] False get an empty
    tree. repeats: each node's logits penalised for its own context under penalties
    (drafters/repeats.py). eos_ban: no EOS node where min_new_tokens forbids it
    (drafters/eos_ban.py). bans: no node that its own path makes a repeated n-gram or bad word
    (drafters/path_bans.py).
    min_confidence: drop nodes whose path confidence is below it, and stop growing once no
    frontier node reaches it (every row keeps at least its best node)."""
    min_score = math.log(min_confidence) if min_confidence > 0 else -math.inf
    tokens, parents, scores = _expand(lm, grow, root_logits, root_state, depth, top_k, token_ids, score_scale,
                                      repeats, total_tokens, min_score, eos_ban, bans)
    return _keep_best(tokens, parents, scores, total_tokens, ready, min_score)


def _expand(lm, grow, root_logits, root_state, depth, top_k, token_ids, score_scale, repeats=None,
            total_tokens=None, min_score=-math.inf, eos_ban=None, bans=None):
    """Every drafted node, (B, n) each: tokens, parent node index (-1 = root), cumulative log-prob."""
    device = root_logits.device
    K = min(top_k, root_logits.shape[-1])
    B = root_logits.shape[0]
    rows = torch.arange(B, device=device)[:, None]
    if repeats is not None:
        root_logits = repeats.penalise(root_logits, repeats.root_state)
    if eos_ban is not None:
        root_logits = eos_ban.apply(root_logits, 1)
    if bans is not None:
        root_logits = bans.mask(root_logits, [[] for _ in range(B)])
    score, index = (root_logits.float() * score_scale).log_softmax(-1).topk(K, dim=-1)  # (B, K)
    token = token_ids(index)
    # Under path bans: each frontier node's path below the root, as token ids.
    paths = None if bans is None else [[[t] for t in row] for row in token.tolist()]
    # Under penalties: what each frontier node's context holds (B, K, n; drafters/repeats.py).
    frontier_held = None if repeats is None else repeats.plus(repeats.root_state[:, None].expand(B, K, -1), index)
    all_tokens, all_parents, all_scores = [token], [torch.full_like(token, -1)], [score]
    frontier = torch.arange(K, device=device).expand(B, K)  # node index of each frontier node
    parent_state = None if root_state is None else root_state[:, None].expand(B, K, *root_state.shape[1:])
    visible = None
    count = K
    for d in range(1, depth):
        if _none_can_be_kept(score, all_scores, count, total_tokens, min_score):
            break
        slots_before = None if lm is None else lm.num_slots
        state, logits = grow(parent_state, token, d, visible)  # the frontier's outputs
        if frontier_held is not None:
            logits = repeats.penalise(logits, frontier_held)
        if eos_ban is not None:
            logits = eos_ban.apply(logits, d + 1)
        if paths is not None:
            logits = bans.mask(logits, paths)
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
        if frontier_held is not None:
            frontier_held = repeats.plus(frontier_held[rows, parent_of_pick],
                                         child_logit_index.reshape(B, K * K).gather(1, pick))
        if paths is not None:
            paths = [[paths[b][p] + [t] for p, t in zip(parent_row, token_row)]
                     for b, (parent_row, token_row) in enumerate(zip(parent_of_pick.tolist(), token.tolist()))]
        if lm is None:  # no cache: no slots to see
            continue
        S = lm.num_slots
        grown = torch.zeros(B, K, S, dtype=torch.bool, device=device)
        if visible is not None:
            grown[..., : visible.shape[-1]] = visible[rows, parent_of_pick]
        grown[rows, torch.arange(K, device=device), slots_before + parent_of_pick] = True
        visible = grown
    return torch.cat(all_tokens, 1), torch.cat(all_parents, 1), torch.cat(all_scores, 1)


def _none_can_be_kept(frontier_score, all_scores, count, total_tokens, min_score) -> bool:
    """Whether growing the frontier is wasted: a child scores at most its parent, so no child of a
    frontier node scoring below min_score, or below the total_tokens-th best node drafted so far
    (ties go to the earlier node), can be kept. The tree is the same as when growing on."""
    full = total_tokens is not None and count >= total_tokens
    if min_score == -math.inf and not full:  # nothing can be cut yet: no tensor work, no device sync
        return False
    bar = torch.full_like(frontier_score[:, 0], min_score)
    if full:
        bar = torch.maximum(bar, torch.cat(all_scores, 1).topk(total_tokens, dim=1).values[:, -1])
    return bool((frontier_score.max(1).values < bar).all())


def _keep_best(tokens, parents, scores, total_tokens, ready, min_score=-math.inf) -> list[DraftTree]:
    """Keep per row the best total_tokens nodes scoring at least min_score and above -inf (at
    least the best node); renumber them in creation order (parents first). A -inf node is a
    token the drafter's masked logits rule out (a ban, the grammar), that top-k picked for want
    of more: it could only be rejected."""
    B, n = tokens.shape
    device = tokens.device
    N = min(total_tokens, n)
    # Stable sort: on equal scores the earlier-created node (a parent before its child) wins.
    best = torch.sort(-scores, dim=1, stable=True)
    order = best.indices[:, :N]
    kept_scores = -best.values[:, :N]
    sizes = ((kept_scores >= min_score) & (kept_scores > -math.inf)).sum(1).clamp(min=1)  # (B,) nodes kept per row
    ranked = torch.arange(N, device=device)
    dropped = ranked >= sizes[:, None]
    # Creation order (topological, siblings best first), dropped nodes last.
    kept = torch.where(dropped, n, order).sort(dim=1).values.clamp(max=n - 1)
    new_index = torch.full((B, n), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, torch.where(dropped, order, kept), torch.where(dropped, -1, ranked.expand(B, N)))
    old_parents = parents.gather(1, kept)
    new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
    kept_tokens = tokens.gather(1, kept)
    kinds = torch.full((N,), DETERMINISTIC, dtype=torch.long, device=device)
    sizes = sizes.tolist()
    return [DraftTree(kept_tokens[b, : sizes[b]], new_parents[b, : sizes[b]], kinds[: sizes[b]]) if ready[b]
            else DraftTree.empty(device) for b in range(B)]
