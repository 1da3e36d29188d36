"""Adaptive speculation: each round, draft only as deep as pays, possibly not at all.

Speculation is a bet. A round that verifies d drafted levels emits E(d) tokens per row on average,

    E(d) = 1 + r * (a1 + a1*a2 + ... + a1*...*ad)   (aj = acceptance at depth j given depth j-1,
                                                     r = share of rows with a proposal at all)

and costs draft(d) + pass(B, 1 + w(d)) seconds, where w(d) is the block width a draft d deep
gives (the widest row's nodes: narrower rows are padded to it) and B the batch size. The wrapper
keeps online estimates of every term and, each round:

1. before drafting, picks the d that maximises E(d) / cost(d); d = 0 is plain decoding. The bet
   must beat plain decoding by `min_gain` (`new_batch_gain` while this batch size's drafting cost
   is borrowed from another), and starting after plain rounds is charged the drafter's catch-up
   on every token it has not seen (an EAGLE head reads the whole prompt on its first draft);
2. after drafting, re-decides how deep to verify the trees actually drafted (verify_depth): the
   drafting is paid, the pass is not, and its width is now known. One row with a long n-gram match
   no longer makes a whole batch of rows without one pay for a wide pass. Only for deterministic
   drafts: cutting sampled ones by what was drawn would skew them (cut_after_drafting_is_exact).

For a batch both decisions price rows in lockstep (depth_rates, verify_depth): the request lasts
until its slowest row is done, so each row keeps its own acceptance and proposal rate
(adaptive_rows.py) and a bet is worth what it saves of the time until every row has its
remaining tokens (the engine sets token_budget), not the batch's average tokens per round. A
row's tokens per round vary, so rows finish at scattered rounds and the last of b rows comes
later than the average row does (lockstep_seconds, from each row's variance).

After a request that bet and still ran slower than plain decoding, its batch size's bar rises
toward how far the request fell short of what its rounds' predicted costs gave their tokens
(_learn_from_outcome): a ragged batch's last rounds and short requests' catch-ups show only over
a whole request. At batch 1 the tokens count as emitted, so a prompt that accepts less than the
last one does not carry over; rows in lockstep count them as expected. Requests that beat plain
decoding, or did not bet, let the bar fade.

Costs belong to the machine (kept across requests on a Decoder): the target pass by rows x width
(PassCost: rows are not tokens), drafting per batch-size bucket, catch-up per unseen token (at
most what the target's pass over those tokens costs), the engine's share of a round (plain rounds
and rounds that verify a tree apart), and those per-batch-size bars.
Acceptance belongs to the drafter, the target and the sampling settings: a request starts from the
estimates of the last request with the same settings, worth `carry_rounds` rounds; an unmeasured
depth starts from the estimate one level up, and a request's first decision gets the benefit of
the doubt (`start_optimism`) when starting is cheap. A new decoder, and one under sampling settings
it has not measured yet, first bets the full depth for `measure_rounds` rounds. While a bet's lead
over plain decoding is thin, a plain round every `probe_every` re-measures the alternative. While
d = 0 wins it probes now and then (`probe_rounds` rounds) at the depth of the bet that came closest
(or shallower), each fruitless probe doubling the wait, and only when the probe's expected cost
(catch-up included) is a small share of the plain rounds since the last one. Every round also pays
the engine's own bookkeeping (measured). Enabled with `adaptive: true` in any drafter's config.

The wrapper changes how deep the proposals are, never what is emitted: exactness is the
verifier's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from .adaptive_costs import (CostTable, OnlineLinearFit, PassCost, lockstep_plain_seconds,  # noqa: F401
                             lockstep_seconds, priced_on_grid)
from .adaptive_rows import RowEstimates
from .base import DETERMINISTIC, Drafter, DraftTree


@dataclass
class AdaptiveSettings:
    measure_rounds: int = 4  # a new decoder bets the full depth this many rounds before choosing:
    # with one or two rounds an unlucky first rejection kept a good drafter (EAGLE-3) off
    probe_every: int = 16  # rounds of plain decoding before the first probe...
    probe_backoff: float = 2.0  # ...times this after every probe that did not pay...
    max_probe_every: int = 256  # ...up to this many rounds
    probe_rounds: int = 1  # a probe bets this many rounds in a row (3 let draft_model-adaptive
    # find its 1.09x on continuation prompts, but cost 0.85-0.91x at batch 4: kept at 1)
    prior_acceptance: float = 0.5  # per-depth acceptance before anything is measured...
    prior_weight: float = 1.0  # ...worth this many observed rounds
    decay: float = 0.95  # weight of past rounds in every running estimate
    cost_window: int = 8  # a pass width's (a batch size's) cost: the lower quartile of its last
    # this many rounds (timing noise is one-sided: stalls)...
    forget_cost_after: int = 64  # ...and one not measured in this many rounds is doubted (priced at
    # most like the nearest smaller width in use): one measured during a stall is tried again
    min_gain: float = 0.03  # speculate only if the bet beats plain decoding by this fraction:
    # timings are noisy, and a near-tie is better left to the plain path (no draft state to keep)
    stop_margin: float = 0.05  # once speculating, stop when the bet falls this far below plain
    # decoding: two early rejections (a hard start, the bet's own noise) moved an EAGLE-3 bet
    # from 5% ahead to 3% behind and kept it off for the rest of a request it would have won
    new_batch_gain: float = 0.25  # ...or by this fraction while this batch size's drafting cost is
    # borrowed from another batch size (drafting and pass widths grow with the batch, unmeasured)
    start_optimism: float = 2.0  # a request's first decision counts this many extra accepted rounds
    # at every depth: the carried estimates come from other text, and a bet not taken is never
    # measured (rounds of its own confirm or undo it)...
    optimism_max_catch_up: float = 2.0  # ...when the drafter's catch-up on the prompt costs at most
    # this many plain steps (at batch 16 an EAGLE head's costs 14: exploring there is not cheap)
    carry_rounds: float = 8.0  # a request with the same sampling settings starts from the previous
    # request's acceptance estimates, worth at most this many rounds
    recheck_margin: float = 0.25  # while the bet's predicted lead over plain decoding is below this,
    # run a plain round every probe_every rounds: the plain cost it is compared with is otherwise
    # never measured again, and one slow early measurement would keep a losing bet going
    catch_up_rounds: int = 16  # a start's catch-up is charged over this many speculative rounds
    # (fewer if the request has fewer left: catch_up_spread)
    probe_budget: float = 0.03  # a probe may cost at most this share of the plain rounds since the
    # last one: its own extra pass and drafting, plus the drafter's catch-up on every token it has
    # not seen (an EAGLE head reads the whole prompt on its first draft: 0.3 s at batch 16 here).
    # It is what a request that never pays loses to probing: 5% cost draft_model 0.94-0.95x at
    # batch 8 (one late probe's catch-up on 8 prompts), 3% 0.99-1.02x
    min_plain_samples: int = 3  # a batch size's plain step priced from fewer rounds than this is
    # measured again (a plain round every probe_every rounds) whatever the bet's lead: its one
    # sample, a request's cold first step, read 28 ms for a 20 ms step at batch 8 and made EAGLE-3
    # bets look 30% ahead while they ran 7% behind. So is one last measured forget_cost_after
    # rounds ago (its old samples then make way for the new ones)
    outcome_weight: float = 0.5  # how far one request's outcome moves its batch size's gain penalty
    outcome_min_bets: int = 2  # only requests with this many bets (probes and measuring rounds
    # aside) teach it...
    row_prior_rounds: float = 4.0  # a row's own acceptance and proposal rate count against this
    # many rounds of the batch's: the row that gains least sets how many rounds a batch runs
    plain_reprice_every: int = 4  # in a plain stretch a round reuses the last round's prices of the
    # bets for this many rounds in all (stretch_rates): nothing is verified, so the acceptance
    # behind them stays put, and pricing every depth with rows in lockstep cost 1.1 ms a round at
    # batch 16 (ngram-adaptive, cProfile), 4% of a 25 ms plain step
    outcome_fade: float = 0.25  # ...and one with fewer lets it fade by this share: a bar above every
    # bet's predicted gain is otherwise never lowered (one unlucky batch-1 request kept
    # eagle3-adaptive plain for the rest of a run in which fixed eagle3 ran 1.49x)


class RoundPrediction(NamedTuple):
    """What the cost model expected of a round, kept until its outcome is counted."""
    seconds: float  # the round's drafting, pass and catch-up
    plain_step: float  # a plain step's seconds at this batch size
    tokens: float  # expected tokens per row
    lockstep_scale: float  # what rows in lockstep take off the tokens' worth
    bet: bool  # a bet the model believes in (not a measuring round or a probe)


def cut_after_drafting_is_exact(trees: list[DraftTree]) -> bool:
    """Whether a round's trees may be cut shallower by what they hold (verify_depth). Yes for
    deterministic drafts: the verifier is exact for any rule that picks a deterministic token,
    cuts included. No for sampled ones: keeping a node by what was drawn there skews the draws the
    verifier takes to come from draft_probs (tests/test_adaptive.py enumerates both)."""
    return all(t.draft_probs is None or bool((t.kinds == DETERMINISTIC).all()) for t in trees)


def depth_counts(trees: list[DraftTree], depth: int) -> list[list[int]]:
    """Per tree, its node count at each depth 1..depth: a round's shapes, read once and shared by
    the width estimate, the after-drafting cut and the acceptance update."""
    out = []
    for t in trees:
        counts = [0] * depth
        for x in t.depths():
            if x <= depth:
                counts[x - 1] += 1
        out.append(counts)
    return out


def deepest(counts: list[int]) -> int:
    """The depth of a tree's deepest node, from its depth_counts row."""
    return max((j + 1 for j, n in enumerate(counts) if n), default=0)


def expected_gains(counts: list[list[int]], reach: list[list[float]], depth: int) -> list[list[float]]:
    """Per verified depth d = 0..depth, per row, expected tokens of the round: 1 plus the reach of
    each level its tree has nodes at (counts: depth_counts; reach: per row, by depth)."""
    row_gains = [1.0] * len(counts)
    out = [list(row_gains)]
    for j in range(depth):
        row_gains = [g + (r[j] if row[j] > 0 else 0.0) for g, row, r in zip(row_gains, counts, reach)]
        out.append(row_gains)
    return out


def batch_bucket(batch: int) -> int:
    """Drafting cost grows with the batch, slowly: one fit per power of two."""
    return 1 << max(0, batch.bit_length() - 1)


class AdaptiveDrafter(Drafter):
    """Wraps any drafter; forwards its lifecycle and chooses each round's depth."""

    def attach_target_cache(self, target_lm):
        self.inner.attach_target_cache(target_lm)

    def __init__(self, inner: Drafter, settings: AdaptiveSettings | None = None):
        self.inner = inner
        self.name = f"adaptive({inner.name})"
        self.needs = inner.needs
        self.settings = settings or AdaptiveSettings()
        self.depth_log: list[int] = []  # depth verified each round (for reports and tests)
        # Kept across requests (the machine's costs): seconds of a target pass by rows x block
        # width, and per batch bucket seconds vs depth requested (> 0).
        self.verify_cost = PassCost(self.settings.cost_window, self.settings.forget_cost_after)
        self.draft_costs: dict[int, OnlineLinearFit] = {}
        # Seconds a drafter spends catching up on tokens it has not seen (after a plain stretch,
        # and the prompt in its first draft), by those tokens summed over rows.
        self.catch_up_cost = OnlineLinearFit(self.settings.decay, proportional=True)
        # Seconds of a round outside drafting and the target pass (the engine's bookkeeping),
        # by batch size: paid once per round, so it favours fewer, longer rounds. Rounds that
        # verify a tree pay more (packing it, the accepted paths, an EAGLE head's features) and
        # keep their own table. With one table for both (its lower quartile from the plain
        # rounds), EAGLE-3 kept betting at batch 8 and ran 0.92x of plain decoding; with two it
        # mostly stayed plain there (0.97x).
        self.round_overhead = CostTable(self.settings.cost_window, self.settings.forget_cost_after)
        self.tree_overhead = CostTable(self.settings.cost_window, self.settings.forget_cost_after)
        self._carried: list[tuple] = []  # (sampling, acceptance state) of recent requests, newest last
        # By batch bucket and sampling settings: extra gain a bet must promise, learnt from how
        # far requests' realized speed fell short of what their bets predicted
        # (_learn_from_outcome). By sampling too: bets at T=1 missing their predictions on noisy
        # acceptance kept a batch-1 decoder plain at T=0.
        self.gain_penalty: dict[tuple, float] = {}
        self._empty = DraftTree.empty()  # every row's tree in a plain round (trees are never modified)

    def max_depth(self) -> int:
        return self.inner.max_depth()

    def extra_parameters(self) -> int:
        return self.inner.extra_parameters()

    def forget_outputs(self):  # what it learnt of acceptance stays: it holds no text
        self.inner.forget_outputs()

    def memory_files(self):
        return self.inner.memory_files()

    def save_memory(self):
        return self.inner.save_memory()

    def begin(self, prompts, sampling, generator):
        if self.sampling is not None:  # a previous request on this decoder
            self._learn_from_outcome()
            self._carried = [c for c in self._carried if c[0] != self.sampling][-7:]
            self._carried.append((self.sampling, self._acceptance_state()))
        super().begin(prompts, sampling, generator)
        self.pass_round_settings(self.inner)
        self.inner.begin(prompts, sampling, generator)
        s = self.settings
        D = max(1, self.inner.max_depth())
        self.accepted_count = [0.0] * D  # decayed counts of row-rounds that accepted depth d+1...
        self.offered_count = [0.0] * D  # ...out of those that reached depth d with d+1 on offer
        # Block width beyond the root (the widest row's nodes) of a round drafted d+1 deep, as
        # drafted at that limit (EAGLE's trees stay as wide when shallower) and, until that is
        # measured, as counted within deeper drafts. A chain until trees are seen.
        self.width_at_limit: list[float | None] = [None] * D
        self.width_within = [float(d + 1) for d in range(D)]
        self.proposal_rate = 1.0  # decayed share of rows with a non-empty tree in speculative rounds
        self.full_bets = 0  # speculative rounds at full depth measured under these sampling settings
        self.rows = RowEstimates(len(prompts), D, s.decay, s.row_prior_rounds)  # the same, row by row
        for carried_sampling, state in self._carried:  # the last request with these settings
            if carried_sampling == sampling:
                self._resume(state)
        self.optimism = s.start_optimism  # for this request's first decision only
        self.rounds_since_probe = 0
        self.rounds_since_plain = 0  # rounds since a pass verified nothing (what plain decoding costs)
        self.previous_depth = 0
        self.probe_interval = float(s.probe_every)
        self.probing = False  # the last round was (part of) a probe...
        self.probe_depth = self.probe_left = 0  # ...this deep, with this many rounds to go
        self.depth_log = []
        self._last = None
        self._round = None  # (start time, batch, verify seconds, verified a tree) of the last observed round
        self._overhead_charged = 0.0  # the last round's overhead as predicted, until it is measured
        self.drafted_upto = [0] * len(prompts)  # per row, context length at the inner drafter's last draft
        # This request's outcome (_learn_from_outcome): its batch bucket and sampling settings,
        # tokens per original row, seconds spent, and what its bets predicted (sums over rounds of
        # predicted seconds, and of predicted seconds x predicted speed over plain decoding).
        self.request_key = (batch_bucket(len(prompts)), sampling)
        self.row_ids = list(range(len(prompts)))
        self.row_tokens = [0] * len(prompts)
        self.spent_seconds = self.predicted_seconds = self.predicted_plain_seconds = 0.0
        self.bet_rounds = 0
        self._belief = RoundPrediction(0.0, 0.0, 1.0, 1.0, False)
        self._lockstep_scale: list[float] | None = None  # this round's lockstep / average gain by depth
        self._stretch: tuple | None = None  # (batch, round, rates, lockstep scale) priced in a plain stretch

    def _acceptance_state(self) -> tuple:
        return (list(self.accepted_count), list(self.offered_count), list(self.width_at_limit),
                list(self.width_within), self.proposal_rate, self.full_bets)

    def _resume(self, state: tuple) -> None:
        """Start from the last request's acceptance, scaled down to carry_rounds rounds' worth."""
        accepted, offered, at_limit, within, rate, self.full_bets = state
        scale = min(1.0, self.settings.carry_rounds / max(max(offered, default=0.0), 1e-9))
        self.accepted_count = [a * scale for a in accepted]
        self.offered_count = [o * scale for o in offered]
        self.width_at_limit, self.width_within, self.proposal_rate = list(at_limit), list(within), rate

    def draft_cost(self, batch: int) -> OnlineLinearFit:
        """The drafting-cost fit for this batch size: its own bucket's once measured, else the
        nearest measured bucket's (the bucket's own rounds take over as soon as it has some)."""
        bucket = batch_bucket(batch)
        measured = [b for b, fit in self.draft_costs.items() if fit.seen]
        if not measured:
            return self._draft_fit()  # nothing measured yet
        return self.draft_costs[min(measured, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))]

    def record_draft_cost(self, batch: int, depth: int, seconds: float) -> None:
        self.draft_costs.setdefault(batch_bucket(batch), self._draft_fit()).add(depth, seconds)

    def _draft_fit(self) -> OnlineLinearFit:
        """A fit of drafting seconds by depth: through the origin while one depth is measured where
        each level is a pass, flat where one pass drafts every depth (a parallel draft model, whose
        depth 1 costs what its depth k does)."""
        return OnlineLinearFit(self.settings.decay, proportional=self.inner.drafting_cost_grows_with_depth)

    def observe_prefill(self, target_hidden):
        self.inner.observe_prefill(target_hidden)

    def keep_rows(self, indices):
        self.inner.keep_rows(indices)
        self.rows.keep(indices)
        self.drafted_upto = [self.drafted_upto[i] for i in indices]
        self.row_ids = [self.row_ids[i] for i in indices]

    @property
    def can_add_rows(self) -> bool:
        return self.inner.can_add_rows

    def add_rows(self, prompts, target_hidden):
        self.inner.add_rows(prompts, target_hidden)
        self.rows.add(len(prompts))
        self.drafted_upto += [0] * len(prompts)  # the inner drafter has seen nothing of them
        self.row_ids += range(len(self.row_tokens), len(self.row_tokens) + len(prompts))  # the engine's numbering
        self.row_tokens += [0] * len(prompts)

    def report(self) -> dict:
        return {"depths": self.depth_log, "acceptance_estimate": [round(a, 3) for a in self.acceptance],
                "gain_penalty": {f"batch {b}, {s}": round(p, 3) for (b, s), p in self.gain_penalty.items()},
                "inner": self.inner.report()}

    # -- the bet ----------------------------------------------------------------------------
    @property
    def acceptance(self) -> list[float]:
        """Per depth, measured acceptance shrunk toward a prior: prior_acceptance at depth 1, the
        estimate one level up below it (with a flat prior, a drafter whose deep levels had not been
        measured, EAGLE-3 accepting ~0.9 at every depth, looked no better than a coin below depth 1
        and stayed off). A request's first decision adds `optimism` accepted rounds at each depth."""
        s = self.settings
        out, prior, extra = [], s.prior_acceptance, self.optimism
        for a, o in zip(self.accepted_count, self.offered_count):
            prior = (a + extra + prior * s.prior_weight) / (o + extra + s.prior_weight)
            out.append(prior)
        return out

    def reach(self) -> list[float]:
        """reach[j]: chance that a row's draft at depth j+1 is accepted (all above it were)."""
        out, r = [], 1.0
        for a in self.acceptance:
            r *= a
            out.append(r)
        return out

    def expected_tokens(self, depth: int) -> float:
        """Per row: 1 + r * (a1 + a1*a2 + ...), r = the share of rows that get a proposal at all
        (n-gram lookup often has none; acceptance is measured on the rows that had one)."""
        return self.expected_tokens_by_depth()[depth]

    def expected_tokens_by_depth(self) -> list[float]:
        """expected_tokens(d) for d = 0..max_depth, from one pass over the acceptance estimates
        (choose_depth prices every depth each round, plain rounds included)."""
        out, total = [1.0], 0.0
        for r in self.reach():
            total += r
            out.append(1.0 + self.proposal_rate * total)
        return out

    def width(self, depth: int) -> float:
        """Expected block width beyond the root of a round drafted `depth` deep."""
        at_limit = self.width_at_limit[depth - 1]
        return at_limit if at_limit is not None else self.width_within[depth - 1]

    def expected_seconds(self, depth: int, batch: int) -> float:
        """Drafting, then the target pass: widened to 1 + width tokens per row when any row has a
        proposal, a plain step when none has (n-gram lookup often finds no match); and the
        engine's own share of a round."""
        return self.expected_seconds_by_depth(batch, [depth])[0]

    def expected_seconds_by_depth(self, batch: int, depths=None) -> list[float]:
        """expected_seconds(d, batch) for each d in depths (default 0..max depth), the parts that
        do not depend on d priced once."""
        depths = range(self.inner.max_depth() + 1) if depths is None else depths
        plain = self.verify_cost.predict(batch, 1) + self.overhead(batch, tree=False)
        if not any(depths):
            return [plain] * len(depths)
        widened = 1.0 - (1.0 - self.proposal_rate) ** batch  # chance that some row proposes
        drafting, tree_overhead = self.draft_cost(batch), self.overhead(batch, tree=True)
        return [plain if d == 0 else drafting.predict(d) + (1.0 - widened) * plain
                + widened * (self.verify_cost.predict(batch, 1 + self.width(d)) + tree_overhead) for d in depths]

    def overhead(self, batch: int, tree: bool) -> float:
        """The engine's share of a round that verifies a tree, or of a plain one (a tree round's
        is taken as a plain round's until one is measured)."""
        table = self.tree_overhead if tree and self.tree_overhead.seen else self.round_overhead
        return table.predict(batch)

    def catch_up_seconds(self, batch: int, unseen_tokens: int) -> float:
        """What the drafter's catch-up on unseen_tokens (summed over rows) is expected to cost: the
        fit of measured catch-ups, but at most what the target's own pass over those tokens would
        cost (a drafter reads a token more cheaply than the target does). Only a start measures a
        catch-up again, so without the bound one stall (0.5 s for a 200-token prompt, injected)
        kept EAGLE-3 from ever starting or probing again, while fixed EAGLE-3 ran 1.4-1.5x."""
        if unseen_tokens <= 0:
            return 0.0
        return min(self.catch_up_cost.predict(unseen_tokens), self._catch_up_bound(batch, unseen_tokens))

    def _catch_up_bound(self, batch: int, unseen_tokens: int) -> float:
        """The target's pass over unseen_tokens spread over the batch's rows, as priced now."""
        return self.verify_cost.predict(batch, 1 + unseen_tokens / batch) if self.verify_cost.seen else float("inf")

    def required_gain(self, batch: int) -> float:
        """How far a bet must beat plain decoding (before and after drafting alike): min_gain to
        start, new_batch_gain while this batch size's drafting cost is borrowed, and once
        speculating it goes on until it falls stop_margin behind."""
        s = self.settings
        penalty = self.gain_penalty.get(self.request_key, 0.0)
        if self.previous_depth > 0:
            return penalty - s.stop_margin
        return penalty + (s.min_gain if batch_bucket(batch) in self.draft_costs else s.new_batch_gain)

    def measuring(self, batch: int) -> bool:
        """The first rounds under new sampling settings (a new decoder's too), or a batch size with
        no drafting cost to borrow: bet the full depth as drafted, to measure it. Per sampling
        settings: after T=0 requests, EAGLE-3's T=1 requests started from the 0.5 prior, bet their
        first round and then stayed mostly plain (one trace of 18 requests: 1.13x / 1.01x / 1.00x
        by prompt category, the fixed drafter 1.31x / 1.21x / 0.91x)."""
        return not self.draft_cost(batch).seen or self.full_bets < self.settings.measure_rounds

    def probe_cost(self, batch: int, unseen_tokens: int, depth: int) -> float:
        """Expected seconds a probe `depth` deep adds to as many plain rounds: the drafter's
        catch-up once, and each round's drafting and wider pass less the plain steps its extra
        tokens save (probe_savings)."""
        plain = self.expected_seconds(0, batch)
        # A round's seconds less the plain steps its tokens save; the batch size's gain penalty
        # (what bets here have realized below their prediction) priced in as extra time.
        penalty = self.gain_penalty.get(self.request_key, 0.0)
        per_round = (self.expected_seconds(depth, batch) * (1.0 + penalty)
                     - (1.0 + self.probe_savings(batch, depth)) * plain)
        return self.catch_up_seconds(batch, unseen_tokens) + self.settings.probe_rounds * per_round

    def probe_savings(self, batch: int, depth: int) -> float:
        """Plain steps one probe round `depth` deep is expected to save. One row: its expected
        extra tokens. Rows in lockstep: one round sooner only for the tokens every row gains, so
        the sum over levels j of the product over rows of each row's chance to accept j or more.
        Credited with the rows' average, batch-16 n-gram probes passed for nearly free (a row with
        a match accepts a few tokens) and cost 62 ms against a 24 ms plain step, about twice a
        request, in requests that all ran their full 64 rounds."""
        if batch == 1 or len(self.rows) != batch:  # (estimates set by hand: the batch's own)
            return self.expected_tokens(depth) - 1.0
        rates = self.rows.proposal_rates(self.proposal_rate)
        reach = self.rows.reach(self.acceptance)
        return sum(math.prod(rate * row[j] for rate, row in zip(rates, reach)) for j in range(depth))

    def remaining_tokens(self) -> list[float]:
        """Per active row, the tokens it may still emit (token_budget, set by the engine); all
        alike when the budget is unknown (lockstep times then only compare rows' speeds)."""
        if not self.token_budget:
            return [1.0] * len(self.rows)
        budget = self.token_budget
        return [max(0.0, (budget[r] if isinstance(budget, list) else budget) - self.row_tokens[r])
                for r in self.row_ids]

    def depth_rates(self, batch: int, unseen_tokens: int = 0) -> list[float]:
        """Tokens per second of the rest of the request if every round from now on drafted d deep,
        d = 0..max depth (0 = plain decoding). Rows run in lockstep: row by row expected tokens
        (RowEstimates) set when each row is done (lockstep_seconds). With one row, or rows alike,
        that is E(d) / cost(d) for a round. At batch 8 on the 2-core CPU, rates from the batch's
        average had n-gram bets predict gains while requests ran at 0.91x of plain decoding: the
        rows without a match still took a round per token, each round a wider pass.
        Starting to speculate after plain rounds first pays for the drafter's catch-up on every
        token it has not seen (the whole prompt in a request's first draft); charged over the
        next catch_up_rounds rounds (or the rounds left, if fewer), so a thin lead does not buy a costly
        start, nor does a start near the request's end."""
        D = self.inner.max_depth()
        tokens, seconds = self.expected_tokens_by_depth(), self.expected_seconds_by_depth(batch)
        catch_up = self.catch_up_seconds(batch, unseen_tokens) if self.previous_depth == 0 else 0.0
        start = [0.0] * (D + 1)  # per round, by depth
        if catch_up:
            start[1:] = [catch_up / self.catch_up_spread(tokens[d]) for d in range(1, D + 1)]
        rates = [1.0 / max(seconds[0], 1e-9)] + [
            tokens[d] / max(seconds[d] + start[d], 1e-9) for d in range(1, D + 1)]
        self._lockstep_scale = None
        bar = rates[0] * (1 + self.required_gain(batch))
        if batch == 1 or len(self.rows) != batch or max(rates[1:], default=0.0) < bar:
            # One row; estimates set by hand; or a bet that loses even on the batch's average
            # (which rows in lockstep only lower, the tail of a ragged batch aside): done.
            return rates
        remaining = self.remaining_tokens()
        per_row, spread = self.row_token_moments()
        by_rows: dict[int, list[float]] = {}  # rows -> expected_seconds_by_depth(rows)

        def priced(rows: int) -> list[float]:
            if rows not in by_rows:
                by_rows[rows] = self.expected_seconds_by_depth(rows)
            return by_rows[rows]

        average, rates = rates, []
        for d in range(D + 1):
            price = priced_on_grid(lambda rows: priced(rows)[d] + start[d], batch)
            seconds_d = lockstep_seconds(remaining, [row[d] for row in per_row], price,
                                         spread and [row[d] for row in spread])
            rates.append(sum(remaining) / max(seconds_d, 1e-12))
        self._lockstep_scale = [(lock / rates[0]) / max(avg / average[0], 1e-12)
                                for lock, avg in zip(rates, average)]
        return rates

    def row_token_moments(self) -> tuple[list[list[float]], list[list[float]] | None]:
        """Per row, by depth, the mean and variance of a round's tokens (RowEstimates), for
        lockstep_seconds. The variance only when the token budget is known: the scatter of rows'
        finishing rounds grows with their tokens left, and without it rows are only compared by
        speed (remaining_tokens)."""
        means, variances = self.rows.token_moments_by_depth(self.acceptance, self.proposal_rate)
        return means, variances if self.token_budget else None

    def catch_up_spread(self, tokens_per_round: float) -> float:
        """How many rounds a start's catch-up is charged over: catch_up_rounds, or the rounds the
        request has left at tokens_per_round per row if fewer (its longest-running row's remaining
        tokens; token_budget unknown: catch_up_rounds). A start near a request's end has no
        rounds to pay its catch-up back: at batch 8, draft_model started 12 rounds before the end
        of a 64-token request, catching up on 2213 tokens (57 ms, three plain steps) for two bets."""
        rounds = float(self.settings.catch_up_rounds)
        if not self.token_budget:
            return rounds
        left = max(self.remaining_tokens(), default=0.0) / max(tokens_per_round, 1.0)
        return max(1.0, min(rounds, left))

    def stretch_rates(self, batch: int, unseen_tokens: int) -> list[float]:
        """depth_rates, priced afresh on a plain stretch's first round and every
        plain_reprice_every rounds after, reused in between (with their lockstep scale). A plain
        round verifies nothing, so the acceptance and proposal estimates behind the bets do not
        move; only the plain step's newest samples, the rows' remaining tokens and the unseen
        tokens do, a few rounds' worth. A new batch size (a row leaving) prices afresh; a round that
        drafts clears the prices (propose), so prices found here were made in this plain stretch."""
        round_no = len(self.depth_log)
        cached = self._stretch
        if cached is not None and cached[0] == batch and round_no - cached[1] < self.settings.plain_reprice_every:
            self._lockstep_scale = cached[3]
            return cached[2]
        rates = self.depth_rates(batch, unseen_tokens)
        # A request's first decision is priced with optimism: not for the rounds after it.
        fresh_stretch = self.previous_depth == 0 and not self.optimism
        self._stretch = (batch, round_no, rates, self._lockstep_scale) if fresh_stretch else None
        return rates

    def choose_depth(self, batch: int, unseen_tokens: int = 0, in_stretch: bool = False) -> int:
        """unseen_tokens: tokens (summed over rows) the drafter would first have to catch up on.
        in_stretch: a round of a request (propose), which may reuse a plain stretch's prices
        (stretch_rates); a direct call prices afresh."""
        D = self.inner.max_depth()
        if D == 0 or not self.verify_cost.seen:
            return 0  # first round: measure plain decoding
        if self.measuring(batch):
            return D  # nothing (or little) known about drafting and acceptance yet: measure the full bet
        s = self.settings
        rates = self.stretch_rates(batch, unseen_tokens) if in_stretch else self.depth_rates(batch, unseen_tokens)
        best = max(range(D + 1), key=lambda d: rates[d])
        if rates[best] < rates[0] * (1 + self.required_gain(batch)):
            best = 0
        doubtful = (rates[best] < rates[0] * (1 + s.recheck_margin)
                    or self.verify_cost.sample_count(batch, 1) < s.min_plain_samples
                    or self.verify_cost.age(batch, 1) >= s.forget_cost_after)
        if best and doubtful and self.rounds_since_plain >= s.probe_every:
            # A thin lead, or a plain step barely measured or measured long ago: measure the plain
            # alternative again. Measured during a slow stretch at batch 8, the plain step stayed
            # ~40% dear for nine requests: bets priced against it looked 1.45-1.95x ahead and ran
            # 0.89-1.08x, and their outcomes, judged against it too, never raised the bar.
            return 0
        if best:
            self.probe_interval = float(s.probe_every)  # speculation pays again: probe early next time
            self.probing, self.probe_left = False, 0
            return best
        if self.probe_left > 0:  # a probe runs probe_rounds rounds: one round is one noisy sample
            self.probe_left -= 1
            return self.probe_depth
        if self.probing:  # a probe that did not pay: wait longer before the next one
            self.probe_interval = min(float(s.max_probe_every), self.probe_interval * s.probe_backoff)
        self.probing = False
        if self.rounds_since_probe >= self.probe_interval:
            # Probe the bet that came closest, or shallower, as deep as the budget allows: a
            # one-level probe says nothing about the deeper levels an EAGLE bet lives on.
            budget = self.rounds_since_probe * self.verify_cost.predict(batch, 1) * s.probe_budget
            closest = max(range(1, D + 1), key=lambda d: rates[d])
            for depth in range(closest, 0, -1):
                if self.probe_cost(batch, unseen_tokens, depth) <= budget:
                    self.probing, self.probe_depth, self.probe_left = True, depth, s.probe_rounds - 1
                    return depth
        return 0

    def verify_depth(self, counts: list[list[int]], drafted_depth: int | None = None) -> int:
        """After drafting: how deep to verify the trees actually drafted (their depth_counts). The
        drafting is paid for; what is left to choose is the pass, and its width is now known, not
        estimated: one row with a long n-gram match widens the pass of a whole batch of rows
        without one, and an EAGLE tree drafted shallow is as wide as a deep one.
        A depth's worth is the seconds of the rest of the request its expected tokens save (rows
        in lockstep, later rounds drafting `drafted_depth` deep), per second of this pass: tokens
        that only a row far ahead of the others gains save little. With one row, or rows alike,
        that is expected tokens per second of the pass."""
        depth = max(map(deepest, counts), default=0)
        if depth == 0:
            return 0
        batch = len(counts)
        widths = [max(sum(row[: j + 1]) for row in counts) for j in range(depth)]  # widest row at depth <= j+1
        costs = [self.verify_cost.predict(batch, 1) + self.overhead(batch, tree=False)]
        overhead = self.overhead(batch, tree=True)
        costs += [self.verify_cost.predict(batch, 1 + widths[d]) + overhead for d in range(depth)]
        # Expected tokens per row, as the batch's average acceptance has them...
        gained = expected_gains(counts, [self.reach()] * batch, depth)
        best = self._best_rate([sum(g) for g in gained], costs, batch)
        if best and batch > 1 and len(self.rows) == batch:
            # ...and, where that says verify, by each row's own acceptance, as seconds saved
            # (which rows in lockstep only lower, the tail of a ragged batch aside).
            gained = expected_gains(counts, self.rows.reach(self.acceptance), depth)
            best = self._best_rate(self._lockstep_savings(gained, drafted_depth or depth), costs, batch)
        return best

    def _best_rate(self, worth: list[float], costs: list[float], batch: int) -> int:
        """The depth with the most worth per second, if it beats verifying nothing by the
        required gain; else 0."""
        rates = [w / max(c, 1e-12) for w, c in zip(worth, costs)]
        best, best_rate = 0, rates[0] * (1 + self.required_gain(batch))
        for d in range(1, len(rates)):
            if rates[d] > best_rate:
                best, best_rate = d, rates[d]
        return best

    def _lockstep_savings(self, gained: list[list[float]], later_depth: int) -> list[float]:
        """Per verified depth d, the seconds of the rest of the request that this round's expected
        tokens (gained[d][row]) save: rows in lockstep, later rounds drafting later_depth deep."""
        later = min(later_depth, self.inner.max_depth())
        means, variances = self.row_token_moments()
        per_round = [row[later] for row in means]
        spread = variances and [row[later] for row in variances]
        round_seconds = priced_on_grid(lambda rows: self.expected_seconds(later, rows), len(per_round))
        remaining = self.remaining_tokens()
        rest = lockstep_seconds(remaining, per_round, round_seconds, spread)
        return [rest - lockstep_seconds([max(0.0, left - g) for left, g in zip(remaining, row_gains)],
                                        per_round, round_seconds, spread) for row_gains in gained]

    # -- the Drafter lifecycle ----------------------------------------------------------------
    def propose(self, contexts):
        now = time.perf_counter()
        if self._round is not None:  # the last round, less what drafting and the pass took
            started, batch, verify_seconds, tree = self._round
            measured = max(0.0, now - started - self._last[1] - verify_seconds)
            (self.tree_overhead if tree else self.round_overhead).add(batch, measured)
            self.spent_seconds += measured - self._overhead_charged  # the request's outcome: as measured
        self._round, self._round_started, self._lockstep_scale = None, now, None
        unseen = sum(len(c) - seen for c, seen in zip(contexts, self.drafted_upto))
        if self.optimism and self.catch_up_seconds(len(contexts), unseen) > (
                self.settings.optimism_max_catch_up * self.verify_cost.predict(len(contexts), 1)):
            self.optimism = 0.0
        depth = self.choose_depth(len(contexts), unseen, in_stretch=True)
        self._belief = self._predict(depth, len(contexts), unseen)
        self.optimism = 0.0
        self.rounds_since_probe = 0 if depth else self.rounds_since_probe + 1
        if depth == 0:
            self.depth_log.append(0)
            self._last = (0, 0.0, None, 0.0, 0, None)
            return [self._empty] * len(contexts)
        self._stretch = None  # a bet or a probe ends the stretch: its outcome moves the estimates
        self.inner.depth_limit = depth
        # set by the engine each round (the end tokens grow when rows join with stops of their own)
        self.pass_round_settings(self.inner)
        t0 = time.perf_counter()
        trees = [t.truncated_to_depth(depth) for t in self.inner.propose(contexts)]
        seconds = time.perf_counter() - t0
        self.drafted_upto = [len(c) for c in contexts]
        counts = depth_counts(trees, depth)
        self._record_width(depth, counts)
        proposed = [t.size > 0 for t in trees]  # as drafted, before any cut below
        share = sum(proposed) / len(trees)
        verified = depth
        # Measuring rounds and probes run as chosen: a cut by today's estimates would keep them
        # from measuring what the estimates lack.
        if not self.probing and not self.measuring(len(contexts)) and cut_after_drafting_is_exact(trees):
            verified = self.verify_depth(counts, depth)
            if verified < depth:
                trees = [t.truncated_to_depth(verified) for t in trees]
        self.depth_log.append(verified)
        self._last = (depth, seconds, [min(deepest(row), verified) for row in counts], share, unseen, proposed)
        return trees

    def _predict(self, depth: int, batch: int, unseen: int) -> RoundPrediction:
        """What the model expects of this round."""
        plain = self.expected_seconds(0, batch)
        if depth == 0:
            return RoundPrediction(plain, plain, 1.0, 1.0, False)
        seconds = self.expected_seconds(depth, batch)
        if self.previous_depth == 0:
            seconds += self.catch_up_seconds(batch, unseen)
        scale = self._lockstep_scale[depth] if self._lockstep_scale is not None else 1.0
        return RoundPrediction(seconds, plain, self.expected_tokens(depth), scale,
                               not self.probing and not self.measuring(batch))

    def _learn_from_outcome(self) -> None:
        """After a request that bet and still ran slower than plain decoding (its measured
        seconds against plain steps for the same tokens, rows in lockstep): move its batch size's
        gain penalty toward how far it fell short of what its rounds' predicted costs gave their
        tokens (as emitted at batch 1, as expected with rows in lockstep). Other requests let it
        fade (halved by one that beat plain decoding, a quarter off by one without bets). The
        per-round model misses what only shows over a request: a batch runs until its slowest row
        (a few rows alone in the last rounds), and catch-ups land in requests that are short. At
        batch 8 on the 2-core CPU, EAGLE-3 bets predicted 1.08x and the requests ran 0.92x.
        With one row, acceptance below the estimates is left out (tokens are counted as emitted):
        it belongs to the prompt, and the estimates already follow it round by round. Counted in,
        one prompt on which EAGLE-3 accepted 1.8 tokens a round (predicted 1.12x, ran 0.78x) kept
        the next two requests plain at batch 1 (0.92x, 0.99x) where fixed EAGLE-3 ran 1.29x, 1.62x.
        Rows in lockstep count tokens as expected: as emitted, the rounds a slow row runs alone
        passed for gains, and n-gram bets ran at 0.94x (batch 8) and 0.93x (16) of plain decoding."""
        s = self.settings
        if self.bet_rounds < s.outcome_min_bets or self.spent_seconds <= 0:
            if self.request_key in self.gain_penalty:
                self.gain_penalty[self.request_key] *= 1.0 - s.outcome_fade
            return
        plain = lockstep_plain_seconds(self.row_tokens, lambda rows: self.expected_seconds(0, rows))
        realized = plain / self.spent_seconds
        predicted = self.predicted_plain_seconds / max(self.predicted_seconds, 1e-12)
        # Only a request that ran slower than plain decoding teaches a shortfall: the penalty
        # guards the floor. A request that still beat plain decoding only lets it fade.
        shortfall = predicted - realized if realized < 1.0 else 0.0
        old = self.gain_penalty.get(self.request_key, 0.0)
        self.gain_penalty[self.request_key] = max(
            0.0, (1 - s.outcome_weight) * old + s.outcome_weight * shortfall)

    def _record_width(self, depth: int, counts: list[list[int]]) -> None:
        """Block widths as drafted: at this limit, and within it for every shallower depth."""
        if not any(map(any, counts)):
            return
        decay = self.settings.decay
        within = [max(sum(row[: d + 1]) for row in counts) for d in range(depth)]
        for d in range(depth):
            self.width_within[d] = decay * self.width_within[d] + (1 - decay) * within[d]
        seen = self.width_at_limit[depth - 1]
        self.width_at_limit[depth - 1] = within[-1] if seen is None else decay * seen + (1 - decay) * within[-1]

    def observe(self, feedback):
        self.inner.observe(feedback)
        depth, draft_seconds, reached_depths, share, unseen, proposed = self._last
        batch = len(feedback.emitted)
        self._count_outcome(feedback, draft_seconds, batch)
        self.verify_cost.add(batch, feedback.block_tokens, feedback.verify_seconds)
        self._round = (self._round_started, batch, feedback.verify_seconds, feedback.block_tokens > 1)
        self.rounds_since_plain = 0 if feedback.block_tokens == 1 else self.rounds_since_plain + 1
        previous, self.previous_depth = self.previous_depth, depth
        if depth == 0:
            return
        self.full_bets += max(reached_depths) == self.inner.max_depth()
        # After a plain round a drafter first catches up on what it has not seen (the whole prompt
        # in the first speculative round, every token of a plain stretch before a probe): a
        # one-time cost, not what the next round's drafting will cost. Fit steady rounds only.
        if previous > 0:
            self.record_draft_cost(batch, depth, draft_seconds)
        elif self.draft_cost(batch).seen:  # what catching up cost beyond a steady round's drafting,
            # within the same bound as its predictions (a stall would otherwise weigh on later fits)
            extra = max(0.0, draft_seconds - self.draft_cost(batch).predict(depth))
            self.catch_up_cost.add(unseen, min(extra, self._catch_up_bound(batch, unseen)))
        decay = self.settings.decay
        self.proposal_rate = decay * self.proposal_rate + (1 - decay) * share
        self._update_acceptance(reached_depths, feedback)
        self.rows.update(reached_depths, [len(path) for path in feedback.accepted_nodes], proposed)

    def _count_outcome(self, feedback, draft_seconds: float, batch: int) -> None:
        for i, tokens in enumerate(feedback.emitted):
            self.row_tokens[self.row_ids[i]] += len(tokens)
        # The engine's share of this round is measured when the next round starts; until then
        # (and for a request's last round) it is charged as predicted.
        self._overhead_charged = self.overhead(batch, tree=feedback.block_tokens > 1)
        self.spent_seconds += draft_seconds + feedback.verify_seconds + self._overhead_charged
        # One row: its tokens as emitted, not as expected; acceptance below its estimate is this
        # prompt's (the estimates follow it round by round) and must not make the next request
        # pay. Rows in lockstep: as expected, or the ragged tail (the rows left alone after the
        # rest are done, each of its rounds worth a token) would pass for gains.
        # See _learn_from_outcome.
        belief = self._belief
        tokens = sum(map(len, feedback.emitted)) / max(1, batch) if len(self.row_tokens) == 1 else belief.tokens
        self.predicted_seconds += belief.seconds
        self.predicted_plain_seconds += tokens * belief.plain_step * belief.lockstep_scale
        self.bet_rounds += belief.bet

    def _update_acceptance(self, tree_depths: list[int], feedback) -> None:
        """Depth d+1 was on offer to a row whose tree (as verified) reaches it and whose path
        reached depth d.
        Every depth's counts decay each speculative round, offered or not: a depth measured low
        once and never offered again (bets stayed shallower) drifts back toward the level above
        instead of keeping the bets shallow for good."""
        decay = self.settings.decay
        accepted = [len(path) for path in feedback.accepted_nodes]
        for d in range(len(self.accepted_count)):
            offered = sum(1 for n, a in zip(tree_depths, accepted) if n > d and a >= d)
            reached = sum(1 for n, a in zip(tree_depths, accepted) if n > d and a > d)
            self.accepted_count[d] = decay * self.accepted_count[d] + reached
            self.offered_count[d] = decay * self.offered_count[d] + offered
