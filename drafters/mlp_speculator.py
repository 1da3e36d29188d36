"""`mlp_speculator`: drafts from an MLP speculator (heads/mlp_speculator.py), IBM's released
`*-accelerator` checkpoints (Llama 3, Llama 2, Granite, CodeLlama, ...) or one saved by fms-extras.

Like `medusa` it reads the target's last hidden state at the newest accepted position, handed
back by the verifier after each round (no extra target pass), and keeps no cache of its own; unlike
Medusa's heads each stage also reads the token drafted before it, through a running state. Stage i
drafts depth i + 1, so a round drafts at most `n_predict` tokens, or any number when the
speculator's stages share their weights (tie_weights: the stages past its last repeat stage 1).

Greedy: a chain of its argmax tokens, or with `top_k` > 1 an EAGLE-2 dynamic tree of its top-k
guesses (drafters/dynamic_tree.py; every node carries its own state), deterministic either way.
Sampling: a chain, each token drawn from its stage's distribution after the row's processing and
returned as q. The verifier keeps output exact either way. Drafts follow the request's rules as
the other model drafters' do (drafters/repeats.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..heads.mlp_speculator import load_mlp_speculator
from .base import Drafter, DraftTree, TargetNeeds
from .chain_draws import ChainRules, chain_trees, draw_step
from .dynamic_tree import check_min_confidence, dynamic_tree
from .last_hidden import LastHiddenRows
from .registry import register


@register
class MLPSpeculatorDrafter(LastHiddenRows, Drafter):
    name = "mlp_speculator"
    needs = TargetNeeds(hidden_state_layers=(-1,))

    @dataclass
    class Options:
        path: str | None = None  # folder of the speculator (config.json with model_type mlp_speculator + weights)
        depth: int | None = None  # tokens per round (None: its n_predict); more only with tie_weights
        top_k: int = 1  # > 1: at T=0 an EAGLE-2 dynamic tree, top_k children per expanded node (1: a chain)
        total_tokens: int = 10  # top_k > 1: nodes kept in the verified tree
        min_confidence: float = 0.0  # top_k > 1: keep only nodes whose path confidence reaches it

        def __post_init__(self):
            if not self.path:
                raise ValueError("mlp_speculator: set drafter.path to the speculator's folder (e.g. a released "
                                 "*-accelerator checkpoint made for the target)")
            for key in ("depth", "top_k", "total_tokens"):
                if getattr(self, key) is not None and getattr(self, key) < 1:
                    raise ValueError(f"mlp_speculator: {key} must be >= 1, got {getattr(self, key)}")
            check_min_confidence("mlp_speculator", self.min_confidence)

    def __init__(self, options, target):
        self.options = options
        self.speculator = load_mlp_speculator(options.path, target.model, self.name)
        stages = self.speculator.n_predict
        if options.depth is not None and options.depth > stages and not self.speculator.tied:
            raise ValueError(f"mlp_speculator: depth {options.depth} is more than the speculator's {stages} stages "
                             f"(n_predict in its config.json), and they do not share weights (tie_weights) to run "
                             f"again: each stage drafts one depth; set depth <= {stages}")
        self.depth = options.depth or stages
        self.vocab_size = target.vocab_size
        self.device = target.device

    def max_depth(self) -> int:
        return self.depth

    def extra_parameters(self) -> int:
        return sum(p.numel() for p in self.speculator.parameters())

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.begin_rows(prompts, self.vocab_size)

    @torch.no_grad()
    def propose(self, contexts):
        depth = self.depth if self.depth_limit is None else min(self.depth, self.depth_limit)
        ready = [h is not None for h in self.last_hidden]  # a one-token prompt's row has none in round 1
        if depth == 0 or not any(ready):
            return [DraftTree.empty(self.device) for _ in contexts]
        weight = self.speculator.proj[0].weight
        hidden = torch.stack([h if h is not None else weight.new_zeros(weight.shape[1]) for h in self.last_hidden])
        root = torch.tensor([c[-1] for c in contexts], device=self.device)
        state, logits = self.speculator.step(0, self.speculator.first_state(hidden.to(weight.dtype)), root)
        sampling, context = self.draft_sampling(), self.draft_context
        logits = context.biased(sampling, logits.float(), None)
        width = logits.shape[-1]
        repeats = context.round(sampling, contexts, width, None)
        eos_ban = context.eos_ban(self, contexts, width, None)
        bans = context.path_bans(sampling, contexts, None, self.grammar)
        o = self.options
        if o.top_k > 1 and self.shape_sampling().greedy:
            return dynamic_tree(None, self._grow, logits, state, depth, o.top_k, o.total_tokens, ready,
                                repeats=repeats, min_confidence=o.min_confidence, eos_ban=eos_ban, bans=bans)
        rules = ChainRules(repeats, eos_ban, bans, len(contexts))
        tokens, probs = [], []
        for d in range(1, depth + 1):
            p, index = draw_step(rules.apply(logits, d), sampling, self.generator)
            rules.drafted(index, index)
            tokens.append(index)
            probs.append(p)
            if d < depth:
                state, logits = self._grow(state, index, d, None)
        chain = torch.stack(tokens, 1)
        # q (B, depth, V): what each token was drawn from, zero past the speculator's vocabulary
        return chain_trees(chain, [depth] * len(contexts), sampling,
                           lambda: F.pad(torch.stack(probs, 1), (0, self.vocab_size - width)), ready)

    def _grow(self, states, tokens, depth, _visible):
        """Stage `depth` on the nodes at that depth: their parents' states and their own tokens ->
        their states and their children's logits (dynamic_tree's grow; the chain's next step)."""
        state, logits = self.speculator.step(depth, states, tokens)
        return state, self.draft_context.biased(self.draft_sampling(), logits.float(), None)
