"""`eagle`: an EAGLE-2 dynamic draft tree (drafters/dynamic_tree.py) from an EAGLE head
(heads/feature_head.py, kind eagle or eagle3). Every node of the tree is a deterministic top-k
choice, and every node of a sampled chain (below) carries the distribution it was drawn from: the
shared verifier keeps the output exact at any temperature.

When the request samples (temperature > 0), a deterministic token x is accepted with the target's
probability p(x), so a tree of top-k guesses is accepted about as often as its tokens hold the
target's mass: little, where the target's distribution is flat. A token drawn from the head's own
distribution q is accepted with probability sum_x min(p(x), q(x)), high where q follows p. So by
default sampled rounds draft a chain of `depth` tokens drawn from q (FeatureHeadDrafter.draft_chain,
q returned with each node); `sampled_rounds: tree` keeps the top-k tree there too. The bundled
EAGLE-3 head at T=1: first-token acceptance 0.32-0.49 as a tree, 0.58-0.72 as a chain; tau
1.5-1.7 against 2.2-2.8; 0.56-0.70x plain decoding against 0.92-1.14x.

A sampled chain is accepted less deep than the greedy tree, so `sampled_depth` may stop it
shorter: with the bundled int8 EAGLE-3 head and a depth-6 tree, a sampled chain of 5 ran
1.09x / 1.29x / 1.18x plain decoding at T=1, a chain of 6 0.98x / 1.20x / 0.99x.

The scores are the head's log-probabilities; an EAGLE-3 head learns the target's distribution, so
at T=0 its logits are first multiplied by the `greedy_score_scale` fitted at training (how sure to
be that a token is the target's argmax, not how probable it is). Only the tree's shape changes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models import check_dtype_name
from .dynamic_tree import check_min_confidence, dynamic_tree
from .draft_vocab import check_needs_draft_vocab
from .feature_head import FeatureHeadDrafter
from .int8_linear import check_quantize
from .registry import register


SAMPLED_ROUNDS = ("chain", "tree")


@register
class EagleDrafter(FeatureHeadDrafter):
    name = "eagle"
    head_kinds = ("eagle", "eagle3")  # the same dynamic tree drafts from EAGLE-1/2 and EAGLE-3 heads

    @dataclass
    class Options:
        path: str | None = None  # folder of a trained EAGLE head (draftsman train eagle or eagle3)
        depth: int = 5  # deepest draft token
        top_k: int = 4  # children per expanded node, and nodes expanded per depth
        total_tokens: int = 12  # nodes kept in the verified tree (the target pass's size)
        min_confidence: float = 0.0  # keep only nodes whose path confidence is at least this (drafters/dynamic_tree.py)
        draft_vocab: int | None = None  # EAGLE-1/2 heads: draft among the N tokens the target picks most (None = all)
        draft_vocab_sampling: bool = False  # sampled rounds draft among those N tokens too (costs acceptance)
        dtype: str | None = None  # the head's compute dtype: bfloat16, auto (bfloat16 where native), ... (default: the target's)
        quantize: str | None = None  # "int8": int8 weights, float32 around them (CPU only); "auto": int8 on CPU (drafters/int8_linear.py)
        sampled_rounds: str = "chain"  # temperature > 0: "chain" draws `depth` tokens from the head's
        # distribution (q known: exact); "tree" keeps the deterministic top-k tree of greedy rounds
        sampled_depth: int | None = None  # temperature > 0: draft this deep instead of `depth`

        def __post_init__(self):
            check_needs_draft_vocab("eagle", self.draft_vocab, draft_vocab_sampling=self.draft_vocab_sampling)
            if self.dtype is not None:
                check_dtype_name(self.dtype)
            check_quantize("eagle", self.quantize, self.dtype)
            if self.sampled_rounds not in SAMPLED_ROUNDS:
                raise ValueError(f"eagle: sampled_rounds must be one of {list(SAMPLED_ROUNDS)}, got {self.sampled_rounds!r}")
            if not self.path:
                raise ValueError("eagle: set drafter.path to a trained EAGLE head folder (draftsman train eagle)")
            check_min_confidence("eagle", self.min_confidence)
            if self.sampled_depth is not None and self.sampled_depth < 1:
                raise ValueError(f"eagle: sampled_depth must be >= 1 or unset, got {self.sampled_depth}")
            for key in ("depth", "top_k", "total_tokens"):
                if getattr(self, key) < 1:
                    raise ValueError(f"eagle: {key} must be >= 1, got {getattr(self, key)}")

    def max_depth(self) -> int:
        """A sampled chain is accepted less deep than a greedy tree, so it may stop shorter."""
        sampled = self.sampling is not None and not self.shape_sampling().greedy
        if sampled and self.options.sampled_depth is not None:
            return self.options.sampled_depth
        return self.options.depth

    @property
    def score_scale(self) -> float:
        """Greedy trees rank by the head's calibrated confidences, sampled rounds by its own: by
        the round's shape setting (greedy rows left in a batch that began sampled are greedy)."""
        return self.head_config.get("greedy_score_scale", 1.0) if self.shape_sampling().greedy else 1.0

    def draft(self, feature, logits, depth, ready):
        o = self.options
        if not self.shape_sampling().greedy and o.sampled_rounds == "chain":
            return self.draft_chain(feature, logits, depth, ready)
        return dynamic_tree(self.lm, self.grow, logits, feature, depth, o.top_k, o.total_tokens, ready.tolist(),
                            self.token_ids, self.score_scale, self.repeats, o.min_confidence, self.eos_ban,
                            self.path_bans)
