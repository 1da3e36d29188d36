"""Exact tree verification: a pure function of tensors (no model, no cache, no EOS policy).

Words:
  accepted   a draft node that passed its test; the accepted nodes form a path from the root.
  recovered  the token drawn from the residual distribution when every child of the path's last
             node was rejected.
  bonus      the token drawn from the target's distribution after an accepted node with no
             children. Recovered and bonus are the same draw here: `residual` starts as the
             target's distribution and only shrinks on a rejection.

At a node, children are tested in production order. Child x is accepted with probability
min(1, residual(x) / q~(x)); on rejection residual <- normalise(max(residual - q~, 0)). q~ is the
draft distribution as the child saw it: q for IID children, q without earlier siblings' tokens
(renormalised) for WITHOUT_REPLACEMENT children, one-hot for DETERMINISTIC ones. This keeps the
emitted tokens distributed exactly as the target's own samples (SpecInfer / SpecTr style multi-
draft rejection sampling; Leviathan et al. for a chain).

All rows advance together: the loops are over depth and sibling rank, never over the vocabulary.
Randomness comes from a `Coin`, so tests can enumerate every outcome of the real code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafters.base import DETERMINISTIC, WITHOUT_REPLACEMENT
from .sampling import processed_probs, sample_from
from .tree import PackedDrafts


class Coin:
    """Source of the verifier's randomness. `mask` marks rows whose outcome matters."""

    def accept(self, prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # (B,) -> (B,) bool
        raise NotImplementedError

    def sample(self, probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,) long
        raise NotImplementedError


class GeneratorCoin(Coin):
    """Production randomness: uniforms from an explicit torch.Generator. Every call draws for all
    rows (a fixed shape), so a seeded run consumes the stream identically each time."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def _uniforms(self, n: int, device) -> torch.Tensor:
        g = self.generator
        return torch.rand(n, generator=g, device=g.device, dtype=torch.float64).to(device)

    def accept(self, prob, mask):
        return self._uniforms(prob.shape[0], prob.device) < prob.to(torch.float64)

    def sample(self, probs, mask):
        return sample_from(probs, self._uniforms(probs.shape[0], probs.device))


@dataclass
class Verdict:
    accepted: torch.Tensor  # (B, D) node indices along the accepted path, -1 padding
    num_accepted: torch.Tensor  # (B,) long
    next_token: torch.Tensor  # (B,) long: bonus or recovered token


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def sibling_draft_probs(kinds, tokens, draft_probs, earlier_siblings, vocab_size, dtype,
                        without_replacement: bool = True, deterministic: bool = True):
    """q~ for the current child of every row (B, V): see the module docstring. without_replacement
    / deterministic False: no node being tested is of that kind, so its passes over the
    vocabulary are skipped (the rows tested get the same q~)."""
    if draft_probs is None:
        return torch.nn.functional.one_hot(tokens, vocab_size).to(dtype)
    q = draft_probs
    if without_replacement:
        wor = _normalise(draft_probs.masked_fill(earlier_siblings, 0.0))
        q = torch.where((kinds == WITHOUT_REPLACEMENT)[:, None], wor, q)
    if deterministic:
        q = torch.where((kinds == DETERMINISTIC)[:, None], torch.nn.functional.one_hot(tokens, vocab_size).to(dtype), q)
    return q


def verify_sampled(target_probs: torch.Tensor, drafts: PackedDrafts, coin: Coin) -> Verdict:
    """target_probs (B, N + 1, V): slot 0 is the distribution after the root, slot i + 1 the one
    after node i. Returns the accepted path and the next token per row."""
    B, _, V = target_probs.shape
    dtype = target_probs.dtype
    rows = torch.arange(B, device=target_probs.device)
    D = drafts.max_depth
    accepted = torch.full((B, max(D, 1)), -1, dtype=torch.long, device=target_probs.device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=target_probs.device)
    next_token = torch.zeros(B, dtype=torch.long, device=target_probs.device)
    slot = torch.zeros(B, dtype=torch.long, device=target_probs.device)  # current node's slot
    residual = target_probs[:, 0]
    walking = torch.ones(B, dtype=torch.bool, device=target_probs.device)
    # Which kinds of node there are (a chain of draws has no without-replacement siblings, a
    # sampled round no deterministic node): each (B, V) pass a kind needs is made only if it is present.
    without_replacement = bool(((drafts.kinds == WITHOUT_REPLACEMENT) & drafts.valid).any())
    deterministic = bool(((drafts.kinds == DETERMINISTIC) & drafts.valid).any())
    for depth in range(D + 1):
        kids = drafts.children[rows, slot]  # (B, C)
        chosen = torch.full((B,), -1, dtype=torch.long, device=target_probs.device)
        earlier = torch.zeros(B, V, dtype=torch.bool, device=target_probs.device) if without_replacement else None
        for rank in range(kids.shape[1]):
            child = kids[:, rank]
            testing = walking & (child >= 0) & (chosen < 0)
            if not bool(testing.any()):
                break
            c = child.clamp(min=0)
            token = drafts.tokens[rows, c]
            q_rows = None if drafts.draft_probs is None else drafts.draft_probs[rows, c].to(dtype)
            q_tilde = sibling_draft_probs(drafts.kinds[rows, c], token, q_rows, earlier, V, dtype,
                                          without_replacement, deterministic)
            r_x = residual.gather(1, token[:, None]).squeeze(1)
            q_x = q_tilde.gather(1, token[:, None]).squeeze(1)
            # A token the drafter could not have produced (q~ = 0) is never accepted.
            p_accept = torch.where(q_x > 0, (r_x / q_x.clamp_min(torch.finfo(dtype).tiny)).clamp(max=1.0),
                                   torch.zeros_like(r_x))
            p_accept = torch.where(testing, p_accept, torch.zeros_like(p_accept))
            ok = coin.accept(p_accept, testing) & testing
            chosen = torch.where(ok, child, chosen)
            rejected = testing & ~ok
            if bool(rejected.any()):
                residual = torch.where(rejected[:, None], _normalise((residual - q_tilde).clamp_min(0)), residual)
            if earlier is not None:
                earlier[rows[testing], token[testing]] = True
        moved = walking & (chosen >= 0)
        stopped = walking & ~moved
        if bool(stopped.any()):
            drawn = coin.sample(residual, stopped)
            next_token = torch.where(stopped, drawn, next_token)
        if depth < accepted.shape[1]:
            accepted[:, depth] = torch.where(moved, chosen, accepted[:, depth])
        num_accepted += moved.long()
        walking = moved
        if not bool(walking.any()):
            break
        slot = torch.where(moved, chosen + 1, slot)
        residual = torch.where(moved[:, None], target_probs[rows, slot], residual)
    return Verdict(accepted, num_accepted, next_token)


def verify_greedy(target_argmax: torch.Tensor, drafts: PackedDrafts) -> Verdict:
    """Temperature 0: follow the first child equal to the target's argmax at each node; the next
    token is the argmax after the last accepted node. target_argmax is (B, N + 1)."""
    B = target_argmax.shape[0]
    device = target_argmax.device
    rows = torch.arange(B, device=device)
    D = drafts.max_depth
    accepted = torch.full((B, max(D, 1)), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    slot = torch.zeros(B, dtype=torch.long, device=device)
    walking = torch.ones(B, dtype=torch.bool, device=device)
    for depth in range(D):
        kids = drafts.children[rows, slot]  # (B, C)
        kid_tokens = drafts.tokens[rows[:, None], kids.clamp(min=0)]
        match = (kids >= 0) & (kid_tokens == target_argmax[rows, slot][:, None])
        has = walking & match.any(-1)
        first = match.to(torch.long).argmax(-1)  # first matching sibling
        chosen = kids[rows, first]
        accepted[:, depth] = torch.where(has, chosen, accepted[:, depth])
        num_accepted += has.long()
        slot = torch.where(has, chosen + 1, slot)
        walking = has
        if not bool(walking.any()):
            break
    return Verdict(accepted, num_accepted, target_argmax[rows, slot])


def verify_greedy_chains(target_argmax: torch.Tensor, chain_tokens: torch.Tensor, valid: torch.Tensor) -> Verdict:
    """Temperature 0, every row's draft a chain: the accepted path is the longest prefix of the
    chain equal to the target's argmax after each node. target_argmax (B, N + 1), chain_tokens and
    valid (B, N) (padding invalid). Same result as verify_greedy on the packed chains."""
    match = (chain_tokens == target_argmax[:, :-1]) & valid
    count = match.long().cumprod(1).sum(1)
    N = chain_tokens.shape[1]
    steps = torch.arange(max(N, 1), device=count.device)
    accepted = torch.where(steps[None, :] < count[:, None], steps[None, :], torch.full_like(steps, -1)[None, :])
    return Verdict(accepted, count, target_argmax.gather(1, count[:, None])[:, 0])


def verify_plain(next_logits: torch.Tensor, sampling, coin: Coin) -> Verdict:
    """No drafts in any row: the next token is the target's argmax, or one draw from its processed
    distribution with the same coin call verify_sampled makes on empty trees."""
    B, device = next_logits.shape[0], next_logits.device
    if sampling.greedy:
        chosen = next_logits.argmax(-1)
    else:
        chosen = coin.sample(processed_probs(next_logits, sampling), torch.ones(B, dtype=torch.bool, device=device))
    return Verdict(torch.full((B, 1), -1, dtype=torch.long, device=device),
                   torch.zeros(B, dtype=torch.long, device=device), chosen)
