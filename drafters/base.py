"""The one interface every drafter implements, and the draft-tree format the verifier consumes.

Words used throughout draftsman:
  committed  tokens whose KV entries are in the target's cache (prompt and emitted tokens, except
             the newest emitted one).
  root       the newest emitted token: not yet in any cache. Every draft tree hangs below it.
  node       one drafted token. Its parent is another node or the root (parent index -1).
  kind       how a node was produced, which decides how the verifier tests it:
               DETERMINISTIC         chosen by a rule (argmax, lookup): q is one-hot on the token;
               IID                   sampled from `draft_probs[node]`, independently of its siblings;
               WITHOUT_REPLACEMENT   sampled from `draft_probs[node]` with earlier siblings'
                                     tokens removed (and the rest renormalised).
             Siblings drawn from one distribution must carry the same `draft_probs` row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Sequence

import torch

if TYPE_CHECKING:  # imported for annotations only; drafters never import the engine at runtime
    from ..verifier.grammar import DraftGrammar
    from ..verifier.sampling import RowSampling, SamplingParams

DETERMINISTIC, IID, WITHOUT_REPLACEMENT = 0, 1, 2
KIND_NAMES = {DETERMINISTIC: "deterministic", IID: "iid", WITHOUT_REPLACEMENT: "without_replacement"}


@dataclass
class DraftTree:
    """One row's proposal. Nodes are in topological order: a parent comes before its children,
    and siblings appear in the order they were produced (the verifier tests them in that order).

    tokens       (n,) long
    parents      (n,) long, -1 for children of the root, else an index < own index
    kinds        (n,) long, one of DETERMINISTIC / IID / WITHOUT_REPLACEMENT
    draft_probs  (n, V) float, the distribution each node was drawn from; None if all nodes are
                 deterministic.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    kinds: torch.Tensor
    draft_probs: torch.Tensor | None = None
    _depths: list[int] | None = field(default=None, init=False, repr=False, compare=False)
    _parents: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.parents.shape != (n,) or self.kinds.shape != (n,):
            raise ValueError(f"DraftTree: tokens {tuple(self.tokens.shape)}, parents "
                             f"{tuple(self.parents.shape)} and kinds {tuple(self.kinds.shape)} must all be (n,)")
        if n and bool((self.parents >= torch.arange(n, device=self.parents.device)).any()):
            raise ValueError("DraftTree: every parent index must be -1 or smaller than the node's own index")
        if self.draft_probs is None and n and bool((self.kinds != DETERMINISTIC).any()):
            raise ValueError("DraftTree: sampled nodes (IID / WITHOUT_REPLACEMENT) need draft_probs")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1. Computed once per tree: the
        engine, the packer and adaptive speculation all ask every round."""
        if self._depths is None:
            depth: list[int] = []
            for p in self.parent_list():
                depth.append(1 if p < 0 else depth[p] + 1)
            self._depths = depth
        return self._depths

    def parent_list(self) -> list[int]:
        """`parents` as a list, read from the device once per tree."""
        if self._parents is None:
            self._parents = self.parents.tolist()
        return self._parents

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return DraftTree(z, z.clone(), z.clone())

    @staticmethod
    def chain(tokens: Sequence[int] | torch.Tensor, kind: int = DETERMINISTIC,
              draft_probs: torch.Tensor | None = None, device: torch.device | str = "cpu") -> "DraftTree":
        """A chain is a tree where node i's parent is node i-1."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(-1)
        n = tokens.shape[0]
        parents = torch.arange(-1, n - 1, dtype=torch.long, device=device)
        kinds = torch.full((n,), kind, dtype=torch.long, device=device)
        return DraftTree(tokens, parents, kinds, draft_probs)

    def truncated_to_depth(self, max_depth: int) -> "DraftTree":
        """Drop nodes deeper than max_depth (used when a row nears the context limit)."""
        return self._nodes([i for i, d in enumerate(self.depths()) if d <= max_depth])

    def _nodes(self, keep: list[int]) -> "DraftTree":
        """The tree of the nodes `keep` (ascending; each one's parent kept too)."""
        if len(keep) == self.size:
            return self
        # Surviving nodes keep their order, so a parent's new index is its rank among survivors.
        remap = {old: new for new, old in enumerate(keep)}
        idx = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        parents = [remap[p] if p >= 0 else -1 for p in (self.parent_list()[i] for i in keep)]
        return DraftTree(self.tokens[idx], torch.tensor(parents, dtype=torch.long, device=self.tokens.device),
                         self.kinds[idx], None if self.draft_probs is None else self.draft_probs[idx])

    def is_chain(self) -> bool:
        """Node i's parent is node i - 1 for every i. Read from the cached depths (1, 2, ..., n
        exactly for a chain): the engine asks every row every round, and this costs no tensor op."""
        return self.depths() == list(range(1, self.size + 1))

    def first_chain(self) -> "DraftTree":
        """The chain of first children from the root (first_branches(1))."""
        return self.first_branches(1)

    def first_branches(self, count: int) -> "DraftTree":
        """At most `count` root-to-leaf branches of the tree: what a target with recurrent layers
        verifies, a branch a row (verifier/branches.py). The first is the chain of first children;
        each next one leaves the branches kept at the shallowest node that has a next child, and
        follows first children from there. Exact: which nodes are kept depends on the tree's
        shape only, never on the tokens drawn, and every node keeps its first children, in the
        order they were drawn; each kept child was drawn as it would be had its later siblings
        never been (the verifier's tests of later siblings condition on the earlier ones only)."""
        if self.is_chain():
            return self
        children: list[list[int]] = [[] for _ in range(self.size + 1)]  # index 0: the root's
        for i, p in enumerate(self.parent_list()):
            children[p + 1].append(i)
        depths = self.depths()
        kept_children = [0] * (self.size + 1)  # per node (0: the root): how many of its first children are kept
        keep: set[int] = set()

        def follow(node: int) -> None:  # node's next child, then first children down to a leaf
            while kept_children[node + 1] < len(children[node + 1]):
                child = children[node + 1][kept_children[node + 1]]
                kept_children[node + 1] += 1
                keep.add(child)
                node = child

        follow(-1)
        for _ in range(count - 1):
            forks = [n for n in [-1, *sorted(keep)] if kept_children[n + 1] < len(children[n + 1])]
            if not forks:
                break
            follow(min(forks, key=lambda n: (0 if n < 0 else depths[n], n)))
        return self._nodes(sorted(keep))


@dataclass
class TargetNeeds:
    """What a drafter asks of each target pass, so the verifier computes only that.
    hidden_state_layers: indices into HF `hidden_states` (0 = embeddings, -1 = last layer output).
    top_tokens: how many of the target's most likely next tokens to hand back after every token
    of each round's block, the rejected drafts' included (the `recycling` drafter); 0 = none.
    target_cache: the drafter attends to the target's own keys and values of the committed tokens
    (the `gemma4_assistant` drafter): the engine sets its `target_lm`, the target's CachedLM, whose
    rows are the drafter's rows at every propose(). target_cache_margin: how many positions
    further back than the target's own sliding window it reads (the cache keeps them)."""

    hidden_state_layers: tuple[int, ...] = ()
    top_tokens: int = 0
    target_cache: bool = False
    target_cache_margin: int = 0


@dataclass
class RoundFeedback:
    """What the engine tells a drafter after each verification round, per active row.

    accepted_nodes   node indices (into this round's tree) on the accepted path, root to leaf
    emitted          tokens appended to the row this round (accepted drafts + bonus/recovered;
                     EOS/length truncation already applied)
    target_hidden    for each requested layer, (n_kept, d) hidden states of the root and accepted
                     nodes in order, if the drafter asked for any; else empty
    verify_seconds   wall time of this round's target pass and accept/reject (for cost models)
    block_tokens     tokens per row in that target pass (root + the widest tree)
    target_top       if the drafter asked for `needs.top_tokens` = k: per row, (tokens, top, probs)
                     with tokens (n,) the root and this round's tree's nodes in the order the
                     verifier saw them (root first; trees as the engine clipped them), top (n, k)
                     the target's k most likely next tokens after each, best first, from the
                     logits it chose from (bias, penalties, bans and grammar applied), and probs
                     (n, k) float32 their probabilities under those logits at temperature 1; else
                     empty
    """

    accepted_nodes: list[list[int]]
    emitted: list[list[int]]
    target_hidden: list[dict[int, torch.Tensor]] = field(default_factory=list)
    verify_seconds: float = 0.0
    block_tokens: int = 1
    target_top: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class Drafter:
    """Base class: subclass, set `name`, implement `propose`, register it (drafters/registry.py).

    Lifecycle for one `generate` call over a batch:
        begin(prompts, sampling, generator)       once; prompts are the full token lists per row
        observe_prefill(target_hidden)            once, if the drafter asked for hidden states
        repeat:
            propose(contexts) -> list[DraftTree]  contexts[i] = all tokens of active row i so far
            observe(feedback)                     what was accepted, to roll back own state
            keep_rows(indices)                    rows that finished are dropped (indices into
                                                  the current active rows, ascending)
            add_rows(prompts, target_hidden)      rows join the batch after the others
                                                  (continuous batching), before a propose
    Subclasses that hold no state need only `propose` (and `can_add_rows = True`).
    """

    name: ClassVar[str] = ""
    needs: TargetNeeds = TargetNeeds()
    # Set by a wrapper (adaptive speculation) before `propose`: drafters that can draft less when
    # asked honour it; others may ignore it (the engine truncates their trees anyway).
    depth_limit: int | None = None
    # Set by the engine before `begin`: each row's max_new_tokens (how long rows still run), by the
    # engine's row numbers (rows that join are added); a number stands for every row.
    token_budget: int | list[int] | None = None
    sampling: "SamplingParams | None" = None  # the current request's, set by begin()
    # Set by the engine before `begin` and before each `propose`: a row's new tokens up to number
    # min_new_tokens cannot be one of eos_token_ids (the target's EOS logit is -inf there). One
    # number for every row, or a list of one per row of the coming propose() when requests with
    # their own minimum share the batch (read it through min_new_tokens_per_row). Model drafters
    # mask them in their drafts (drafters/eos_ban.py); wrappers pass both on to the drafters they
    # hold, before each propose. eos_token_ids holds every row's EOS and stop token ids together
    # (rows may have stop tokens of their own): banning a token only another row ends at costs a
    # few drafts, never exactness.
    min_new_tokens: int | list[int] = 0
    eos_token_ids: frozenset[int] = frozenset()
    # Set by the engine before each `propose`: the coming rows' own sampling settings when they
    # are not all `sampling` (a RowSampling, or the one setting the rows left share), else None.
    # A drafter that draws its drafts may draw each row under its own (draft_sampling()): a
    # greedy row then drafts its argmax, a sampled row from its own q. Drawing every row under
    # `sampling` is exact too (the verifier tests any draft against each row's own p); it only
    # accepts less.
    row_sampling: "SamplingParams | RowSampling | None" = None
    # Set by the engine before each `propose`: under structured output, what each coming row's
    # grammar allows after a path of drafts (verifier/grammar.py's DraftGrammar), else None.
    # Drafters that take path bans draft within it (drafters/path_bans.py); drafts only, so
    # ignoring it is exact too (a forbidden draft is rejected).
    grammar: "DraftGrammar | None" = None

    def draft_sampling(self) -> "SamplingParams | RowSampling":
        """The settings this round's drafts are drawn under: the rows' own, else the request's."""
        return self.row_sampling if self.row_sampling is not None else self.sampling

    def shape_sampling(self) -> "SamplingParams":
        """The setting that picks this round's drafting shape (e.g. a greedy tree or a sampled
        chain): the one the rows share, else the request's (the one most rows had at its start)."""
        from ..verifier.sampling import SamplingParams  # noqa: F811 (the import above is for annotations only)

        rows = self.row_sampling
        return rows if isinstance(rows, SamplingParams) else self.sampling

    def pass_round_settings(self, inner: "Drafter") -> None:
        """What the engine sets before each propose, passed on to a drafter this one holds."""
        inner.min_new_tokens, inner.eos_token_ids = self.min_new_tokens, self.eos_token_ids
        inner.row_sampling = self.row_sampling
        inner.grammar = self.grammar

    def min_new_tokens_per_row(self, rows: int) -> list[int]:
        """min_new_tokens as one number per row of the coming propose()."""
        m = self.min_new_tokens
        return list(m) if isinstance(m, (list, tuple)) else [m] * rows

    def begin(self, prompts: list[list[int]], sampling: "SamplingParams", generator: torch.Generator) -> None:
        self.sampling = sampling
        self.generator = generator
        self.row_sampling = None  # until the engine's first round says otherwise
        self.grammar = None  # likewise

    def observe_prefill(self, target_hidden: list[dict[int, torch.Tensor]]) -> None:
        """Called once after `begin` if `needs.hidden_state_layers` is set: per row, for each
        requested layer, (len(prompt) - 1, d) hidden states of the prompt's tokens but the last
        (which is the first round's root). Empty dicts for one-token prompts."""

    def propose(self, contexts: list[list[int]]) -> list[DraftTree]:
        raise NotImplementedError

    def observe(self, feedback: RoundFeedback) -> None:
        pass

    def keep_rows(self, indices: list[int]) -> None:
        pass

    def attach_target_cache(self, target_lm) -> None:
        """The engine hands over its target cache (needs.target_cache); wrappers pass it on."""
        self.target_lm = target_lm

    # Whether add_rows() is implemented: a drafter that keeps per-row state must extend it for
    # joining rows, so the default is False (the engine then refuses to add rows) until it does.
    can_add_rows: bool = False

    def add_rows(self, prompts: list[list[int]], target_hidden: list[dict[int, torch.Tensor]]) -> None:
        """Rows join a running batch, after the current ones: their full prompts and, per row,
        what observe_prefill() would have been given for them (empty dicts when the drafter asked
        for no hidden states). The request's sampling, generator and limits stay as begin() set them.
        Nothing to do for a drafter without per-row state (it sets can_add_rows = True only)."""

    def forget_outputs(self) -> None:
        """Drop what the drafter remembers of earlier requests' outputs (the `suffix` drafter's
        cache; nothing for the others). The benchmarks call it before every timed call: their
        prompts come again (warm-up, repeats, batch sizes), and a drafter that drafts a prompt's
        answer from its own earlier answer would be measuring the benchmark, not the drafter."""

    def memory_files(self) -> list[str]:
        """The files this drafter (and those it holds) keeps its memory of earlier requests in
        across restarts (a `memory_file` option; drafters/memory_file.py)."""
        return []

    def save_memory(self) -> list[str]:
        """Write that memory to its memory_files(), each atomically; the paths written. A wrapper
        saves the drafters it holds."""
        return []

    def max_depth(self) -> int:
        """Deepest tree this drafter may propose (the engine reserves context room for it)."""
        return 0

    # How a round's drafting cost grows with its depth: about d times one level where each level
    # is a pass (draft models, chained heads), about flat where one pass drafts every depth (a
    # parallel draft model). Adaptive speculation prices depths it has not measured by it.
    drafting_cost_grows_with_depth: bool = True

    def extra_parameters(self) -> int:
        """Parameters the drafter adds on top of the target (for reports)."""
        return 0

    def report(self) -> dict:
        """Drafter-specific statistics of the current generate call (e.g. which child of a cascade
        proposed what); copied into GenerationStats.drafter_report when the generate call ends."""
        return {}
