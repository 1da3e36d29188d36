"""What the feature-level drafters (`eagle`, `mtp`) share: a trained head (heads/feature_head.py)
with its own KV cache, fed the target's hidden states of the accepted tokens after every round.

The head's entry at text position i is (f_i, t_{i+1}): the target's feature at i and the token
after it. Its output predicts the token after t_{i+1}. Per row the drafter keeps the entries the
head has not seen yet ("pending"): after the prefill, the prompt's; after a round, one per
emitted token, paired with the features of the root and the accepted nodes. A round:

  1. catch up   feed the pending entries as a chain and commit them to the head's cache; the
                last one (its token is the root) gives the depth-1 distribution;
  2. grow       feed chosen nodes one depth per call, each paired with its parent's predicted
                feature, without committing (`also_visible` lets a node see its ancestors);
  3. forget     drop the grown slots: the next round feeds the target's true features instead.
"""
from __future__ import annotations

import torch

from ..heads.feature_head import FeatureHead
from ..models import resolve_dtype
from ..verifier.cached_model import CachedLM
from ..verifier.tree import TreeBlock
from .base import Drafter, DraftTree, TargetNeeds
from .chain_draws import ChainRules, chain_trees
from .draft_vocab import ShrunkHeadIds, frequent_tokens, full_vocab, shrunk_linear
from .first_feed import distinct_rows
from .dynamic_tree import dynamic_tree, grow_level
from .eos_ban import EosBan
from .int8_linear import Int8Linear, quantize_linears, quantize_output_layers, resolve_quantize
from .path_bans import PathBanRound
from .repeats import DraftContext, DraftRepeats


class FeatureHeadDrafter(ShrunkHeadIds, Drafter):
    head_kinds: tuple[str, ...] = ()  # the kinds of heads folder this drafter loads

    def __init__(self, options, target):
        """options: the subclass's Options (path, depth, draft_vocab, draft_vocab_sampling, dtype,
        quantize at least)."""
        self.options = options
        path, draft_vocab = getattr(options, "path", None) or target.path, options.draft_vocab
        quantize = resolve_quantize(self.name, options.quantize, target.device)
        self.head, self.head_config = self.load_head(options, target)
        # The head may compute in another dtype than the target (bfloat16 reads half the bytes of
        # float32: a CPU head call ran ~3x faster), or around int8 products in float32 (faster
        # still on CPU: drafters/int8_linear.py). Drafts only: the verifier keeps output exact.
        if quantize:
            dtype = torch.float32
        else:
            dtype = resolve_dtype(options.dtype, target.device) if options.dtype else target.dtype
        self.compute_dtype = dtype
        if self.head.fuse.weight.dtype != dtype:  # trained heads load in float32, native ones in the target's
            self.head.cast_parameters(dtype)
        self.device = target.device
        self.vocab_size = target.vocab_size
        layers = self.head.config.feature_layers
        self.needs = TargetNeeds(hidden_state_layers=layers)
        self.feature_width = self.head.config.hidden_size * len(layers)
        if self.head.config.kind == "eagle3":  # trained on its own draft vocabulary
            if draft_vocab is not None:
                raise ValueError(f"{self.name}: the EAGLE-3 head in '{path}' has its own draft vocabulary "
                                 f"({self.head.config.draft_vocab_size} tokens); leave draft_vocab unset")
            ids = self.head.draft_token_ids
            self.vocab_map = None if len(ids) == self.vocab_size else ids
            self.output_layers = None
        else:
            self.output_layers = self._lm_heads(path, draft_vocab, options.draft_vocab_sampling, dtype, target.dtype,
                                                copy=bool(quantize))
        self.lm = CachedLM(self.head.body, dtype, direct=True)
        self.context = self.head.body.config.max_position_embeddings if hasattr(
            self.head.body.config, "max_position_embeddings") else getattr(self.head.body.config, "n_positions")
        self._parameters = sum(p.numel() for p in self.head.parameters())
        if self.output_layers is not None:  # LM-head copies (a draft vocabulary's rows, another dtype)
            copies = {layer for layer, _ in self.output_layers.values()} - {target.model.get_output_embeddings()}
            self._parameters += sum(layer.weight.numel() for layer in copies)
        if quantize:  # after counting: int8 layers hold no Parameters to count
            self._quantize()
        if self.output_layers is not None:
            self._use_head(greedy=True)

    def load_head(self, options, target) -> tuple[FeatureHead, dict]:
        """The head and its saved config: a trained heads folder at options.path."""
        return FeatureHead.load(options.path, target.model, kind=self.head_kinds)

    def _lm_heads(self, path: str, draft_vocab: int | None, draft_vocab_sampling: bool, dtype: torch.dtype,
                  target_dtype: torch.dtype, copy: bool = False) -> dict:
        """The LM heads an EAGLE-1/2 or MTP head reads out through, by round kind (greedy: True), as
        (output layer, row -> token id or None), as draft_model keeps them. The target's own LM head
        (a copy when the head computes in another dtype); under draft_vocab, greedy rounds read only
        the rows of the N tokens the target picks most (drafters/draft_vocab.py), and sampled rounds
        too with draft_vocab_sampling. Sampled tokens spread beyond the greedy picks: at T=1 the
        bundled EAGLE-1 head drew a chain with tau 1.90-2.02 among 1024 tokens, 2.24-2.64 among all.
        copy: never the target's own module (it is about to be quantized)."""
        target_head = self.head.body.get_output_embeddings()

        def whole():
            shared = dtype == target_dtype and not copy
            return target_head if shared else shrunk_linear(target_head, None, dtype), None

        if draft_vocab is None:
            greedy = whole()
            return {True: greedy, False: greedy}
        keep = frequent_tokens(self.head_config, path, draft_vocab, self.vocab_size, self.name,
                               self.head.config.kind, self.device)
        greedy = (shrunk_linear(target_head, keep, dtype), keep)
        return {True: greedy, False: greedy if draft_vocab_sampling else whole()}

    def _quantize(self) -> None:
        """int8 weights for every product the head computes: its decoder layer(s), the fusion, the
        LM head it reads out through (EAGLE-3's own; the copies made for the others)."""
        quantize_linears(self.head.parts)
        self.head.fuse = Int8Linear.of(self.head.fuse)
        if self.output_layers is None:
            self.head.readout.lm_head = Int8Linear.of(self.head.readout.lm_head)
        else:
            self.output_layers = quantize_output_layers(self.output_layers)

    def _use_head(self, greedy: bool) -> None:
        layer, self.vocab_map = self.output_layers[greedy]
        self.head.body.set_output_embeddings(layer)

    def full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """(..., n) probabilities over the head's logits -> (..., V) over the target's vocabulary."""
        return full_vocab(probs, self.vocab_map, self.vocab_size)

    def max_depth(self) -> int:
        return self.options.depth

    @torch.no_grad()
    def propose(self, contexts):
        depth = self.depth_budget(contexts, self.max_depth())
        if depth == 0 or not any(self.pending_tokens) and self.lm.num_slots == 0:
            return [DraftTree.empty(self.device) for _ in contexts]
        feature, logits, ready = self.catch_up()
        logits = self.draft_context.biased(self.draft_sampling(), logits, self.vocab_map)  # grow() biases the rest
        self.repeats = self.draft_context.round(self.draft_sampling(), contexts, logits.shape[-1], self.vocab_map)
        self.eos_ban = self.draft_context.eos_ban(self, contexts, logits.shape[-1], self.vocab_map)
        self.path_bans = self.draft_context.path_bans(self.draft_sampling(), contexts, self.vocab_map, self.grammar)
        trees = self.draft(feature, logits, depth, ready)
        self.forget_grown()
        return trees

    def draft(self, feature: torch.Tensor, logits: torch.Tensor, depth: int, ready: torch.Tensor) -> list[DraftTree]:
        """Steps 2 and 3's drafting: from the root's predicted feature (B, d) and logits (B, n),
        grow up to `depth` levels; rows with ready[b] False get an empty tree."""
        raise NotImplementedError

    def draft_chain_or_tree(self, feature: torch.Tensor, logits: torch.Tensor, depth: int, ready: torch.Tensor,
                            top_k: int, total_tokens: int, min_confidence: float) -> list[DraftTree]:
        """An MTP module's drafts: a chain (top_k 1, and every sampled round: q known), or at T=0
        with top_k > 1 the EAGLE-2 dynamic tree of its top-k guesses (drafters/dynamic_tree.py),
        which costs the same `depth` head calls over wider levels."""
        if top_k == 1 or not self.shape_sampling().greedy:
            return self.draft_chain(feature, logits, depth, ready)
        return dynamic_tree(self.lm, self.grow, logits, feature, depth, top_k, total_tokens, ready.tolist(),
                            self.token_ids, 1.0, self.repeats, min_confidence, self.eos_ban, self.path_bans)

    def draft_chain(self, feature: torch.Tensor, logits: torch.Tensor, depth: int, ready: torch.Tensor) -> list[DraftTree]:
        """A chain of `depth` tokens, the head fed its own output features beyond depth 1. Greedy:
        each token is the head's argmax (deterministic). Sampling: each is drawn from the head's
        distribution after its row's processing (temperature, top-k, top-p: draft_sampling()), and
        that distribution, placed in the full vocabulary, is the node's q: the verifier's rejection
        sampling stays exact. A batch may hold both kinds of row (drafters/chain_draws.py)."""
        B = feature.shape[0]
        sampling = self.draft_sampling()  # each row's own, when rows differ
        visible = None

        def grow(token, d):  # the head on its own output feature and the token just drafted
            nonlocal feature, visible
            slots_before = self.lm.num_slots
            feature, logits = self.grow(feature[:, None], token[:, None], d, visible)
            feature = feature[:, 0]
            seen = torch.zeros(B, 1, self.lm.num_slots, dtype=torch.bool, device=self.device)
            if visible is not None:
                seen[..., : visible.shape[-1]] = visible
            seen[:, 0, slots_before] = True  # the next token sees this one (and its ancestors)
            visible = seen
            return logits[:, 0]

        # Over the head's logits (all, or a draft vocabulary).
        rules = ChainRules(self.repeats, self.eos_ban, self.path_bans, B)
        chain, probs = rules.draw_chain(logits, depth, grow, sampling, self.generator, self.token_ids)
        # q (B, depth, V): what each token was drawn from
        return chain_trees(chain, [depth] * B, sampling, lambda: self.full_vocab(torch.stack(probs, 1)),
                           ready.tolist())

    def extra_parameters(self) -> int:
        return self._parameters

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        if self.output_layers is not None:
            self._use_head(sampling.greedy)
        self.lm.reset(len(prompts))
        self.draft_context = DraftContext(prompts, self.vocab_size, self.device)  # under penalties
        self.repeats: DraftRepeats | None = None  # set each round by propose()
        self.eos_ban: EosBan | None = None  # set each round by propose()
        self.path_bans: PathBanRound | None = None  # set each round by propose()
        self.prompts = prompts
        # Per row, the target's features not yet fed to the head, as the chunks they came in:
        # joined once, when the head catches up (joining every round copied a whole plain stretch
        # again and again, 5% of a batch-16 request that never drafted).
        self.pending_features: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.pending_tokens: list[list[int]] = [[] for _ in prompts]

    def observe_prefill(self, target_hidden, first_row: int = 0):
        for b, hidden in enumerate(target_hidden, start=first_row):
            if hidden:
                self._add_entries(b, self._features(hidden), self.prompts[b][1:])

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        first = len(self.prompts)
        self.lm.add_rows(len(prompts))  # empty: the next catch_up() feeds each prompt's features
        self.draft_context.add_rows(prompts)
        self.pending_features += [[] for _ in prompts]
        self.pending_tokens += [[] for _ in prompts]
        self.prompts = self.prompts + [list(p) for p in prompts]
        self.observe_prefill(target_hidden, first)

    def observe(self, feedback):
        for b, (hidden, emitted) in enumerate(zip(feedback.target_hidden, feedback.emitted)):
            self._add_entries(b, self._features(hidden), emitted)

    def _features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's states the head reads, (n, feature_width): its top feature, or EAGLE-3's
        low / mid / high layers side by side."""
        layers = self.needs.hidden_state_layers
        return hidden[layers[0]] if len(layers) == 1 else torch.cat([hidden[k] for k in layers], dim=-1)

    def _add_entries(self, b: int, features: torch.Tensor, tokens: list[int]) -> None:
        n = min(len(features), len(tokens))  # fewer tokens when EOS / length cut the round short
        self.pending_features[b].append(features[:n])
        self.pending_tokens[b] += tokens[:n]

    def keep_rows(self, indices):
        self.lm.select_rows(indices)
        self.draft_context.select_rows(indices)
        self.pending_features = [self.pending_features[i] for i in indices]
        self.pending_tokens = [self.pending_tokens[i] for i in indices]
        self.prompts = [self.prompts[i] for i in indices]

    def depth_budget(self, contexts, depth: int) -> int:
        """Depth this round: the configured one, adaptive speculation's limit, the head's context."""
        if self.depth_limit is not None:
            depth = min(depth, self.depth_limit)
        return max(0, min(depth, self.context - max(len(c) for c in contexts) - 1))

    def catch_up(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 1. Returns, per row, the newest entry's predicted feature (B, d), its logits (B, V)
        and whether the row has any entry at all (B,) (a one-token prompt has none in round 1)."""
        B = len(self.pending_tokens)
        tokens = self.pending_tokens
        T = max(len(t) for t in tokens)
        d = self.head.config.hidden_size
        ready = torch.tensor([len(t) > 0 for t in tokens], device=self.device)
        if T == 0:
            width = self.vocab_size if self.vocab_map is None else len(self.vocab_map)  # the head's logits
            return torch.zeros(B, d, device=self.device), torch.zeros(B, width, device=self.device), ready
        # An empty cache fed rows of one prompt (n samples of it): the same features and tokens, so
        # feed them once. (A row's tokens start at its prompt's second: the key holds the prompt.)
        repeated = (distinct_rows([(tuple(p), tuple(t)) for p, t in zip(self.prompts, tokens)])
                    if self.lm.num_slots == 0 else None)
        if repeated is not None:
            self.lm.select_rows(repeated[0])
            tokens = [tokens[row] for row in repeated[0]]
        pending = self.pending_features if repeated is None else [self.pending_features[r] for r in repeated[0]]
        dtype = next(chunk for row in pending for chunk in row).dtype
        features = torch.zeros(len(tokens), T, self.feature_width, device=self.device, dtype=dtype)
        for b, row in enumerate(pending):
            if row:
                features[b, : len(tokens[b])] = torch.cat(row)
        block = TreeBlock.chains(tokens, self.device)
        last = torch.tensor([max(len(t) - 1, 0) for t in tokens], device=self.device)
        logits, hidden = self.lm.forward(block, (-1,), inputs_embeds=self._embeds(features, block.tokens),
                                         logits_at=last)
        self.lm.accept([list(range(len(t))) for t in tokens])
        rows = torch.arange(len(tokens), device=self.device)
        feature, logits = hidden[-1][rows, last], logits[:, : self.vocab_size]
        if repeated is not None:
            self.lm.select_rows(repeated[1])
            copies = torch.tensor(repeated[1], device=self.device)
            feature, logits = feature[copies], logits[copies]
        self.pending_features = [[] for _ in range(B)]
        self.pending_tokens = [[] for _ in range(B)]
        return feature, _scores_dtype(logits), ready

    def grow(self, features: torch.Tensor, tokens: torch.Tensor, depth: int,
             visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2, one depth: (B, K, d) parent features and (B, K) tokens of nodes at `depth`
        (1 = children of the root); visible (B, K, S) = slots of each node's ancestors from earlier
        grow calls (None at depth 1). Returns the nodes' predicted features and logits."""
        logits, hidden = grow_level(self.lm, tokens, depth, visible, (-1,), self._embeds(features, tokens))
        logits = self.draft_context.biased(self.draft_sampling(), _scores_dtype(logits[..., : self.vocab_size]),
                                           self.vocab_map)
        return hidden[-1], logits

    def forget_grown(self) -> None:
        """Step 3: drop every uncommitted slot."""
        self.lm.rollback(self.lm.lengths.clone())

    def _embeds(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.fused_inputs(features.to(self.compute_dtype), tokens)


def _scores_dtype(logits: torch.Tensor) -> torch.Tensor:
    """A bfloat16 head's logits in float32 before any ranking or softmax (float64 stays float64)."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
