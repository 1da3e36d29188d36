"""Per-row acceptance for adaptive speculation (drafters/adaptive.py).

A batch runs in lockstep until its slowest row is done: the rows of one request differ (one prompt
is copy-heavy and n-gram lookup matches it every round, another never), and the row that gains
least from a bet sets how many rounds the request takes. So besides the batch-wide estimates,
each row keeps its own decayed counts, weighed against `prior_rounds` rounds of the batch's."""
from __future__ import annotations


class RowEstimates:
    def __init__(self, rows: int, depth: int, decay: float, prior_rounds: float):
        self.decay, self.prior_rounds, self.depth = decay, prior_rounds, depth
        self.accepted = [[0.0] * depth for _ in range(rows)]  # per row, as AdaptiveDrafter.accepted_count
        self.offered = [[0.0] * depth for _ in range(rows)]
        self.proposed = [0.0] * rows  # decayed speculative rounds in which the row had a proposal...
        self.rounds = [0.0] * rows  # ...out of these

    def __len__(self) -> int:
        return len(self.rounds)

    def keep(self, indices: list[int]) -> None:
        for name in ("accepted", "offered", "proposed", "rounds"):
            setattr(self, name, [getattr(self, name)[i] for i in indices])

    def add(self, count: int) -> None:
        """Rows that join, with no rounds of their own yet (the batch's estimates stand for them)."""
        self.accepted += [[0.0] * self.depth for _ in range(count)]
        self.offered += [[0.0] * self.depth for _ in range(count)]
        self.proposed += [0.0] * count
        self.rounds += [0.0] * count

    def update(self, tree_depths: list[int], accepted: list[int], proposed: list[bool]) -> None:
        """One speculative round: per row, the depth its verified tree reached, the length of its
        accepted path, and whether it had a proposal at all (as drafted)."""
        d = self.decay
        for i, (n, a, p) in enumerate(zip(tree_depths, accepted, proposed)):
            self.proposed[i] = d * self.proposed[i] + p
            self.rounds[i] = d * self.rounds[i] + 1
            for j in range(len(self.accepted[i])):
                self.offered[i][j] = d * self.offered[i][j] + (n > j and a >= j)
                self.accepted[i][j] = d * self.accepted[i][j] + (n > j and a > j)

    def reach(self, acceptance: list[float]) -> list[list[float]]:
        """Per row, the chance its draft at depth j+1 is accepted (all above it were), from its own
        counts shrunk toward the batch's `acceptance` by depth."""
        k, out = self.prior_rounds, []
        for acc, off in zip(self.accepted, self.offered):
            r, row = 1.0, []
            for a, o, batch_a in zip(acc, off, acceptance):
                r *= (a + k * batch_a) / (o + k)
                row.append(r)
            out.append(row)
        return out

    def proposal_rates(self, batch_rate: float) -> list[float]:
        k = self.prior_rounds
        return [(p + k * batch_rate) / (n + k) for p, n in zip(self.proposed, self.rounds)]

    def token_moments_by_depth(self, acceptance: list[float], batch_rate: float
                               ) -> tuple[list[list[float]], list[list[float]]]:
        """Per row, the mean and the variance of a round's tokens drafted d deep, d = 0..max depth,
        with the row's own proposal rate and reach. A row accepts at least j drafted tokens with
        chance rate * r_j, so the mean is 1 + rate * (r_1 + ... + r_d), and E[A^2] = sum over j of
        (2j - 1) * rate * r_j for its accepted tokens A."""
        means, variances = [], []
        for rate, reach in zip(self.proposal_rates(batch_rate), self.reach(acceptance)):
            first = second = 0.0
            mean, var = [1.0], [0.0]
            for j, r in enumerate(reach, start=1):
                first += rate * r
                second += (2 * j - 1) * rate * r
                mean.append(1.0 + first)
                var.append(max(0.0, second - first * first))
            means.append(mean)
            variances.append(var)
        return means, variances
