"""Cost models for adaptive speculation (drafters/adaptive.py): what a drafting call and a target
pass cost on this machine, learnt online from the rounds that ran."""
from __future__ import annotations

import math
from collections import deque
from functools import lru_cache
from statistics import NormalDist
from typing import Callable


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
    """Seconds by a size (a pass's width or token count; a round's batch size), measured size by
    size.

    On a CPU a pass's cost is far from a line in its size, and not even monotone: on the 2-core machine
    at batch 1 (256-token context) passes over 1, 2, 3, 5, 8, 16 tokens took 11.5, 17.0, 20.7,
    14.2, 14.6, 17.3 ms (kernel choices). So each size seen keeps its own estimate, taken as
    measured; an unseen size is interpolated between its measured neighbours, or extrapolated past
    the largest along the average slope from the smallest (the slope between the last two
    measured sizes is mostly noise).

    Timing noise is one-sided (a machine stalls; it never runs faster than its kernels), and a
    stall lasts seconds: an 8-token pass measured only during one read 45 ms instead of 15, priced
    itself out of every later decision, was never measured again, and its bets stayed off for the
    rest of the run. So a size's estimate is the lower quartile of its last `window` samples (two
    clean samples undo a short stall), and a size not measured in the last `forget_after` samples
    is doubted: priced at most like the nearest smaller size still in use, so that a bet on it is
    tried again (and measured afresh: a size's samples older than `forget_after` are dropped when
    a new one comes, doubted or not). A size that really costs more goes back to its price after
    one round. Not deleted and re-extrapolated: on this CPU passes of 2-3 tokens cost more than
    9-17, so a line from the small widths in use priced a forgotten 10-token EAGLE pass at 80 ms
    instead of 15. Nothing is doubted while fewer than two sizes are in use (a run of plain rounds
    would price every wider pass like a plain one).

    A size whose new sample confirms its old price (at least `confirm_share` of it: no stall to
    undo) waits twice as long before it is doubted again, up to `max_forget_after`; one that comes
    back cheaper starts over at `forget_after`. At batch 16 wide passes are measured about once a
    request: doubted after every 64 rounds, they were priced like a 2-wide pass (about a plain
    step) again in every request. Traced over 12 ngram-adaptive requests there, bets drafted 98
    times and verified 15 passes at 65 ms against a 24 ms plain step, and every request still ran
    its full 64 rounds; with the doubts backing off, 44 and 7."""

    def __init__(self, window: int = 8, forget_after: int = 64, max_forget_after: int = 1024,
                 confirm_share: float = 0.8):
        self.window = window
        self.forget_after, self.max_forget_after, self.confirm_share = forget_after, max_forget_after, confirm_share
        self.recent: dict[int, deque[float]] = {}  # size -> its last `window` samples
        self.last_added: dict[int, int] = {}  # size -> sample number of its latest sample
        self.patience: dict[int, int] = {}  # size -> samples of other sizes before it is doubted
        self.samples = 0
        self._curve: tuple[list[int], list[float]] | None = None  # sizes and costs, rebuilt after add()

    def _stale(self, size: int) -> bool:
        return self.age(size) >= self.patience.get(size, self.forget_after)

    def _doubted(self) -> set[int]:
        stale = {k for k in self.last_added if self._stale(k)}
        return stale if len(self.recent) - len(stale) >= 2 else set()

    def add(self, x: float, y: float) -> None:
        size = int(x)
        if size in self.recent and self._stale(size):
            old_price = self._price(size)
            del self.recent[size]  # its samples are old news, doubted or not
            patience = self.patience.get(size, self.forget_after)
            self.patience[size] = (min(self.max_forget_after, 2 * patience) if y >= self.confirm_share * old_price
                                   else self.forget_after)
        self.recent.setdefault(size, deque(maxlen=self.window)).append(y)
        self.samples += 1
        self.last_added[size] = self.samples
        self._curve = None

    @property
    def seen(self) -> bool:
        return bool(self.recent)

    def _sizes_and_costs(self) -> tuple[list[int], list[float]]:
        """Measured sizes, ascending, with their costs (doubted ones capped). Computed once per
        round: choose_depth prices every depth with it."""
        if self._curve is None:
            sizes = sorted(self.recent)
            costs = [self._price(k) for k in sizes]
            doubted, in_use = self._doubted(), None
            for i, k in enumerate(sizes):
                if k not in doubted:
                    in_use = costs[i]
                elif in_use is not None:
                    costs[i] = min(costs[i], in_use)
            self._curve = sizes, costs
        return self._curve

    def _price(self, size: int) -> float:
        """A measured size's estimate: the lower quartile of its recent samples."""
        samples = sorted(self.recent[size])
        return samples[(len(samples) - 1) // 4]

    def predict(self, x: float) -> float:
        if not self.recent:
            return 0.0
        sizes, means = self._sizes_and_costs()
        if x <= sizes[0]:
            return means[0]
        for (x0, y0), (x1, y1) in zip(zip(sizes, means), zip(sizes[1:], means[1:])):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        if len(sizes) == 1:
            return means[0]
        slope = max(0.0, (means[-1] - means[0]) / (sizes[-1] - sizes[0]))
        return means[-1] + slope * (x - sizes[-1])

    def sizes(self) -> list[int]:
        """Measured sizes, ascending."""
        return self._sizes_and_costs()[0]

    def sample_count(self, size: int) -> int:
        """How many recent samples this size's estimate rests on."""
        return len(self.recent.get(int(size), ()))

    def age(self, size: int) -> float:
        """Samples of any size added since this size's latest one (inf if never measured)."""
        n = self.last_added.get(int(size))
        return float("inf") if n is None else self.samples - n


class PassCost:
    """Seconds of a target pass by its shape: batch rows x block width (the root plus the widest
    row's tree; narrower rows are padded to it).

    Rows are not tokens: on the 2-core CPU a one-token step over 16 rows costs about 23 ms and one
    row with 16 tokens about 15 ms (every row attends over its own cache), so a table keyed by
    rows x width alone mispriced one shape by the other. Each batch size keeps a CostTable over
    widths; a width past the widest it has measured is scaled from that one along the shape of
    all passes by token count, and a batch size never seen (rows finish and the batch shrinks)
    is priced by token count alone until it has rounds of its own."""

    def __init__(self, window: int = 8, forget_after: int = 64):
        self.window, self.forget_after = window, forget_after
        self.by_batch: dict[int, CostTable] = {}
        self.by_tokens = CostTable(window, forget_after)

    def add(self, batch: int, width: int, seconds: float) -> None:
        self.by_batch.setdefault(batch, CostTable(self.window, self.forget_after)).add(width, seconds)
        self.by_tokens.add(batch * width, seconds)

    @property
    def seen(self) -> bool:
        return self.by_tokens.seen

    def sample_count(self, batch: int, width: int) -> int:
        table = self.by_batch.get(batch)
        return table.sample_count(width) if table else 0

    def age(self, batch: int, width: int) -> float:
        """Rounds at this batch size since a pass of this width was last measured there."""
        table = self.by_batch.get(batch)
        return table.age(width) if table else float("inf")

    def predict(self, batch: int, width: float) -> float:
        table = self.by_batch.get(batch)
        if table is None:
            return self.by_tokens.predict(batch * width)
        widest = table.sizes()[-1]
        if width <= widest:
            return table.predict(width)
        at_widest = self.by_tokens.predict(batch * widest)
        growth = self.by_tokens.predict(batch * width) / at_widest if at_widest > 0 else 1.0
        return table.predict(widest) * max(1.0, growth)


def priced_on_grid(price: Callable[[int], float], top: int) -> Callable[[int], float]:
    """price(rows) for rows 1..top, called at 1, 2, 4, ... and top only and linear in between:
    lockstep_seconds prices a round at every row count a batch shrinks through, and calling the
    cost model for each of them at every depth (16 x 7 calls at batch 16) cost 1.2 ms a round."""
    points = sorted({1 << k for k in range(top.bit_length())} | {top})
    values = [price(rows) for rows in points]
    table = [values[0]] * (top + 1)
    for (lo, a), (hi, b) in zip(zip(points, values), zip(points[1:], values[1:])):
        for rows in range(lo, hi + 1):
            table[rows] = a + (b - a) * (rows - lo) / (hi - lo)
    return table.__getitem__


@lru_cache(maxsize=None)
def expected_largest_normal(n: int) -> float:
    """Expected largest of n independent standard normal draws (0 for one; 1.77 for 16), by
    numerical integration of x * n * pdf(x) * cdf(x)^(n-1)."""
    if n <= 1:
        return 0.0
    normal, step = NormalDist(), 0.005
    return sum(x * n * normal.pdf(x) * normal.cdf(x) ** (n - 1) * step
               for x in (i * step for i in range(-2000, 2001)))


def lockstep_seconds(remaining: list[float], per_round: list[float], round_seconds: Callable[[int], float],
                     variance: list[float] | None = None) -> float:
    """Seconds until every row has its remaining tokens, rows in lockstep: row i needs
    remaining[i] / per_round[i] rounds (expected tokens per round), and a round with b rows still
    running costs round_seconds(b). The batch shrinks as rows finish, so the slowest row sets the
    number of rounds and the others only make its last rounds cheaper.

    variance: per row, the variance of its tokens per round. Rows whose tokens vary from round to
    round finish at scattered rounds, and the batch waits for the unluckiest: t tokens at mean m
    and variance v per round take t/m rounds with a standard deviation of sqrt(t*v/m^3), and the
    last of b rows is taken to finish expected_largest_normal(b) deviations late. An n-gram row
    gains nothing in most rounds and six tokens in a few: at batch 16, expected tokens alone
    predicted 1.1-1.5x for bets whose requests all ran their full 64 rounds."""
    rows = [(r, max(e, 1e-9), v) for r, e, v in zip(remaining, per_round, variance or [0.0] * len(remaining))
            if r > 0]
    rounds = sorted(r / e for r, e, _ in rows)
    if variance and len(rows) > 1:
        z = expected_largest_normal(len(rows))
        rounds[-1] = max(r / e + z * math.sqrt(r * v / e ** 3) for r, e, v in rows)
    total, previous = 0.0, 0.0
    for i, n in enumerate(rounds):
        total += (n - previous) * round_seconds(len(rounds) - i)
        previous = n
    return total


def lockstep_plain_seconds(tokens_per_row: list[int], step_seconds: Callable[[int], float]) -> float:
    """Seconds plain decoding would take to emit these tokens: one step per token with every row
    in lockstep, the batch shrinking as rows finish; step_seconds(rows) prices one step. (A
    speculative batch is ragged: its last rounds run a few rows that plain decoding finished with
    the rest.)"""
    return lockstep_seconds(tokens_per_row, [1.0] * len(tokens_per_row), step_seconds)
