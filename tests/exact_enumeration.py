"""Exact (float64) enumeration of every outcome of the real verifier on toy vocabularies.

The verifier takes its randomness from a Coin. `ScriptedCoin` answers each call from a script of
choices and records how many outcomes the call had and their probabilities; `enumerate_outcomes`
replays the code once per outcome path (depth-first), so the probability of each result is
computed exactly from the real code, with no sampling noise.

A toy target maps a context (tuple of tokens) to logits; the toy drafter samples its tree through
the same coin, so draft draws and verification decisions are enumerated together.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import torch

from draftsman.drafters.base import DETERMINISTIC, IID, DraftTree
from draftsman.verifier.rejection import Coin, verify_sampled
from draftsman.verifier.sampling import SamplingParams, processed_probs
from draftsman.verifier.tree import pack_drafts

F64 = torch.float64


class ScriptedCoin(Coin):
    """Batch size 1. Follows `script` (choice indices), then takes choice 0 at new decision points."""

    def __init__(self, script: list[int]):
        self.script = script
        self.choices: list[int] = []
        self.fanout: list[int] = []
        self.prob = 1.0

    def _choose(self, options: list[tuple[object, float]]):
        options = [(v, p) for v, p in options if p > 0]
        i = self.script[len(self.choices)] if len(self.choices) < len(self.script) else 0
        self.choices.append(i)
        self.fanout.append(len(options))
        value, p = options[i]
        self.prob *= p
        return value

    def accept(self, prob, mask):
        if not bool(mask[0]):
            return torch.zeros(1, dtype=torch.bool)
        p = float(prob[0])
        return torch.tensor([self._choose([(True, p), (False, 1.0 - p)])])

    def sample(self, probs, mask):
        if not bool(mask[0]):
            return torch.zeros(1, dtype=torch.long)
        row = probs[0] / probs[0].sum()
        return torch.tensor([self._choose([(t, float(row[t])) for t in range(row.shape[0])])])


def enumerate_outcomes(run) -> dict:
    """run(coin) -> hashable outcome. Returns {outcome: exact probability}."""
    dist: dict = defaultdict(float)
    stack: list[list[int]] = [[]]
    while stack:
        script = stack.pop()
        coin = ScriptedCoin(script)
        outcome = run(coin)
        dist[outcome] += coin.prob
        for pos in range(len(script), len(coin.fanout)):
            for alt in range(1, coin.fanout[pos]):
                stack.append(coin.choices[:pos] + [alt])
    return dict(dist)


@dataclass
class ToyWorld:
    """A toy target and drafter over a small vocabulary, deterministic per context."""

    vocab: int
    params: SamplingParams
    seed: int = 0
    draft_processed: bool = True  # q from the same processing as the target (like draft_model)
    # q processed by other settings than the target's (a batch row with its own temperature, top_k,
    # ...: the drafter drafts under the settings most rows have); None: the target's
    draft_params: SamplingParams | None = None

    def _logits(self, ctx: tuple, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, salt, ctx)) % (2**31))
        return torch.randn(self.vocab, generator=g, dtype=F64) * 1.5

    def target_probs(self, ctx: tuple) -> torch.Tensor:
        return processed_probs(self._logits(ctx, 1), self.params)

    def draft_probs(self, ctx: tuple) -> torch.Tensor:
        logits = self._logits(ctx, 2)
        params = self.draft_params or self.params
        if self.draft_processed and not params.greedy:
            return processed_probs(logits, params)
        return logits.softmax(-1)


def draw_tree(world: ToyWorld, parents: list[int], kinds: list[int], coin: Coin) -> DraftTree:
    """Sample a tree of the given shape through the coin. Deterministic nodes take the draft's
    argmax among tokens not used by earlier deterministic siblings (so siblings differ)."""
    tokens: list[int] = []
    rows = []
    for i, (p, kind) in enumerate(zip(parents, kinds)):
        ctx = () if p < 0 else path_tokens(parents, tokens, p)
        q = world.draft_probs(ctx)
        earlier = [tokens[j] for j in range(i) if parents[j] == p]
        if kind == DETERMINISTIC:
            masked = q.clone()
            masked[earlier] = -1.0
            tok = int(masked.argmax()) if len(earlier) < world.vocab else 0
        elif kind == IID:
            tok = int(coin.sample(q[None], torch.ones(1, dtype=torch.bool))[0])
        else:
            masked = q.clone()
            masked[earlier] = 0.0
            tok = int(coin.sample(masked[None], torch.ones(1, dtype=torch.bool))[0])
        tokens.append(tok)
        rows.append(q)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(kinds),
                     torch.stack(rows) if rows else None)


def path_tokens(parents: list[int], tokens: list[int], node: int) -> tuple:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(reversed(path))


def one_round(world: ToyWorld, parents, kinds, coin: Coin, transform=None) -> tuple:
    """Draft, verify with the real verifier, return the emitted tokens."""
    tree = draw_tree(world, parents, kinds, coin)
    contexts = [()] + [path_tokens(parents, tree.tokens.tolist(), i) for i in range(tree.size)]
    target = torch.stack([world.target_probs(c) for c in contexts])[None]  # (1, N + 1, V)
    drafts = pack_drafts([tree], world.vocab, "cpu", prob_dtype=F64)
    if transform is not None:
        drafts = transform(drafts)
    verdict = verify_sampled(target, drafts, coin)
    path = verdict.accepted[0, : int(verdict.num_accepted[0])].tolist()
    return tuple(tree.tokens[path].tolist()) + (int(verdict.next_token[0]),)


def emitted_distribution(world: ToyWorld, parents, kinds, transform=None) -> dict:
    return enumerate_outcomes(lambda coin: one_round(world, parents, kinds, coin, transform))


def total_variation_from_target(world: ToyWorld, emitted: dict, length: int) -> float:
    """Complete every emitted sequence with the target's own sampling up to `length` tokens and
    compare that joint distribution with the target's: exactness holds iff they are equal."""
    completed: dict = defaultdict(float)
    for seq, p in emitted.items():
        for tail in itertools.product(range(world.vocab), repeat=length - len(seq)):
            full, q = seq, p
            for t in tail:
                q *= float(world.target_probs(full)[t])
                full = full + (t,)
            completed[full] += q
    tv = 0.0
    for full in itertools.product(range(world.vocab), repeat=length):
        p_target, ctx = 1.0, ()
        for t in full:
            p_target *= float(world.target_probs(ctx)[t])
            ctx = ctx + (t,)
        tv += abs(p_target - completed.get(full, 0.0))
    return tv / 2
