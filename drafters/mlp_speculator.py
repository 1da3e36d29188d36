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
the other model drafters' do (drafters/repeats.py). `draft_vocab` shrinks its LM heads to the
tokens the target picks most, as for the other heads (drafters/draft_vocab.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..heads.mlp_speculator import load_mlp_speculator
from .base import Drafter, DraftTree, TargetNeeds
from .chain_draws import ChainRules, chain_trees
from .draft_vocab import (ShrunkHeadIds, check_needs_draft_vocab, full_vocab, read_token_order, shrunk_linear,
                          top_tokens)
from .dynamic_tree import check_min_confidence, dynamic_tree
from .int8_linear import Int8Linear, check_quantize, resolve_quantize
from .last_hidden import LastHiddenRows
from .registry import register


@register
class MLPSpeculatorDrafter(LastHiddenRows, ShrunkHeadIds, Drafter):
    name = "mlp_speculator"
    needs = TargetNeeds(hidden_state_layers=(-1,))

    @dataclass
    class Options:
        path: str | None = None  # folder of the speculator (config.json with model_type mlp_speculator + weights)
        depth: int | None = None  # tokens per round (None: its n_predict); more only with tie_weights
        top_k: int = 1  # > 1: at T=0 an EAGLE-2 dynamic tree, top_k children per expanded node (1: a chain)
        total_tokens: int = 10  # top_k > 1: nodes kept in the verified tree
        min_confidence: float = 0.0  # top_k > 1: keep only nodes whose path confidence reaches it
        draft_vocab: int | None = None  # its LM heads keep the N tokens the target picks most (None = all)
        vocab_order: str | None = None  # draft_vocab's order when its config.json has none (`draftsman vocab`)
        draft_vocab_sampling: bool = False  # sampled rounds draft among those N tokens too (costs acceptance)
        quantize: str | None = None  # "int8": int8 projections and LM heads, float32 around them (CPU); "auto"

        def __post_init__(self):
            if not self.path:
                raise ValueError("mlp_speculator: set drafter.path to the speculator's folder (e.g. a released "
                                 "*-accelerator checkpoint made for the target)")
            check_needs_draft_vocab("mlp_speculator", self.draft_vocab, vocab_order=self.vocab_order,
                                    draft_vocab_sampling=self.draft_vocab_sampling)
            for key in ("depth", "top_k", "total_tokens"):
                if getattr(self, key) is not None and getattr(self, key) < 1:
                    raise ValueError(f"mlp_speculator: {key} must be >= 1, got {getattr(self, key)}")
            check_min_confidence("mlp_speculator", self.min_confidence)
            check_quantize("mlp_speculator", self.quantize, None)

    def __init__(self, options, target):
        self.options = options
        self.speculator, config = load_mlp_speculator(options.path, target.model, self.name)
        stages = self.speculator.n_predict
        if options.depth is not None and options.depth > stages and not self.speculator.tied:
            raise ValueError(f"mlp_speculator: depth {options.depth} is more than the speculator's {stages} stages "
                             f"(n_predict in its config.json), and they do not share weights (tie_weights) to run "
                             f"again: each stage drafts one depth; set depth <= {stages}")
        self.depth = options.depth or stages
        self.vocab_size = target.vocab_size
        self.device = target.device
        quantize = resolve_quantize(self.name, options.quantize, target.device)
        if quantize:
            self.speculator.float()  # around its int8 products
        self.readouts = self._readouts(options, config.get("tokens_by_frequency"), target.model)
        self._parameters = sum(p.numel() for p in self.speculator.parameters())  # (int8 layers hold none)
        if quantize:
            self._quantize()

    def _readouts(self, options, saved_order: list[int] | None, target_model
                  ) -> dict[bool, tuple[list, torch.Tensor | None]]:
        """By round kind (greedy: True): each stage's LM head and its row -> token id map (None:
        every token). Under draft_vocab a greedy round's heads keep only the rows of the N tokens
        the target picks most (its 8192-row heads were most of a CPU drafting step, as the other
        heads' were: docs/training-heads.md), sampled rounds' too with draft_vocab_sampling."""
        stages = range(self.depth)
        whole = ([self.speculator.readout(i) for i in stages], None)
        if options.draft_vocab is None:
            return {True: whole, False: whole}
        if options.vocab_order:
            order = read_token_order(options.vocab_order, self.vocab_size, self.name, target_model=target_model)
        else:
            order = saved_order  # the target's order, recorded when draftsman trained it
            if order is None:
                raise ValueError(f"mlp_speculator: draft_vocab needs the target's token order, and the config.json "
                                 f"in '{options.path}' has none (a released speculator's has not): set vocab_order "
                                 "(write one with `draftsman vocab --target TARGET_FOLDER --out FILE`)")
        keep = top_tokens(order, options.draft_vocab, self.vocab_size, self.name, self.device)
        shrunk = {}  # a tied speculator's stages share one head's weight: shrink it once
        for i in stages:
            head = self.speculator.readout(i)
            shrunk.setdefault(id(head.weight), shrunk_linear(head, keep))
        few = ([shrunk[id(self.speculator.readout(i).weight)] for i in stages], keep)
        return {True: few, False: few if options.draft_vocab_sampling else whole}

    def _quantize(self) -> None:
        """int8 weights for every product a stage computes: its projection and the LM heads it
        reads out through, each weight converted once (a tied speculator's stages share theirs)."""
        converted: dict[int, Int8Linear] = {}

        def int8(layer):
            return converted.setdefault(id(layer.weight), Int8Linear.of(layer))

        self.speculator.proj = nn.ModuleList(int8(layer) for layer in self.speculator.proj)
        self.readouts = {kind: ([int8(head) for head in heads], ids) for kind, (heads, ids) in self.readouts.items()}

    def max_depth(self) -> int:
        return self.depth

    def extra_parameters(self) -> int:
        return self._parameters

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.begin_rows(prompts, self.vocab_size)
        self.heads, self.vocab_map = self.readouts[sampling.greedy]

    @torch.no_grad()
    def propose(self, contexts):
        depth = self.depth if self.depth_limit is None else min(self.depth, self.depth_limit)
        ready = [h is not None for h in self.last_hidden]  # a one-token prompt's row has none in round 1
        if depth == 0 or not any(ready):
            return [DraftTree.empty(self.device) for _ in contexts]
        dtype = self.speculator.emb[0].weight.dtype
        none = torch.zeros(self.speculator.config["emb_dim"], dtype=dtype, device=self.device)  # (drafts nothing)
        hidden = torch.stack([h if h is not None else none for h in self.last_hidden]).to(dtype)
        root = torch.tensor([c[-1] for c in contexts], device=self.device)
        state, logits = self._grow(self.speculator.first_state(hidden), root, 0, None)
        sampling, context, vocab_map = self.draft_sampling(), self.draft_context, self.vocab_map
        width = logits.shape[-1]
        repeats = context.round(sampling, contexts, width, vocab_map)
        eos_ban = context.eos_ban(self, contexts, width, vocab_map)
        bans = context.path_bans(sampling, contexts, vocab_map, self.grammar)
        o = self.options
        if o.top_k > 1 and self.shape_sampling().greedy:
            return dynamic_tree(None, self._grow, logits, state, depth, o.top_k, o.total_tokens, ready,
                                self.token_ids, repeats=repeats, min_confidence=o.min_confidence, eos_ban=eos_ban,
                                bans=bans)

        def grow(token, d):
            nonlocal state
            state, logits = self._grow(state, token, d, None)
            return logits

        rules = ChainRules(repeats, eos_ban, bans, len(contexts))
        chain, probs = rules.draw_chain(logits, depth, grow, sampling, self.generator, self.token_ids)
        return chain_trees(chain, [depth] * len(contexts), sampling, lambda: self._full_q(torch.stack(probs, 1)),
                           ready)

    def _grow(self, states, tokens, depth, _visible):
        """Stage `depth` on the nodes at that depth (0: the roots): their parents' states and their
        own tokens -> their states and their children's logits, biased (dynamic_tree's grow; the
        chain's next step)."""
        state = self.speculator.advance(depth, states, tokens)
        logits = self.heads[depth](state).float()
        return state, self.draft_context.biased(self.draft_sampling(), logits, self.vocab_map)

    def _full_q(self, probs: torch.Tensor) -> torch.Tensor:
        """(B, depth, width) distributions over this round's logits -> (B, depth, V): what each
        token was drawn from, zero outside the draft vocabulary or past the speculator's."""
        if self.vocab_map is not None:
            return full_vocab(probs, self.vocab_map, self.vocab_size)
        return F.pad(probs, (0, self.vocab_size - probs.shape[-1]))
