"""`draft_model`: a separate small causal LM that shares the target's tokenizer. It drafts a chain
of k tokens autoregressively with the same sampling processing as the target, so each token's
distribution q is known exactly (greedy drafts are deterministic), and keeps its own KV cache,
rolled back to the accepted tokens after each round. A row that outgrows the draft model's context
is drafted for from a window of its latest tokens (drafters/context_window.py).

With `top_k > 1`, greedy rounds draft an EAGLE-2 dynamic tree instead (drafters/dynamic_tree.py:
depth k, the top_k most confident nodes expanded per depth, the best `total_tokens` kept, and with
`min_confidence` only those whose path confidence reaches it): one
draft-model call per depth, as for the chain, and at batch 1 a target pass over a dozen tokens
costs about what a pass over five does. Sampled rounds keep the chain drawn from q.

With `draft_vocab: N`, greedy rounds read the draft model's logits from only the rows of the N
tokens the target picks most (drafters/draft_vocab.py): for the bundled 2-layer draft model the
8192-row LM head is most of a step (2.9 ms -> 1.0 ms per step at N = 1024, CPU). Tokens outside
those N are never drafted; the target still emits them. Sampled rounds keep the whole head unless
`draft_vocab_sampling` is set: the order counts greedy picks, and sampled tokens spread beyond
them (T=1 on the bundled pair: first-draft acceptance 0.59 -> 0.48, speedup 0.92x -> 0.85x).

With `parallel_drafting: true`, a parallel draft model (PARD: AMD's checkpoints, or one adapted
with `draftsman train pard`) drafts the chain in one pass over the context and k - 1 mask tokens
instead of k passes (drafters/parallel_draft.py); its masks' keys are forgotten at once, so no
rollback follows the round.

With `quantize: int8` (or `auto`: int8 on a CPU), every linear layer of the draft model and its LM
head run with int8 weights (drafters/int8_linear.py), float32 around them; sampled rounds draw from
what the int8 model computes, so q is still known exactly. It pays most in sampled rounds, which
read the whole LM head: on the bundled pair at T=1, 0.83x / 0.89x / 0.95x plain decoding became
1.03x / 0.97x / 1.15x (continuation / copy / docstring), at T=0 1.23x / 1.12x / 0.89x became
1.35x / 1.13x / 0.96x (docs/benchmarks.md, session 17)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import context_length, load_causal_lm, load_tokenizer, vocab_mismatch
from ..verifier.cached_model import CachedLM
from .first_feed import distinct_rows
from ..verifier.tree import TreeBlock
from .base import Drafter, DraftTree
from .context_window import window_start
from .chain_draws import ChainRules, chain_trees, draw_step
from .draft_vocab import (ShrunkHeadIds, check_fits_vocabulary, check_needs_draft_vocab, full_vocab,
                          read_token_order, shrunk_linear, top_tokens)
from .dynamic_tree import dynamic_tree, grow_level
from .int8_linear import check_quantize, quantize_linears, quantize_output_layers, resolve_quantize
from .parallel_draft import check_parallel_options, feed_with_masks, mask_token, warn_if_deeper_than_trained
from .registry import register
from .repeats import DraftContext


def check_chain_options(drafter: str, options) -> None:
    """The options of a chain or tree drafted a token per pass (draft_model, layer_skip)."""
    for key in ("k", "top_k", "total_tokens"):
        if getattr(options, key) < 1:
            raise ValueError(f"{drafter}: {key} must be >= 1, got {getattr(options, key)}")
    if options.min_confidence is not None and not 0 <= options.min_confidence <= 1:
        raise ValueError(f"{drafter}: min_confidence must be in [0, 1], got {options.min_confidence}")
    check_needs_draft_vocab(drafter, options.draft_vocab, vocab_order=options.vocab_order,
                            draft_vocab_sampling=options.draft_vocab_sampling)


@register
class DraftModelDrafter(ShrunkHeadIds, Drafter):
    name = "draft_model"
    runs_part_of_its_layers = False  # a view of some of a model's layers (layer_skip): its cache needs own_masks

    @dataclass
    class Options:
        path: str | None = None  # local Hugging Face folder of the draft model
        k: int = 4  # tokens drafted per round
        dtype: str | None = None  # default: the target's dtype
        min_confidence: float | None = None  # stop a row's chain after a token drawn with prob < this; a tree (top_k > 1) keeps only nodes whose path confidence reaches it
        top_k: int = 1  # greedy rounds: > 1 drafts a dynamic tree of depth k instead of a chain
        total_tokens: int = 10  # nodes kept in that tree
        draft_vocab: int | None = None  # draft among the N tokens the target picks most (None = all)
        vocab_order: str | None = None  # where draft_vocab's order is: a JSON file or folder (None = path)
        draft_vocab_sampling: bool = False  # sampled rounds draft among those N tokens too (costs acceptance)
        quantize: str | None = None  # "int8": int8 weights, float32 around them (CPU only); "auto": int8 on CPU (drafters/int8_linear.py)
        # The penalty depends on raw logit values, so this helps a draft whose logits are on the
        # target's scale (the target itself, a distilled copy); the bundled draft model's tau did not rise.
        penalise_drafts: bool = False  # under penalties, penalise the drafts too (drafters/repeats.py)
        parallel_drafting: bool = False  # PARD: all k drafts from one pass over context + k - 1 masks (vLLM's key)
        mask_token_id: int | None = None  # parallel_drafting's mask (default: config.json's pard_token / ptd_token_id)

        def __post_init__(self):
            if not self.path:
                raise ValueError("draft_model: set drafter.path to the draft model's local folder")
            check_quantize("draft_model", self.quantize, self.dtype)
            check_chain_options("draft_model", self)
            check_parallel_options(self)

    def __init__(self, options: "DraftModelDrafter.Options", target):
        self.options = options
        self.k = options.k
        if options.draft_vocab is not None:  # named before the draft model loads or its order is looked for
            check_fits_vocabulary(options.draft_vocab, target.vocab_size, self.name)
        quantize = resolve_quantize(self.name, options.quantize, target.device)
        model = self._load_model(options, target, quantize)
        self.vocab_size = target.vocab_size
        self._parameters = self._own_parameters(model)
        # LM heads by round kind: (output layer, row -> token id or None). Under draft_vocab the
        # greedy one keeps N rows; the whole head stays for sampled rounds.
        whole = (model.get_output_embeddings(), None)
        self.output_layers = {True: whole, False: whole}
        if options.draft_vocab is not None:
            order = read_token_order(options.vocab_order or options.path, self.vocab_size, self.name,
                                     target_model=target.model)
            keep = top_tokens(order, options.draft_vocab, self.vocab_size, self.name, target.device)
            self.output_layers[True] = (shrunk_linear(model.get_output_embeddings(), keep), keep)
            self._parameters += len(keep) * model.get_output_embeddings().weight.shape[1]  # the rows' own copy
            if options.draft_vocab_sampling:
                self.output_layers[False] = self.output_layers[True]
        if quantize:  # after counting: int8 layers hold no Parameters to count
            self._quantize(model)
        # A hybrid's states return to accepted lengths (snapshots); sliding and chunked layers keep
        # about a window, plus the k positions a round's rollback may go back (trim_margin).
        self.lm = CachedLM(model, direct=True, snapshots=True, trim_windows=True, trim_margin=self.k,
                           own_masks=self.runs_part_of_its_layers)
        if self.lm.recurrent and options.top_k > 1:
            raise ValueError(f"draft_model: top_k={options.top_k} grows a tree a depth at a time without accepting, "
                             f"which the recurrent layers of '{options.path}' cannot: set drafter.top_k to 1 (a chain)")
        if options.parallel_drafting and self.lm.recurrent:
            raise ValueError(f"draft_model: parallel_drafting feeds mask tokens and then forgets them, which the "
                             f"recurrent layers of '{options.path}' cannot: leave parallel_drafting unset")
        self.mask_token = mask_token(options, model) if options.parallel_drafting else None
        self.drafting_cost_grows_with_depth = self.mask_token is None  # one pass drafts every depth
        if options.parallel_drafting:
            warn_if_deeper_than_trained(options, model)
        self._use_head(greedy=True)
        self.context = context_length(model.config)
        if self.k >= self.context:
            drafting = "the target's" if self.runs_part_of_its_layers else "the draft model's"  # layer_skip: its layers
            raise ValueError(f"{self.name}: k={self.k} leaves no room in {drafting} context of "
                             f"{self.context} positions: set drafter.k below it")

    def _load_model(self, options, target, quantize: str | None) -> torch.nn.Module:
        """The draft model from options.path, checked against the target's tokenizer."""
        # int8 products take float32 inputs: the rest of the draft model computes in float32.
        dtype = "float32" if quantize else options.dtype or str(target.dtype).replace("torch.", "")
        model = load_causal_lm(options.path, dtype, target.device, what="drafter.path")
        problem = vocab_mismatch(target.tokenizer, load_tokenizer(options.path), target.vocab_size,
                                 model.get_output_embeddings().weight.shape[0])
        if problem:
            raise ValueError(f"draft model '{options.path}' cannot draft for target '{target.path}': {problem}. "
                             "A draft model must use the target's tokenizer (same vocabulary and special tokens); "
                             "one with a tokenizer of its own drafts through text as drafter `cross_tokenizer`.")
        return model

    def _own_parameters(self, model: torch.nn.Module) -> int:
        """The draft model's parameters as loaded (the whole LM head, tied or not): all its own."""
        return sum(p.numel() for p in model.parameters())

    def _quantize(self, model: torch.nn.Module) -> None:
        """int8 weights for the decoder layers and for each LM head a round may read out through
        (the whole one, draft_vocab's rows). Embeddings stay as loaded: a lookup reads one row."""
        quantize_linears(model.base_model)
        self.output_layers = quantize_output_layers(self.output_layers)

    def _use_head(self, greedy: bool) -> None:
        layer, self.vocab_map = self.output_layers[greedy]
        self.lm.model.set_output_embeddings(layer)

    def max_depth(self) -> int:
        return self.k

    def extra_parameters(self) -> int:
        return self._parameters

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self._use_head(sampling.greedy)
        self.lm.reset(len(prompts))
        self.window_starts = [0] * len(prompts)  # each row's first token in the draft cache
        self.draft_context = DraftContext(prompts, self.vocab_size, self.lm.device)  # under penalise_drafts
        self.round_start = None

    def keep_rows(self, indices):
        self.lm.select_rows(indices)
        self.window_starts = [self.window_starts[i] for i in indices]
        self.draft_context.select_rows(indices)

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        self.lm.add_rows(len(prompts))  # empty: the next propose() feeds each whole prompt
        self.window_starts += [0] * len(prompts)
        self.draft_context.add_rows(prompts)

    def propose(self, contexts):
        B = len(contexts)
        k = self.k if self.depth_limit is None else min(self.k, self.depth_limit)
        self.round_start, self.round_k = None, k
        if k <= 0:
            return [DraftTree.empty(self.lm.device) for _ in contexts]
        # 1. Feed every row's tokens that the draft cache has not seen (the root at least). Past
        # the draft model's context a row's cache holds a window of its latest tokens.
        starts = self._windows(contexts)
        cached = self.lm.lengths.tolist()
        unseen = [ctx[start + n:] for ctx, start, n in zip(contexts, starts, cached)]
        if self.mask_token is not None:  # every draft's logits from this one pass
            parallel = feed_with_masks(self.lm, unseen, self.mask_token, k)  # (B, k, V)
            logits = parallel[:, 0]
        else:
            logits = self._feed(unseen)
        logits = self.draft_context.biased(self.draft_sampling(), logits[..., : self.vocab_size], self.vocab_map)
        repeats = (self.draft_context.round(self.draft_sampling(), contexts, logits.shape[-1], self.vocab_map)
                   if self.options.penalise_drafts else None)
        eos_ban = self.draft_context.eos_ban(self, contexts, logits.shape[-1], self.vocab_map)
        bans = self.draft_context.path_bans(self.draft_sampling(), contexts, self.vocab_map, self.grammar)
        if self.options.top_k > 1 and self.shape_sampling().greedy:
            trees = dynamic_tree(self.lm, self._grow, logits, None, k, self.options.top_k,
                                 self.options.total_tokens, [True] * B, self.token_ids, repeats=repeats,
                                 min_confidence=self.options.min_confidence or 0.0, eos_ban=eos_ban, bans=bans)
            self.lm.rollback(self.lm.lengths.clone())  # drop the grown slots; accepted ones are re-fed next round
            return trees
        if self.mask_token is None:  # the drafts will be fed, and the rejected ones forgotten in observe()
            self.round_start = torch.tensor([len(c) - start for c, start in zip(contexts, starts)])  # cache positions
        sampling = self.draft_sampling()  # each row's own, when rows differ
        # 2. Draft k tokens one at a time; with min_confidence, a row stops after a token the draft
        # model itself gave less than that probability (its next guesses are rarely accepted), and
        # drafting ends when every row has stopped (as transformers' assisted generation does).
        tokens, probs = [], []
        length = torch.full((B,), k, dtype=torch.long, device=self.lm.device)
        rules = ChainRules(repeats, eos_ban, bans, B)
        for step in range(k):
            logits = rules.apply(logits[..., : self.vocab_size], step + 1)
            # Over the draft model's logits (all tokens, or draft_vocab's); index into them.
            p, index = draw_step(logits, sampling, self.generator)
            tok = self.token_ids(index)
            rules.drafted(index, tok)
            tokens.append(tok)
            probs.append(p)
            if self.options.min_confidence is not None:
                # The draft model's own probability of its token (greedy processing gives one-hot p).
                confidence = logits[..., : self.vocab_size].float().softmax(-1).gather(1, index[:, None])[:, 0]
                unsure = (confidence < self.options.min_confidence) & (length == k)
                length = torch.where(unsure, step + 1, length)
                if bool((length < k).all()):
                    break
            if step < k - 1 and self.mask_token is not None:
                logits = self.draft_context.biased(self.draft_sampling(), parallel[:, step + 1, : self.vocab_size],
                                                   self.vocab_map)
            elif step < k - 1:
                logits, _ = self.lm.forward(TreeBlock.column(tok))
                self.lm.accept([[0]] * B)
                logits = self.draft_context.biased(self.draft_sampling(), logits[:, 0], self.vocab_map)
        tokens_bk = torch.stack(tokens, 1)  # (B, drafted)
        n = length.clamp(max=tokens_bk.shape[1]).tolist()
        # q (B, drafted, V): what each token was drawn from
        return chain_trees(tokens_bk, n, sampling, lambda: full_vocab(torch.stack(probs, 1), self.vocab_map,
                                                                      self.vocab_size))

    def _feed(self, unseen: list[list[int]]) -> torch.Tensor:
        """Commit each row's unseen tokens; the logits after its last one (B, V). An empty cache (the
        first round) fed the same prompt in several rows feeds it once."""
        repeated = distinct_rows([tuple(u) for u in unseen]) if self.lm.num_slots == 0 else None
        if repeated is None:
            return self.lm.feed(unseen)
        self.lm.select_rows(repeated[0])
        logits = self.lm.feed([unseen[row] for row in repeated[0]])
        self.lm.select_rows(repeated[1])
        return logits[torch.tensor(repeated[1], device=logits.device)]

    def _windows(self, contexts: list[list[int]]) -> list[int]:
        """Each row's first token in the draft cache (drafters/context_window.py): 0 while the row
        and a round's drafts fit in the draft model's context. A row whose window moved is fed
        from empty."""
        starts = [window_start(len(c), self.context - self.k) for c in contexts]
        moved = [new != old for new, old in zip(starts, self.window_starts)]
        if any(moved):  # (decided in Python: most rounds no window moves, and need no tensor or device sync)
            self.lm.rollback(torch.where(torch.tensor(moved, device=self.lm.device), 0, self.lm.lengths))
        self.window_starts = starts
        return starts

    def _grow(self, _, tokens, depth, visible):
        logits, _ = grow_level(self.lm, tokens, depth, visible)
        return None, self.draft_context.biased(self.draft_sampling(), logits[..., : self.vocab_size], self.vocab_map)

    def observe(self, feedback):
        # Keep the drafts that were accepted (those the draft model was fed); forget the rest.
        if self.round_start is None:
            return
        accepted = torch.tensor([len(p) for p in feedback.accepted_nodes])
        keep = self.round_start + torch.clamp(accepted, max=self.round_k - 1)
        self.lm.rollback(keep)
        self.round_start = None  # a round in which propose() is skipped must not roll back again
