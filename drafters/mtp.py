"""`mtp`: a chain of up to `depth` tokens from a multi-token-prediction module (heads/feature_head.py,
kind mtp, as in DeepSeek-V3), chained on its own output features beyond the one depth it was
trained for. Greedy: each token is the module's argmax (deterministic); with `top_k` > 1, an
EAGLE-2 dynamic tree of its top-k guesses instead (as SGLang can draft DeepSeek's MTP).
Sampling: each token is drawn from the module's distribution after the target's own processing
(temperature, top-k, top-p) and that distribution is returned as q, so the verifier's rejection
sampling stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models import check_dtype_name
from .draft_vocab import check_needs_draft_vocab
from .dynamic_tree import check_min_confidence
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
        depth: int = 3  # tokens drafted per round (the tree's depth with top_k > 1)
        top_k: int = 1  # > 1: at T=0 an EAGLE-2 dynamic tree, top_k children per expanded node (1: a chain)
        total_tokens: int = 10  # top_k > 1: nodes kept in the verified tree
        min_confidence: float = 0.0  # top_k > 1: keep only nodes whose path confidence reaches it
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
            check_min_confidence("mtp", self.min_confidence)
            for key in ("depth", "top_k", "total_tokens"):
                if getattr(self, key) < 1:
                    raise ValueError(f"mtp: {key} must be >= 1, got {getattr(self, key)}")

    def draft(self, feature, logits, depth, ready):
        o = self.options
        return self.draft_chain_or_tree(feature, logits, depth, ready, o.top_k, o.total_tokens, o.min_confidence)
