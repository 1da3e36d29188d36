"""LOSSY, opt-in: Medusa's typical acceptance (Cai et al., 2024, "Medusa", section 2.3.1).

Everything else in verifier/ keeps the target's distribution exactly; this rule does not, and is
used only when a run sets sampling.lossy_typical_acceptance at a temperature above 0.

At a node whose target distribution (after the sampling settings) is p, a draft token x passes
when p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))), H the entropy of p in nats:
a token the target finds plausible passes, and more easily where the target is unsure. The
deepest node whose whole path passes is accepted (ties: the likelier path, then the earlier
node), then one token is drawn from the target's p after it, as the bonus token of exact
verification. The accepted drafts are not samples of the target, so the output is not distributed
as the target's own: in exchange, far more drafts are accepted at high temperature, where exact
rejection sampling accepts a fixed draft only with probability p(x). At temperature 0 the engine
verifies greedily and this rule is not used.

Medusa's defaults: posterior_threshold 0.09, posterior_alpha 0.3 (about its square root). Unlike
Medusa's `fast` mode, the token after the accepted path is a true sample of p, not its argmax.
"""
from __future__ import annotations

import torch

from .rejection import Coin, Verdict
from .sampling import TypicalAcceptance
from .tree import PackedDrafts


def typical_thresholds(target_probs: torch.Tensor, rule: TypicalAcceptance) -> torch.Tensor:
    """(..., V) distributions -> (...) the probability a token must exceed to pass there."""
    entropy = -torch.special.xlogy(target_probs, target_probs).sum(-1)
    return torch.clamp(rule.posterior_alpha * torch.exp(-entropy), max=rule.posterior_threshold)


def verify_typical(target_probs: torch.Tensor, drafts: PackedDrafts, coin: Coin, rule: TypicalAcceptance) -> Verdict:
    """target_probs (B, N + 1, V) as in verify_sampled: slot 0 after the root, slot i + 1 after
    node i. Returns the accepted path and the next token per row."""
    B, S, V = target_probs.shape
    N = S - 1
    device = target_probs.device
    rows = torch.arange(B, device=device)
    # Each node's parent slot, from the children lists (invalid entries land in a spare column).
    kids = drafts.children.reshape(B, -1)
    from_slot = torch.arange(S, device=device).repeat_interleave(drafts.children.shape[2]).expand(B, -1)
    parent_slot = torch.zeros(B, N + 1, dtype=torch.long, device=device)
    parent_slot.scatter_(1, torch.where(kids >= 0, kids, N), from_slot)
    parent_slot = parent_slot[:, :N]

    p_node = target_probs[rows[:, None], parent_slot, drafts.tokens]  # (B, N)
    passes = drafts.valid & (p_node > typical_thresholds(target_probs, rule).gather(1, parent_slot))
    log_p = torch.log(p_node.clamp_min(torch.finfo(p_node.dtype).tiny))
    parent_node = parent_slot - 1  # -1: the root
    path_ok = torch.zeros(B, N, dtype=torch.bool, device=device)
    path_log_p = torch.zeros(B, N, dtype=log_p.dtype, device=device)
    D = drafts.max_depth
    for depth in range(1, D + 1):  # parents are settled one depth before their children
        at = drafts.depth == depth
        up_ok = torch.where(parent_node >= 0, path_ok.gather(1, parent_node.clamp(min=0)), True)
        up_log_p = torch.where(parent_node >= 0, path_log_p.gather(1, parent_node.clamp(min=0)), 0.0)
        path_ok = torch.where(at, passes & up_ok, path_ok)
        path_log_p = torch.where(at, log_p + up_log_p, path_log_p)

    reached = torch.where(path_ok, drafts.depth, 0)
    num_accepted = reached.max(1).values if N else torch.zeros(B, dtype=torch.long, device=device)
    deepest = path_ok & (reached == num_accepted[:, None]) & (num_accepted[:, None] > 0)
    best = torch.where(deepest, path_log_p, float("-inf")).argmax(1) if N else num_accepted  # first on ties

    accepted = torch.full((B, max(D, 1)), -1, dtype=torch.long, device=device)
    node = torch.where(num_accepted > 0, best, -1)
    for _ in range(D):  # walk up from the chosen node, writing each depth's node
        on = node >= 0
        if not bool(on.any()):
            break
        safe = node.clamp(min=0)
        d = drafts.depth[rows, safe] - 1
        accepted[rows[on], d[on]] = node[on]
        node = torch.where(on, parent_node[rows, safe], -1)
    next_slot = torch.where(num_accepted > 0, best + 1, 0)
    next_token = coin.sample(target_probs[rows, next_slot], torch.ones(B, dtype=torch.bool, device=device))
    return Verdict(accepted, num_accepted, next_token)
