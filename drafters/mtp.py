"""`mtp`: a chain of up to `depth` tokens from a multi-token-prediction module (heads/feature_head.py,
kind mtp, as in DeepSeek-V3), chained on its own output features beyond the one depth it was
trained for. Greedy: each token is the module's argmax (deterministic). Sampling: each token is
drawn from the module's distribution after the target's own processing (temperature, top-k,
top-p) and that distribution is returned as q, so the verifier's rejection sampling stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import check_dtype_name
from ..verifier.sampling import draw, processed_probs
from .base import DETERMINISTIC, IID, DraftTree
from .feature_head import FeatureHeadDrafter
from .registry import register


@register
class MTPDrafter(FeatureHeadDrafter):
    name = "mtp"
    head_kinds = ("mtp",)

    @dataclass
    class Options:
        path: str | None = None  # folder of a trained MTP module (draftsman train mtp)
        depth: int = 3  # tokens drafted per round
        draft_vocab: int | None = None  # draft among the N tokens the target picks most (None = all)
        dtype: str | None = None  # the head's compute dtype: bfloat16, auto (bfloat16 where native), ... (default: the target's)

        def __post_init__(self):
            if self.dtype is not None:
                check_dtype_name(self.dtype)
            if not self.path:
                raise ValueError("mtp: set drafter.path to a trained MTP module folder (draftsman train mtp)")
            if self.depth < 1:
                raise ValueError(f"mtp: depth must be >= 1, got {self.depth}")

    def draft(self, feature, logits, depth, ready):
        B = feature.shape[0]
        tokens, probs = [], []
        visible = None
        for d in range(1, depth + 1):
            p = processed_probs(logits, self.sampling)  # over the head's logits (all, or draft_vocab)
            index = p.argmax(-1) if self.sampling.greedy else draw(p, self.generator)
            token = self.token_ids(index)
            tokens.append(token)
            probs.append(p)
            if d == depth:
                break
            slots_before = self.lm.num_slots
            feature, logits = self.grow(feature[:, None], token[:, None], d, visible)
            feature, logits = feature[:, 0], logits[:, 0]
            seen = torch.zeros(B, 1, self.lm.num_slots, dtype=torch.bool, device=self.device)
            if visible is not None:
                seen[..., : visible.shape[-1]] = visible
            seen[:, 0, slots_before] = True  # the next token sees this one (and its ancestors)
            visible = seen
        chain = torch.stack(tokens, 1)  # (B, depth)
        ready = ready.tolist()
        if self.sampling.greedy:
            return [DraftTree.chain(chain[b], DETERMINISTIC, device=self.device) if ready[b]
                    else DraftTree.empty(self.device) for b in range(B)]
        q = self.full_vocab(torch.stack(probs, 1))  # (B, depth, V): what each token was drawn from
        return [DraftTree.chain(chain[b], IID, q[b], device=self.device) if ready[b]
                else DraftTree.empty(self.device) for b in range(B)]
