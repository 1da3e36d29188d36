"""`native_mtp`: a chain of up to `depth` tokens from the multi-token-prediction layers the target's
own checkpoint ships (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5, Mellum, ...: heads/native_mtp.py),
no training needed. It drafts as `mtp` does with a trained module: the first MTP layer, chained on
its own output features beyond depth 1. Greedy tokens are its argmax (with `top_k` > 1, an EAGLE-2
dynamic tree of its top-k guesses); sampled ones are drawn from its distribution after the target's
own processing and returned as q, so the verifier stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..heads.native_mtp import load_native_mtp
from ..models import check_dtype_name
from .draft_vocab import check_needs_draft_vocab, read_token_order
from .dynamic_tree import check_min_confidence
from .feature_head import FeatureHeadDrafter
from .int8_linear import check_quantize
from .registry import register


@register
class NativeMTPDrafter(FeatureHeadDrafter):
    name = "native_mtp"

    @dataclass
    class Options:
        depth: int = 3  # tokens drafted per round (the tree's depth with top_k > 1)
        top_k: int = 1  # > 1: at T=0 an EAGLE-2 dynamic tree, top_k children per expanded node (1: a chain)
        total_tokens: int = 10  # top_k > 1: nodes kept in the verified tree
        min_confidence: float = 0.0  # top_k > 1: keep only nodes whose path confidence reaches it
        draft_vocab: int | None = None  # draft among the N tokens the target picks most (None = all)
        vocab_order: str | None = None  # draft_vocab's order: a JSON file or folder (`draftsman vocab` writes one)
        draft_vocab_sampling: bool = False  # sampled rounds draft among those N tokens too (costs acceptance)
        dtype: str | None = None  # the layer's compute dtype: bfloat16, auto, ... (default: the target's)
        quantize: str | None = None  # "int8": int8 weights, float32 around them (CPU only); "auto": int8 on CPU

        def __post_init__(self):
            check_needs_draft_vocab("native_mtp", self.draft_vocab, vocab_order=self.vocab_order,
                                    draft_vocab_sampling=self.draft_vocab_sampling)
            if self.draft_vocab is not None and not self.vocab_order:
                raise ValueError("native_mtp: draft_vocab needs vocab_order, the target's token order (write one "
                                 "with `draftsman vocab --target TARGET_FOLDER --out FILE`)")
            if self.dtype is not None:
                check_dtype_name(self.dtype)
            check_quantize("native_mtp", self.quantize, self.dtype)
            check_min_confidence("native_mtp", self.min_confidence)
            for key in ("depth", "top_k", "total_tokens"):
                if getattr(self, key) < 1:
                    raise ValueError(f"native_mtp: {key} must be >= 1, got {getattr(self, key)}")

    def load_head(self, options, target):
        head = load_native_mtp(target.model, self.name)
        config = {"kind": "mtp"}  # what a trained head's config.json says; no token order unless given
        if options.draft_vocab is not None:
            config["tokens_by_frequency"] = read_token_order(options.vocab_order, target.vocab_size, self.name,
                                                              target_model=target.model)
        return head, config

    def draft(self, feature, logits, depth, ready):
        o = self.options
        return self.draft_chain_or_tree(feature, logits, depth, ready, o.top_k, o.total_tokens, o.min_confidence)
