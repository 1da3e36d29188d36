"""Adaptive speculation: each round, draft only as deep as pays, possibly not at all.

Speculation is a bet. A round that verifies d drafted levels emits E(d) tokens per row on average,

    E(d) = 1 + a1 + a1*a2 + ... + a1*...*ad      (aj = acceptance at depth j, given depth j-1)

and costs draft(d) + verify(B * (1 + n(d))) seconds, where n(d) is the number of tree nodes at depth
<= d and B the batch size. The wrapper keeps online estimates of every term (verification cost
per pass size as measured, CostTable; drafting cost as a line in depth, OnlineLinearFit) and
picks the d that maximises E(d) / cost(d); d = 0 is plain decoding.

Costs belong to the machine, not the request: they are kept across requests on the same Decoder
(drafting cost per batch-size bucket). Acceptance belongs to the drafter, the target and the
sampling settings: a request with the same settings starts from the previous one's estimates,
worth `carry_rounds` rounds, so it adapts to its own text within a few rounds. Only the very first
request measures from nothing: round 1 plain decoding, rounds 2 and 3 the full bet (round 2's
drafting includes the drafter's first look at the prompt, so the cost fit only takes rounds that
follow a speculative round). While d = 0 wins it still probes now and then, so a
drafter that starts to match (a copy-heavy stretch for n-gram lookup) is noticed; a probe drafts
one level only (the cheapest look at acceptance; deeper levels follow if depth 1 pays), and each
probe that changes nothing doubles the wait before the next: a drafter that never pays costs a
handful of one-level rounds per request, not one in every `probe_every`. Enabled with
`adaptive: true` in any drafter's config.

The wrapper never changes what is emitted, only how deep the proposals are: exactness is the
verifier's, untouched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .base import Drafter, DraftTree


class OnlineLinearFit:
    """y ~ a + b*x by exponentially weighted least squares (recent rounds count most).
    While only one x has been seen the line is flat (a fixed cost dominates: verification), or,
    with proportional=True, through the origin (a cost that grows with x from nothing: drafting
    d levels costs about d times one level, so depth 1 is not priced like the depth measured)."""

    def __init__(self, decay: float = 0.9, proportional: bool = False):
        self.decay = decay
        self.proportional = proportional
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    @property
    def seen(self) -> bool:
        return self.sw > 0

    def predict(self, x: float) -> float:
        if not self.seen:
            return 0.0
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x ** 2
        if var <= 1e-12 * max(1.0, mean_x ** 2):  # one size seen so far
            return mean_y * x / mean_x if self.proportional and mean_x > 0 else mean_y
        slope = max(0.0, (self.sxy / self.sw - mean_x * mean_y) / var)  # costs never fall with size
        return max(0.0, mean_y + slope * (x - mean_x))


class CostTable:
    """Seconds of a target pass by its size (batch x block tokens), measured size by size.

    On a CPU the cost is far from a line in the size: at batch 1 a pass over 2-4 tokens cost
    1.4-1.7x a plain step and one over 5 only 1.2x (kernel choices), so a line through the sizes
    seen last would misprice the others. Each size seen keeps a decayed mean; an unseen size is
    interpolated between its measured neighbours, or extrapolated past the largest along the last
    two (never below a measured smaller size: costs do not fall with size)."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.sums: dict[int, list[float]] = {}  # size -> [decayed sum of seconds, decayed count]
        self._curve: tuple[list[int], list[float]] | None = None  # sizes and costs, rebuilt after add()

    def add(self, x: float, y: float) -> None:
        entry = self.sums.setdefault(int(x), [0.0, 0.0])
        entry[0] = self.decay * entry[0] + y
        entry[1] = self.decay * entry[1] + 1
        self._curve = None

    @property
    def seen(self) -> bool:
        return bool(self.sums)

    def _sizes_and_costs(self) -> tuple[list[int], list[float]]:
        """Measured sizes, ascending, with their mean costs made non-decreasing. Computed once per
        round: choose_depth prices every depth with it."""
        if self._curve is None:
            sizes = sorted(self.sums)
            means = [self.sums[k][0] / self.sums[k][1] for k in sizes]
            for i in range(1, len(means)):  # running maximum: a bigger pass never costs less
                means[i] = max(means[i], means[i - 1])
            self._curve = sizes, means
        return self._curve

    def predict(self, x: float) -> float:
        if not self.sums:
            return 0.0
        sizes, means = self._sizes_and_costs()
        if x <= sizes[0]:
            return means[0]
        for (x0, y0), (x1, y1) in zip(zip(sizes, means), zip(sizes[1:], means[1:])):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        if len(sizes) == 1:
            return means[0]
        slope = (means[-1] - means[-2]) / (sizes[-1] - sizes[-2])
        return means[-1] + slope * (x - sizes[-1])


@dataclass
class AdaptiveSettings:
    probe_every: int = 16  # rounds of plain decoding before the first probe...
    probe_backoff: float = 2.0  # ...times this after every probe that did not pay...
    max_probe_every: int = 256  # ...up to this many rounds
    probe_depth: int = 1  # levels a probe drafts
    prior_acceptance: float = 0.5  # per-depth acceptance before anything is measured...
    prior_weight: float = 1.0  # ...worth this many observed rounds
    decay: float = 0.95  # weight of past rounds in every running estimate
    min_gain: float = 0.03  # speculate only if the bet beats plain decoding by this fraction:
    # timings are noisy, and a near-tie is better left to the plain path (no draft state to keep)
    carry_rounds: float = 8.0  # a request with the same sampling settings starts from the previous
    # request's acceptance estimates, worth at most this many rounds


def batch_bucket(batch: int) -> int:
    """Drafting cost grows with the batch, slowly: one fit per power of two."""
    return 1 << max(0, batch.bit_length() - 1)


class AdaptiveDrafter(Drafter):
    """Wraps any drafter; forwards its lifecycle and chooses each round's depth."""

    def __init__(self, inner: Drafter, settings: AdaptiveSettings | None = None):
        self.inner = inner
        self.name = f"adaptive({inner.name})"
        self.needs = inner.needs
        self.settings = settings or AdaptiveSettings()
        self.depth_log: list[int] = []  # depth chosen each round (for reports and tests)
        # Kept across requests (the machine's costs): seconds vs batch * block tokens, and per
        # batch bucket seconds vs depth requested (> 0).
        self.verify_cost = CostTable(self.settings.decay)
        self.draft_costs: dict[int, OnlineLinearFit] = {}
        self._carried = None  # (sampling, acceptance state) of the last request

    def max_depth(self) -> int:
        return self.inner.max_depth()

    def extra_parameters(self) -> int:
        return self.inner.extra_parameters()

    def begin(self, prompts, sampling, generator):
        if self.sampling is not None:  # a previous request on this decoder
            self._carried = (self.sampling, self._acceptance_state())
        super().begin(prompts, sampling, generator)
        self.inner.begin(prompts, sampling, generator)
        s = self.settings
        D = max(1, self.inner.max_depth())
        self.accepted_count = [0.0] * D  # decayed counts of row-rounds that accepted depth d+1...
        self.offered_count = [0.0] * D  # ...out of those that reached depth d with d+1 on offer
        self.nodes_upto = [float(d + 1) for d in range(D)]  # chain until trees are seen
        self.proposal_rate = 1.0  # decayed share of rows with a non-empty tree in speculative rounds
        if self._carried is not None and self._carried[0] == sampling:
            self._resume(self._carried[1])
        self.rounds_since_probe = 0
        self.previous_depth = 0
        self.probe_interval = float(s.probe_every)
        self.probing = False  # the last round was a probe
        self.depth_log = []
        self._last = None

    def _acceptance_state(self) -> tuple:
        return (list(self.accepted_count), list(self.offered_count), list(self.nodes_upto), self.proposal_rate)

    def _resume(self, state: tuple) -> None:
        """Start from the last request's acceptance, scaled down to carry_rounds rounds' worth."""
        accepted, offered, nodes, rate = state
        scale = min(1.0, self.settings.carry_rounds / max(max(offered, default=0.0), 1e-9))
        self.accepted_count = [a * scale for a in accepted]
        self.offered_count = [o * scale for o in offered]
        self.nodes_upto, self.proposal_rate = list(nodes), rate

    def draft_cost(self, batch: int) -> OnlineLinearFit:
        """The drafting-cost fit for this batch size: its own bucket's once measured, else the
        nearest measured bucket's (the bucket's own rounds take over as soon as it has some)."""
        bucket = batch_bucket(batch)
        measured = [b for b, fit in self.draft_costs.items() if fit.seen]
        if not measured:
            return OnlineLinearFit(self.settings.decay, proportional=True)  # nothing measured yet
        return self.draft_costs[min(measured, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))]

    def record_draft_cost(self, batch: int, depth: int, seconds: float) -> None:
        self.draft_costs.setdefault(batch_bucket(batch), OnlineLinearFit(self.settings.decay, proportional=True)).add(
            depth, seconds)

    def observe_prefill(self, target_hidden):
        self.inner.observe_prefill(target_hidden)

    def keep_rows(self, indices):
        self.inner.keep_rows(indices)

    def report(self) -> dict:
        return {"depths": self.depth_log, "acceptance_estimate": [round(a, 3) for a in self.acceptance],
                "inner": self.inner.report()}

    # -- the bet ----------------------------------------------------------------------------
    @property
    def acceptance(self) -> list[float]:
        s = self.settings
        return [(a + s.prior_acceptance * s.prior_weight) / (o + s.prior_weight)
                for a, o in zip(self.accepted_count, self.offered_count)]

    def expected_tokens(self, depth: int) -> float:
        """Per row: 1 + r * (a1 + a1*a2 + ...), r = the share of rows that get a proposal at all
        (n-gram lookup often has none; acceptance is measured on the rows that had one)."""
        total, reach = 0.0, 1.0
        for a in self.acceptance[:depth]:
            reach *= a
            total += reach
        return 1.0 + self.proposal_rate * total

    def expected_seconds(self, depth: int, batch: int) -> float:
        """Drafting, then the target pass: widened to 1 + nodes tokens per row when any row has a
        proposal, a plain step when none has (n-gram lookup often finds no match)."""
        if depth == 0:
            return self.verify_cost.predict(batch)
        nodes = self.nodes_upto[depth - 1]
        widened = 1.0 - (1.0 - self.proposal_rate) ** batch  # chance that some row proposes
        return (self.draft_cost(batch).predict(depth) + widened * self.verify_cost.predict(batch * (1 + nodes))
                + (1.0 - widened) * self.verify_cost.predict(batch))

    def choose_depth(self, batch: int) -> int:
        D = self.inner.max_depth()
        if D == 0 or not self.verify_cost.seen:
            return 0  # first round: measure plain decoding
        if not self.draft_cost(batch).seen:
            return D  # nothing known about drafting yet: measure the full bet
        s = self.settings
        rates = [self.expected_tokens(d) / max(self.expected_seconds(d, batch), 1e-9) for d in range(D + 1)]
        best = max(range(D + 1), key=lambda d: rates[d])
        if rates[best] < rates[0] * (1 + s.min_gain):
            best = 0
        if best:
            self.probe_interval = float(s.probe_every)  # speculation pays again: probe early next time
        elif self.probing:  # a probe that did not pay: wait longer before the next one
            self.probe_interval = min(float(s.max_probe_every), self.probe_interval * s.probe_backoff)
        self.probing = best == 0 and self.rounds_since_probe >= self.probe_interval
        if self.probing:
            return min(D, s.probe_depth)
        return best

    # -- the Drafter lifecycle ----------------------------------------------------------------
    def propose(self, contexts):
        depth = self.choose_depth(len(contexts))
        self.depth_log.append(depth)
        self.rounds_since_probe = 0 if depth else self.rounds_since_probe + 1
        if depth == 0:
            self._last = (0, 0.0, None)
            return [DraftTree.empty() for _ in contexts]
        self.inner.depth_limit = depth
        t0 = time.perf_counter()
        trees = [t.truncated_to_depth(depth) for t in self.inner.propose(contexts)]
        self._last = (depth, time.perf_counter() - t0, trees)
        return trees

    def observe(self, feedback):
        self.inner.observe(feedback)
        depth, draft_seconds, trees = self._last
        batch = len(feedback.emitted)
        self.verify_cost.add(batch * feedback.block_tokens, feedback.verify_seconds)
        previous, self.previous_depth = self.previous_depth, depth
        if depth == 0:
            return
        # After a plain round a drafter first catches up on what it has not seen (the whole prompt
        # in the first speculative round, every token of a plain stretch before a probe): a
        # one-time cost, not what the next round's drafting will cost. Fit steady rounds only.
        if previous > 0:
            self.record_draft_cost(batch, depth, draft_seconds)
        self._update_acceptance(trees, feedback)

    def _update_acceptance(self, trees: list[DraftTree], feedback) -> None:
        decay = self.settings.decay
        if trees:
            share = sum(t.size > 0 for t in trees) / len(trees)
            self.proposal_rate = decay * self.proposal_rate + (1 - decay) * share
        for d in range(len(self.accepted_count)):
            reached = offered = 0
            for tree, path in zip(trees, feedback.accepted_nodes):
                if len(path) >= d and any(x == d + 1 for x in tree.depths()):  # depth d+1 was on offer
                    offered += 1
                    reached += len(path) > d
            if offered:
                self.accepted_count[d] = decay * self.accepted_count[d] + reached
                self.offered_count[d] = decay * self.offered_count[d] + offered
            counts = [sum(1 for x in t.depths() if x <= d + 1) for t in trees if t.size]
            if counts:
                self.nodes_upto[d] = decay * self.nodes_upto[d] + (1 - decay) * sum(counts) / len(counts)
