"""`mtp`: a chain of up to `depth` tokens from a multi-token-prediction module (heads/feature_head.py,
kind mtp, as in DeepSeek-V3), chained on its own output features beyond the one depth it was
trained for. Greedy: each token is the module's argmax (deterministic). Sampling: each token is
drawn from the module's distribution after the target's own processing (temperature, top-k,
top-p) and that distribution is returned as q, so the verifier's rejection sampling stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models import check_dtype_name
from .draft_vocab import check_needs_draft_vocab
from .feature_head import FeatureHeadDrafter
from .int8_linear import check_quantize
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
        draft_vocab_sampling: bool = False  # sampled rounds draft among those N tokens too (costs acceptance)
        dtype: str | None = None  # the head's compute dtype: bfloat16, auto (bfloat16 where native), ... (default: the target's)
        quantize: str | None = None  # "int8": int8 weights, float32 around them (CPU only); "auto": int8 on CPU (drafters/int8_linear.py)

        def __post_init__(self):
            check_needs_draft_vocab("mtp", self.draft_vocab, draft_vocab_sampling=self.draft_vocab_sampling)
            if self.dtype is not None:
                check_dtype_name(self.dtype)
            check_quantize("mtp", self.quantize, self.dtype)
            if not self.path:
                raise ValueError("mtp: set drafter.path to a trained MTP module folder (draftsman train mtp)")
            if self.depth < 1:
                raise ValueError(f"mtp: depth must be >= 1, got {self.depth}")

    def draft(self, feature, logits, depth, ready):
        return self.draft_chain(feature, logits, depth, ready)
