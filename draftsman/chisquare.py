"""Two-sample chi-square test on categorical samples, with rare categories pooled so the
chi-square approximation holds. Used by `draftsman audit` (no scipy needed at run time; the tests
check it against scipy.stats.chi2_contingency)."""
from __future__ import annotations

import zlib
from collections import Counter

import torch

MIN_EXPECTED = 5.0  # cells expected below this are pooled (the usual validity rule)


def two_sample_chi2(a: list, b: list, hash_rare: bool = False, min_expected: float = MIN_EXPECTED) -> dict:
    """Do samples a and b (hashable categories) come from one distribution? Pearson's chi-square
    on the 2 x K table of counts (the statistic of scipy.stats.chi2_contingency with
    correction=False). Categories too rare for the test on their own (smaller expected cell below
    min_expected) are pooled into one; with hash_rare, first hashed into buckets, which keeps
    power when nearly every outcome is rare (joints of several tokens) but spreads a shift of the
    rare outcomes' total mass over many cells (so single tokens pool plainly)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    if not na or not nb:
        raise ValueError("two_sample_chi2 needs at least one sample on each side")
    table = _pooled_table(ca, cb, na, nb, min_expected, hash_rare)
    distinct = len(set(ca) | set(cb))
    if len(table) < 2:  # one category on both sides: nothing can differ
        return {"p_value": 1.0, "statistic": 0.0, "dof": 0, "categories": len(table), "distinct": distinct}
    obs = torch.tensor(table, dtype=torch.float64)  # (K, 2)
    expected = obs.sum(1, keepdim=True) * torch.tensor([na, nb], dtype=torch.float64) / (na + nb)
    stat = float(((obs - expected) ** 2 / expected).sum())
    dof = len(table) - 1
    # The chi-square survival function is the regularised upper incomplete gamma function.
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return {"p_value": p, "statistic": stat, "dof": dof, "categories": len(table), "distinct": distinct}


def _pooled_table(ca: Counter, cb: Counter, na: int, nb: int, min_expected: float,
                  hash_rare: bool) -> list[list[int]]:
    """[[count in a, count in b], ...] with every cell's expected count >= min_expected (but for a
    last pooled row that has nowhere to go)."""
    scale = min(na, nb) / (na + nb)  # expected count of the smaller side per observation

    def big(row) -> bool:
        return scale * (row[0] + row[1]) >= min_expected

    cats = sorted(set(ca) | set(cb), key=repr)  # a fixed order: the table is reproducible
    kept = [[ca[c], cb[c]] for c in cats if big([ca[c], cb[c]])]
    rare = [c for c in cats if not big([ca[c], cb[c]])]
    # Buckets of about four times the minimum: most are big enough to stand alone. crc32 of the
    # repr, unlike hash(), is the same in every process.
    mass = scale * sum(ca[c] + cb[c] for c in rare)
    buckets = [[0, 0] for _ in range(max(1, int(mass / (4 * min_expected))) if hash_rare else 1)]
    for c in rare:
        bucket = buckets[zlib.crc32(repr(c).encode()) % len(buckets)]
        bucket[0] += ca[c]
        bucket[1] += cb[c]
    leftover = [0, 0]
    for bucket in buckets:
        if big(bucket):
            kept.append(bucket)
        else:
            leftover = [leftover[0] + bucket[0], leftover[1] + bucket[1]]
    if sum(leftover):
        if big(leftover) or not kept:
            kept.append(leftover)
        else:  # too small to stand alone: merge into the smallest category
            smallest = min(kept, key=sum)
            smallest[0] += leftover[0]
            smallest[1] += leftover[1]
    return kept
