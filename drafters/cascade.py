"""`cascade`: several drafters in order of preference. Each round, every row takes the first child
whose proposal is non-empty (a child's own options decide when it proposes: ngram with
min_ngram: 3 stays silent without a 3-token match), so a cheap drafter goes first and a costly one
drafts only when a row needs it.

Exactness holds because a row's choice depends only on the earlier children's proposals, never on
the random draws of the child it picks: the tree that reaches the verifier is that child's own
proposal, with its own node kinds and draft distributions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .base import Drafter, DraftTree, TargetNeeds
from .registry import _REGISTRY, available, build_drafter, drafter_options, register


@register
class CascadeDrafter(Drafter):
    name = "cascade"

    @dataclass
    class Options:
        drafters: list[dict] | None = None  # child drafter configs, most preferred first (required)

        def __post_init__(self):
            if not isinstance(self.drafters, list) or not self.drafters:
                raise ValueError("cascade: set drafter.drafters to a list of drafter configs, e.g. "
                                 "[{name: ngram, min_ngram: 3}, {name: draft_model, path: ...}]")
            for i, child in enumerate(self.drafters):
                where = f"cascade: drafters[{i}]"
                if not isinstance(child, dict) or "name" not in child:
                    raise ValueError(f"{where} must be a mapping with a name, e.g. {{name: ngram}}; got {child!r}")
                name = child["name"]
                if name not in _REGISTRY:
                    raise ValueError(f"{where}: unknown drafter '{name}'; available drafters: {available()}")
                if "adaptive" in child:
                    raise ValueError(f"{where}: set adaptive: true on the cascade itself, not on one child "
                                     "(the cascade already skips children that have nothing to propose)")
                try:  # the child's own Options check its keys and types; say which child failed
                    drafter_options(_REGISTRY[name], {k: v for k, v in child.items() if k != "name"})
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
            files = [str(Path(f).expanduser().resolve()) for f in _memory_files(self.drafters)]
            shared = sorted({f for f in files if files.count(f) > 1})
            if shared:  # each save would overwrite the other's: one memory would be lost at every exit
                raise ValueError(f"cascade: children share memory_file {shared}: give each child its own file")

    def __init__(self, options: "CascadeDrafter.Options", target):
        self.children = [build_drafter(child, target) for child in options.drafters]
        self.labels = [_label(child, i) for i, child in enumerate(options.drafters)]
        layers: list[int] = []
        for child in self.children:
            layers += [n for n in child.needs.hidden_state_layers if n not in layers]
        self.needs = TargetNeeds(hidden_state_layers=tuple(layers),
                                 top_tokens=max(child.needs.top_tokens for child in self.children),
                                 target_cache=any(child.needs.target_cache for child in self.children),
                                 target_cache_margin=max(child.needs.target_cache_margin for child in self.children))
        self.device = target.device if target is not None else "cpu"
        self._reset_counters()

    def max_depth(self) -> int:
        return max(child.max_depth() for child in self.children)

    def extra_parameters(self) -> int:
        return sum(child.extra_parameters() for child in self.children)

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        for child in self.children:
            self.pass_round_settings(child)
            child.begin(prompts, sampling, generator)
        self._reset_counters()

    def propose(self, contexts):
        trees: list[DraftTree | None] = [None] * len(contexts)
        self.chosen: list[int] = [-1] * len(contexts)  # child used per row, -1 = none proposed
        self.called: list[int] = []  # children whose propose ran this round (they must observe)
        for c, child in enumerate(self.children):
            waiting = [i for i, t in enumerate(trees) if t is None]
            if not waiting:
                break  # later children are not asked at all: that is where a cascade saves time
            # Every row, not only the waiting ones: children keep per-row state for all active rows.
            child.depth_limit = self.depth_limit  # set on the cascade by adaptive speculation
            # set by the engine each round (the end tokens grow when rows join with stops of their own)
            self.pass_round_settings(child)
            proposals = child.propose(contexts)
            self.called.append(c)
            for i in waiting:
                if proposals[i].size:
                    trees[i], self.chosen[i] = proposals[i], c
                    self.counters[c]["proposed"] += proposals[i].size
                    self.counters[c]["row_rounds"] += 1
        self.empty_row_rounds += sum(t is None for t in trees)
        return [t if t is not None else DraftTree.empty(self.device) for t in trees]

    def observe(self, feedback):
        for i, c in enumerate(self.chosen):
            if c >= 0:
                self.counters[c]["accepted"] += len(feedback.accepted_nodes[i])
        chosen = self.chosen or [-1] * len(feedback.accepted_nodes)  # [] when adaptive skipped propose
        for c, child in enumerate(self.children):
            # Every child hears about every round, asked or not: a child whose tree was not
            # verified for a row accepted none of its drafts there, but it still sees what was
            # emitted and the target's hidden states of the emitted tokens (feature-level heads
            # keep a history of them). Children that were not asked have no drafts to roll back.
            paths = [path if mine == c else [] for path, mine in zip(feedback.accepted_nodes, chosen)]
            child.observe(dataclasses.replace(feedback, accepted_nodes=paths))
        self.chosen, self.called = [], []

    def observe_prefill(self, target_hidden):
        for child in self.children:
            if child.needs.hidden_state_layers:
                child.observe_prefill(target_hidden)

    def keep_rows(self, indices):
        for child in self.children:
            child.keep_rows(indices)

    def attach_target_cache(self, target_lm):
        for child in self.children:
            if child.needs.target_cache:
                child.attach_target_cache(target_lm)

    def forget_outputs(self):
        for child in self.children:
            child.forget_outputs()

    def memory_files(self):
        return [path for child in self.children for path in child.memory_files()]

    def save_memory(self):
        return [path for child in self.children for path in child.save_memory()]

    @property
    def can_add_rows(self) -> bool:
        return all(child.can_add_rows for child in self.children)

    def add_rows(self, prompts, target_hidden):
        for child in self.children:
            child.add_rows(prompts, target_hidden if child.needs.hidden_state_layers else [{} for _ in prompts])

    def report(self) -> dict:
        """Which child proposed what since the last begin(): per child, the row-rounds its tree was
        verified, the nodes it proposed there and the drafts accepted; plus row-rounds with no
        proposal at all (plain decoding steps)."""
        return {"drafters": [{"drafter": label, **counts} for label, counts in zip(self.labels, self.counters)],
                "no_proposal_row_rounds": self.empty_row_rounds}

    def _reset_counters(self) -> None:
        self.counters = [{"row_rounds": 0, "proposed": 0, "accepted": 0} for _ in self.children]
        self.empty_row_rounds = 0
        self.chosen, self.called = [], []


def _label(child: dict, index: int) -> str:
    """'0:ngram' - the index keeps two children of the same kind apart."""
    return f"{index}:{child['name']}"


def _memory_files(configs: list[dict]) -> list[str]:
    """The memory_file of every drafter in these configs, nested cascades' children included."""
    files = []
    for config in configs:
        files += [config["memory_file"]] if config.get("memory_file") else []
        files += _memory_files(config.get("drafters") or []) if config["name"] == "cascade" else []
    return files
