"""Drafting under a repetition penalty: a model drafter penalises its own logits the way the
engine penalises the target's (verifier/sampling.py), each draft token for its own context (the
committed tokens and the draft tokens above it), so its guesses follow the penalised target.

The penalty acts on raw logits, so this pays for logits on the target's scale. On the bundled
target at T=0 with repetition_penalty 1.2 (18 prompts), tau rose from 4.36 to 4.99 for EAGLE-3,
2.46 to 2.53 for MTP, 2.10 to 2.12 for Medusa (whose heads see the committed text only: its
candidates are ranked per head, not per node). The separately trained draft model's tree fell
from 2.53 to 2.38, so `draft_model` penalises its drafts only under `penalise_drafts`
(docs/choosing-a-drafter.md).

Drafts only. A sampled draft token's q is the distribution it was drawn from, penalised or not,
so the verifier stays exact either way (tests/test_engine_sampling.py).
"""
from __future__ import annotations

import torch

from ..verifier.context_tokens import ContextTokens
from ..verifier.sampling import penalize_repeats


class DraftRepeats:
    """The tokens each draft position has seen, over the drafter's logits (the whole vocabulary,
    or a draft vocabulary's rows: `vocab_map` row -> token id)."""

    def __init__(self, penalty: float, context_seen: torch.Tensor, width: int, vocab_map: torch.Tensor | None):
        """context_seen (B, V): the tokens each row's committed context holds."""
        self.penalty = penalty
        self.root_seen = context_seen[:, :width] if vocab_map is None else context_seen[:, vocab_map]  # (B, width)

    @classmethod
    def for_round(cls, sampling, context_tokens: ContextTokens, contexts, width, vocab_map) -> "DraftRepeats | None":
        """None when the request has no repetition penalty (drafting is then unchanged).
        context_tokens: the drafter's own tracker of `contexts` (updated here, once a round)."""
        if sampling is None or not sampling.penalizes_repeats:
            return None
        return cls(sampling.repetition_penalty, context_tokens.update(contexts), width, vocab_map)

    def penalise(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """(..., width) logits of positions whose contexts hold `seen` (..., width)."""
        return penalize_repeats(logits[..., : seen.shape[-1]], seen, self.penalty)

    @staticmethod
    def plus(seen: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The seen sets (..., width) after appending the drafted logit indices (...)."""
        return seen.clone().scatter_(-1, index[..., None], True)
