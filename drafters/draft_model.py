"""`draft_model`: a separate small causal LM that shares the target's tokenizer. It drafts a chain
of k tokens autoregressively with the same sampling processing as the target, so each token's
distribution q is known exactly (greedy drafts are deterministic), and keeps its own KV cache,
rolled back to the accepted tokens after each round.

With `top_k > 1`, greedy rounds draft an EAGLE-2 dynamic tree instead (drafters/dynamic_tree.py:
depth k, the top_k most confident nodes expanded per depth, the best `total_tokens` kept): one
draft-model call per depth, as for the chain, and at batch 1 a target pass over a dozen tokens
costs about what a pass over five does. Sampled rounds keep the chain drawn from q."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import context_length, load_causal_lm, load_tokenizer, vocab_mismatch
from ..verifier.cached_model import CachedLM
from ..verifier.sampling import draw, processed_probs
from ..verifier.tree import TreeBlock
from .base import DETERMINISTIC, IID, Drafter, DraftTree
from .dynamic_tree import dynamic_tree, grow_level
from .registry import register


@register
class DraftModelDrafter(Drafter):
    name = "draft_model"

    @dataclass
    class Options:
        path: str | None = None  # local Hugging Face folder of the draft model
        k: int = 4  # tokens drafted per round
        dtype: str | None = None  # default: the target's dtype
        min_confidence: float | None = None  # stop a row's draft after a token drawn with prob < this
        top_k: int = 1  # greedy rounds: > 1 drafts a dynamic tree of depth k instead of a chain
        total_tokens: int = 10  # nodes kept in that tree

        def __post_init__(self):
            if not self.path:
                raise ValueError("draft_model: set drafter.path to the draft model's local folder")
            for key in ("k", "top_k", "total_tokens"):
                if getattr(self, key) < 1:
                    raise ValueError(f"draft_model: {key} must be >= 1, got {getattr(self, key)}")
            if self.min_confidence is not None and not 0 <= self.min_confidence <= 1:
                raise ValueError(f"draft_model: min_confidence must be in [0, 1], got {self.min_confidence}")

    def __init__(self, options: "DraftModelDrafter.Options", target):
        self.options = options
        self.k = options.k
        dtype = options.dtype or str(target.dtype).replace("torch.", "")
        model = load_causal_lm(options.path, dtype, target.device, what="drafter.path")
        problem = vocab_mismatch(target.tokenizer, load_tokenizer(options.path), target.vocab_size,
                                 model.get_output_embeddings().weight.shape[0])
        if problem:
            raise ValueError(f"draft model '{options.path}' cannot draft for target '{target.path}': {problem}. "
                             "A draft model must use the target's tokenizer (same vocabulary and special tokens).")
        self.lm = CachedLM(model)
        self.vocab_size = target.vocab_size
        self.context = context_length(model.config)
        self._parameters = sum(p.numel() for p in model.parameters())

    def max_depth(self) -> int:
        return self.k

    def extra_parameters(self) -> int:
        return self._parameters

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.lm.reset(len(prompts))
        self.round_start = None

    def keep_rows(self, indices):
        self.lm.select_rows(indices)

    def _next_distribution(self, logits: torch.Tensor) -> torch.Tensor:
        return processed_probs(logits[..., : self.vocab_size], self.sampling)

    def propose(self, contexts):
        B = len(contexts)
        k = min(self.k if self.depth_limit is None else min(self.k, self.depth_limit),
                self.context - max(len(c) for c in contexts))
        self.round_start, self.round_k = None, k
        if k <= 0:  # the draft model's own context is full: let the target go alone
            return [DraftTree.empty(self.lm.device) for _ in contexts]
        # 1. Feed every row's tokens that the draft cache has not seen (the root at least).
        cached = self.lm.lengths.tolist()
        unseen = [ctx[n:] for ctx, n in zip(contexts, cached)]
        last = torch.tensor([len(u) - 1 for u in unseen], device=self.lm.device)
        logits, _ = self.lm.forward(TreeBlock.chains(unseen, self.lm.device), logits_at=last)  # (B, V)
        self.lm.accept([list(range(len(u))) for u in unseen])
        if self.options.top_k > 1 and self.sampling.greedy:
            trees = dynamic_tree(self.lm, self._grow, logits[..., : self.vocab_size], None, k, self.options.top_k,
                                 self.options.total_tokens, [True] * B)
            self.lm.rollback(self.lm.lengths.clone())  # drop the grown slots; accepted ones are re-fed next round
            return trees
        self.round_start = torch.tensor([len(c) for c in contexts])
        # 2. Draft k tokens one at a time; with min_confidence, a row stops after a token the draft
        # model itself gave less than that probability (its next guesses are rarely accepted), and
        # drafting ends when every row has stopped (as transformers' assisted generation does).
        tokens, probs = [], []
        length = torch.full((B,), k, dtype=torch.long, device=self.lm.device)
        for step in range(k):
            p = self._next_distribution(logits)
            tok = p.argmax(-1) if self.sampling.greedy else draw(p, self.generator)
            tokens.append(tok)
            probs.append(p)
            if self.options.min_confidence is not None:
                # The draft model's own probability of its token (greedy processing gives one-hot p).
                confidence = logits[..., : self.vocab_size].float().softmax(-1).gather(1, tok[:, None])[:, 0]
                unsure = (confidence < self.options.min_confidence) & (length == k)
                length = torch.where(unsure, step + 1, length)
                if bool((length < k).all()):
                    break
            if step < k - 1:
                logits, _ = self.lm.forward(TreeBlock.column(tok))
                self.lm.accept([[0]] * B)
                logits = logits[:, 0]
        tokens_bk = torch.stack(tokens, 1)  # (B, drafted)
        n = length.clamp(max=tokens_bk.shape[1]).tolist()
        if self.sampling.greedy:
            return [DraftTree.chain(tokens_bk[b, : n[b]], DETERMINISTIC, device=self.lm.device) for b in range(B)]
        probs_bkv = torch.stack(probs, 1)  # (B, drafted, V)
        return [DraftTree.chain(tokens_bk[b, : n[b]], IID, probs_bkv[b, : n[b]], device=self.lm.device)
                for b in range(B)]

    def _grow(self, _, tokens, depth, visible):
        logits, _ = grow_level(self.lm, tokens, depth, visible)
        return None, logits[..., : self.vocab_size]

    def observe(self, feedback):
        # Keep the drafts that were accepted (those the draft model was fed); forget the rest.
        if self.round_start is None:
            return
        accepted = torch.tensor([len(p) for p in feedback.accepted_nodes])
        keep = self.round_start + torch.clamp(accepted, max=self.round_k - 1)
        self.lm.rollback(keep)
        self.round_start = None  # a round in which propose() is skipped must not roll back again
