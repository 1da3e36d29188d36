"""`recycling`: Token Recycling (Luo et al., 2024, "Turning Trash into Treasure: Accelerating
Inference of Large Language Models with Token Recycling", arXiv 2408.08696). No training, no
second model, no datastore: every target pass already ranks the whole vocabulary after every token
of its block, rejected drafts included, and those candidates are what the next rounds draft from.

A matrix keeps, for each token id, the target's `top_k` most likely next tokens the last time it
verified that token, with their probabilities (the engine hands them back: TargetNeeds.top_tokens;
drafters/recycling_trees.py). Tokens the target has not seen yet have no candidates, so nothing
is drafted below them. The matrix is shared by the rows of a batch and outlives a generate call
(the paper's hot start): what one request taught about a token helps the next.

Greedy rows draft the paper's tree: a fixed template of candidate ranks below the root (path
(0, 1) is the root's best candidate, then that token's second best), from `tree` or from a table
of how often each rank is right at each depth (`rank_accuracy`; the report measures it on your
prompts), reduced to `tree_budget` paths. Not in the paper: a sampled row (T > 0), where a fixed
token is accepted only with the target's probability of it, drafts a chain of `sampled_depth`
tokens drawn from the recorded probabilities and carries the distributions it drew from, so the
verifier accepts each with min(1, p / q) (drafters/recycling_trees.py).
Also not in the paper: a token the target has not ranked yet takes the token that follows it in
the prompt as its one candidate (`seed_from_prompt`), so a cold start drafts from its first round.
Greedy nodes are fixed tokens and sampled ones carry their q, so the shared verifier keeps the
output exact at any temperature.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..heads.common import fingerprint_difference, target_fingerprint
from ..verifier.sampling import RowSampling
from .base import Drafter, TargetNeeds
from .chain_draws import greedy_rows
from .memory_file import KeepsMemory, integers, within
from .ngram import draftable
from .path_bans import PathBans
from .rank_trees import tree_from_accuracies
from .recycling_trees import CandidateMatrix, Proposal, StaticTemplate, sampled_chain
from .registry import register

# How often the rank-r candidate (columns) is accepted at each depth below the root (rows) when
# its parent was: measured on the bundled Python target at T=0, 24 held-out prompts x 96 tokens,
# through a 120-node tree, before the prompt seed (`python scripts/recycling_experiment.py
# --rank-accuracy --prompts 24 --max-new-tokens 96` now gives rank 0 at 0.70 / 0.71 / 0.78 / 0.78
# / 0.86, docs/benchmarks.md). Depths 6-8 were never reached and repeat depth 5. Only the order of
# the products matters: it decides which paths a tree of `tree_budget` nodes holds.
DEFAULT_RANK_ACCURACY = [
    [0.71, 0.088, 0.045, 0.016, 0.014, 0.008, 0.002, 0.004],
    [0.674, 0.08, 0.025, 0.023, 0.018, 0.012, 0.015, 0.002],
    [0.792, 0.059, 0.027, 0.003, 0.006, 0.004, 0.001, 0.004],
    [0.792, 0.05, 0.004, 0.013, 0.001, 0.001, 0.001, 0.001],
] + [[0.845, 0.036, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001]] * 4


@register
class RecyclingDrafter(KeepsMemory, Drafter):
    name = "recycling"

    @dataclass
    class Options:
        top_k: int = 8  # candidates kept per token id (the matrix's width)
        tree_budget: int = 16  # greedy rows: nodes of the tree built from rank_accuracy (widens the target pass)
        tree: list[list[int]] | None = None  # greedy rows: paths of candidate ranks instead, e.g. [[0], [1], [0, 0]]
        rank_accuracy: list[list[float | None]] | None = None  # per depth, per rank (from a report); None = built in
        sampled_depth: int = 4  # sampled rows: a chain this long drawn from the recorded probabilities; 0 = the tree
        seed_from_prompt: bool = True  # tokens the target has not ranked yet: the prompt's next token as candidate
        memory_file: str | None = None  # the matrix kept across restarts: loaded at start, saved on exit / when asked

        def __post_init__(self):
            if self.top_k < 1 or self.tree_budget < 1 or self.sampled_depth < 0:
                raise ValueError(f"recycling: top_k and tree_budget must be >= 1 and sampled_depth >= 0 (got "
                                 f"{self.top_k}, {self.tree_budget}, {self.sampled_depth})")
            for path in self.tree or []:
                if not path or any(not isinstance(r, int) or not 0 <= r < self.top_k for r in path):
                    raise ValueError(f"recycling: tree path {path} needs ranks in [0, top_k={self.top_k}); "
                                     "raise top_k or use lower ranks")
            if self.rank_accuracy is not None and not (
                    self.rank_accuracy and all(isinstance(row, list) and row for row in self.rank_accuracy)
                    and all(a is None or 0 <= a <= 1 for row in self.rank_accuracy for a in row)):
                raise ValueError("recycling: rank_accuracy is a list per depth of a list per rank of shares in [0, 1] "
                                 "(null: never tried), e.g. [[0.6, 0.1], [0.65, 0.1]] (a report's `rank_accuracy`)")
            if self.tree is not None and not self.tree:
                raise ValueError("recycling: tree [] has no paths: give paths of candidate ranks, e.g. [[0], [1], "
                                 "[0, 0]], or leave tree out for the tree built from rank_accuracy")
            if self.tree is not None and (self.rank_accuracy is not None or self.tree_budget != type(self).tree_budget):
                # (the tree was used and the others dropped without a word)
                raise ValueError("recycling: tree gives the paths itself; tree_budget and rank_accuracy build a tree "
                                 "instead of it: drop one or the other")

    def __init__(self, options: "RecyclingDrafter.Options", target):
        self.options = options
        self.device = target.device
        self.needs = TargetNeeds(top_tokens=options.top_k)
        self.matrix = CandidateMatrix(target.vocab_size, options.top_k, self.device)
        if options.memory_file:
            self.memory_identity = target_fingerprint(target.model)  # whose ranking the matrix holds
            self.load_memory()
        # A report's table holds None where a rank was never tried: it counts as never right.
        table = [[a or 0.0 for a in row[:options.top_k]] for row in options.rank_accuracy or DEFAULT_RANK_ACCURACY]
        self.template = StaticTemplate(options.tree or tree_from_accuracies(table, options.tree_budget), self.device)
        self._reset_counts()

    def max_depth(self) -> int:
        """The round's deepest draft: a sampled round's chain, else the greedy tree (adaptive
        speculation bets on depths up to this; a sampled round never drafts deeper)."""
        sampled = self.sampling is not None and not self.shape_sampling().greedy
        if sampled and self.options.sampled_depth:
            return self.options.sampled_depth
        return self.template.depths[-1]

    def forget_outputs(self):
        self.matrix.forget()

    def memory_tensors(self):
        """The tokens the matrix knows, their candidates and probabilities (drafters/memory_file.py;
        the identity is the fingerprint of the target that ranked them)."""
        known = self.matrix.ids[:, 0] >= 0
        return {"tokens": known.nonzero()[:, 0].to(torch.int32), "ids": self.matrix.ids[known],
                "probs": self.matrix.probs[known]}

    def memory_mismatch(self, identity):
        return fingerprint_difference(identity, self.memory_identity)

    def memory_damage(self, tensors):
        tokens, ids, probs = (tensors.get(name) for name in ("tokens", "ids", "probs"))
        if tokens is None or ids is None or probs is None or ids.dim() != 2 or ids.shape != probs.shape \
                or tokens.shape != ids.shape[:1]:
            return "tensors without the shapes a matrix is saved in"
        if not integers(tokens, ids) or not probs.is_floating_point():
            return f"{tokens.dtype} tokens, {ids.dtype} ids and {probs.dtype} probabilities, not integer ids " \
                "and float probabilities"
        if not (within(tokens, 0, self.matrix.vocab_size) and within(ids, -1, self.matrix.vocab_size)):
            return "token ids outside the target's vocabulary"
        if not ((probs >= 0).all() and (probs <= 1).all()):  # a NaN fails both
            return "probabilities outside [0, 1]"
        return None

    def restore_memory(self, tensors):
        tokens = tensors["tokens"].long().to(self.device)
        k = min(self.options.top_k, tensors["ids"].shape[1])  # top_k may have changed since: keep what fits
        self.matrix.ids[tokens, :k] = tensors["ids"][:, :k].to(self.device, torch.int32)
        self.matrix.probs[tokens, :k] = tensors["probs"][:, :k].to(self.device, torch.float32)

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.prompt_lengths = [len(p) for p in prompts]
        self.proposed: list[Proposal | None] = [None] * len(prompts)  # this round's, for the rank counts
        self.path_bans = PathBans(everywhere=True)
        self._reset_counts()
        self._seed(prompts)

    def _seed(self, prompts: list[list[int]]) -> None:
        if self.options.seed_from_prompt:
            for prompt in prompts:
                self.matrix.seed(prompt)

    def keep_rows(self, indices):
        self.prompt_lengths = [self.prompt_lengths[i] for i in indices]
        self.proposed = [self.proposed[i] for i in indices]
        self.path_bans.select_rows(indices)

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        self.prompt_lengths += [len(p) for p in prompts]
        self.proposed += [None] * len(prompts)
        self._seed(prompts)

    def observe(self, feedback):
        if not feedback.target_top:
            return
        self._count_ranks(feedback)
        # The roots and accepted drafts of every row go last, so where a token appears twice the
        # candidates that win are those seen in text a row really continues (among those, the
        # later row's; among the rest, likewise): a stable sort of all rows' slots by that mark.
        tokens = torch.cat([tokens for tokens, _, _ in feedback.target_top]).to(self.device)
        on_path = torch.zeros(tokens.shape[0], dtype=torch.uint8, device=self.device)
        start = 0
        for (slot_tokens, _, _), path in zip(feedback.target_top, feedback.accepted_nodes):
            on_path[[start] + [start + n + 1 for n in path]] = 1
            start += slot_tokens.shape[0]
        order = torch.argsort(on_path, stable=True)
        k = self.options.top_k  # a cascade asks for its children's largest top_k
        top = torch.cat([top[:, :k] for _, top, _ in feedback.target_top]).to(self.device)
        probs = torch.cat([probs[:, :k] for _, _, probs in feedback.target_top]).to(self.device)
        self.matrix.write(tokens[order], top[order], probs[order])

    @torch.no_grad()
    def propose(self, contexts):
        minimums = self.min_new_tokens_per_row(len(contexts))
        sampling = self.draft_sampling()
        path_bans = self.path_bans.round(sampling, contexts, self.grammar)
        limit = self.depth_limit if self.depth_limit is not None else self.max_depth()
        n = self.template.nodes_within(limit)
        greedy = greedy_rows(sampling, len(contexts))
        if any(greedy) or not self.options.sampled_depth:  # the template for every row at once
            read = self.template.read(self.matrix, torch.tensor([c[-1] for c in contexts], device=self.device), n)
        trees = []
        for b, ctx in enumerate(contexts):
            banned_depths = minimums[b] - (len(ctx) - self.prompt_lengths[b])
            allowed = None
            if path_bans is not None or (banned_depths > 0 and self.eos_token_ids):
                def allowed(path, b=b, banned_depths=banned_depths):
                    return len(draftable(path, banned_depths, self.eos_token_ids, path_bans, b)) == len(path)
            self.proposed[b] = None
            if not greedy[b] and self.options.sampled_depth:
                temperature = (sampling.rows[b] if isinstance(sampling, RowSampling) else sampling).temperature
                trees.append(sampled_chain(self.matrix, ctx[-1], min(limit, self.options.sampled_depth), temperature,
                                           self.generator, allowed))
                continue
            if allowed is None:
                self.proposed[b] = self.template.known(read[b])
            else:
                forced = []
                if self.grammar is not None:  # what the grammar forces next, first (drafters/path_bans.py)
                    forced = draftable(self.grammar.forced(b)[:limit], banned_depths, self.eos_token_ids, path_bans, b)
                self.proposed[b] = self.template.within_rules(self.matrix, ctx[-1], n, allowed, forced)
            trees.append(self.proposed[b].tree)
        return trees

    def _count_ranks(self, feedback) -> None:
        """Per depth and rank: how often a node whose parent was accepted was accepted too. Only
        rows whose verified tree is this drafter's own reading (not another cascade child's, not
        one the engine cut, not one holding a grammar's forced tokens)."""
        for b, ((slot_tokens, _, _), path) in enumerate(zip(feedback.target_top, feedback.accepted_nodes)):
            mine = self.proposed[b] if b < len(self.proposed) else None
            if mine is None or mine.ranks is None or not torch.equal(slot_tokens[1:].to(self.device),
                                                                     mine.tree.tokens):
                continue
            accepted = set(path)
            for j, (parent, depth, rank) in enumerate(zip(mine.tree.parents.tolist(), mine.depths, mine.ranks)):
                if parent < 0 or parent in accepted:
                    self.trials[depth - 1][rank] += 1
                    self.hits[depth - 1][rank] += j in accepted
        self.proposed = [None] * len(self.proposed)

    def _reset_counts(self) -> None:
        depth = self.template.depths[-1]  # the greedy tree's (sampled chains are not counted)
        self.trials = [[0] * self.options.top_k for _ in range(depth)]
        self.hits = [[0] * self.options.top_k for _ in range(depth)]

    def report(self) -> dict:
        """rank_accuracy[d][r]: the share of depth-(d+1) rank-r nodes accepted when their parent
        was (None where none was tried), to pass back as the `rank_accuracy` option; the matrix's
        known tokens."""
        accuracy = [[round(h / t, 4) if t else None for h, t in zip(hits, trials)]
                    for hits, trials in zip(self.hits, self.trials)]
        return {"rank_accuracy": accuracy, "rank_trials": self.trials, "known_tokens": self.matrix.known_tokens()}
