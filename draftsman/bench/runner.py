"""The timing loop: contenders run the same prompts interleaved, so machine noise hits them alike.

A contender is anything with `label`, `kind`, `extra_parameters` and
`run(prompts, max_new_tokens, temperature, seed) -> Run`: one of our drafters (`Ours`, a Decoder)
or a Hugging Face peer (peers.py). A contender holds the run's `min_new_tokens` and caps it at each
call's max_new_tokens (warm-up calls are shorter). Per prompt the contenders run one after another, in an order
that flips every prompt and every repeat (A B C, C B A, ...), after one warm-up call each.
Throughput is computed per repeat; medians over repeats are what get reported. In the batch sweep,
where one call lasts seconds, each contender runs beside its own baseline call instead.
"""
from __future__ import annotations

import statistics
import time
from math import comb
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..verifier.engine import GenerationStats


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` (the sign-test interval: order
    statistics k and n+1-k, with k the largest for which P(Binomial(n, 1/2) < k) <= (1-level)/2).
    With 16 sweep pairs it is the 4th and 13th smallest ratio (97.9% coverage). None for fewer than
    6 values at 95%: no pair of order statistics covers the median that surely. A cell whose
    interval holds 0.95 cannot be told apart from 0.95 with this many pairs."""
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0
    for j in range(n):
        below += comb(n, j) / 2 ** n  # P(fewer than j + 1 of the n values lie below the median)
        if below > (1 - level) / 2:
            break
        k = j + 1
    return (xs[k - 1], xs[n - k]) if k else None


@dataclass
class Run:
    tokens: list[list[int]]  # new tokens per row
    seconds: float  # wall time of the call
    stats: GenerationStats | None = None  # ours only


class Ours:
    """One of our drafters, through the public Decoder API."""

    kind = "ours"

    def __init__(self, label: str, decoder, min_new_tokens: int = 0, lossy_typical_acceptance=None):
        self.label = label
        self.decoder = decoder
        self.min_new_tokens = min_new_tokens
        self.name = decoder.config["drafter"]["name"]
        self.extra_parameters = decoder.drafter.extra_parameters()
        self.lossy_typical_acceptance = lossy_typical_acceptance  # None: the config's sampling section decides

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Run:
        self.decoder.drafter.forget_outputs()  # no answer drafted from its own earlier run (Drafter.forget_outputs)
        t0 = time.perf_counter()
        out = self.decoder.generate(input_ids=prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                    seed=seed, min_new_tokens=min(self.min_new_tokens, max_new_tokens),
                                    lossy_typical_acceptance=self.lossy_typical_acceptance)
        return Run(out.token_ids, time.perf_counter() - t0, out.stats)


@dataclass
class Tally:
    """What one contender did over one prompt list: per-repeat throughput, rep-0 outputs and the
    engine's statistics summed over every timed call."""

    rep_tokens: list[int] = field(default_factory=list)
    rep_seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # repeat 0, one per prompt (batch 1)
    calls: int = 0
    new_tokens: int = 0
    rounds: int = 0
    row_rounds: int = 0
    proposed_at_depth: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    engine_seconds: float = 0.0
    peak_bytes: int | None = None
    lossy: bool = False  # some run accepted drafts by LOSSY typical acceptance (its stats say so)

    def add(self, run: Run, rep: int) -> None:
        while len(self.rep_tokens) <= rep:
            self.rep_tokens.append(0)
            self.rep_seconds.append(0.0)
        n = sum(len(t) for t in run.tokens)
        self.rep_tokens[rep] += n
        self.rep_seconds[rep] += run.seconds
        self.calls += 1
        self.new_tokens += n
        if rep == 0:
            self.outputs.extend(run.tokens)
        s = run.stats
        self.lossy |= bool(s is not None and s.lossy)
        if s is not None:
            self.rounds += s.rounds
            self.row_rounds += s.row_rounds
            _add(self.proposed_at_depth, s.proposed_at_depth)
            _add(self.accepted_at_depth, s.accepted_at_depth)
            self.draft_seconds += s.draft_seconds
            self.verify_seconds += s.verify_seconds
            self.engine_seconds += s.total_seconds

    def absorb(self, other: "Tally") -> None:
        """Add another prompt list's tally (another category, same repeats): throughput over all of
        them is total tokens over total seconds, repeat by repeat."""
        _add(self.rep_tokens, other.rep_tokens)
        _add(self.rep_seconds, other.rep_seconds)
        self.outputs += other.outputs
        self.calls += other.calls
        self.new_tokens += other.new_tokens
        self.rounds += other.rounds
        self.row_rounds += other.row_rounds
        _add(self.proposed_at_depth, other.proposed_at_depth)
        _add(self.accepted_at_depth, other.accepted_at_depth)
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.engine_seconds += other.engine_seconds
        self.lossy |= other.lossy

    @property
    def rep_tokens_per_s(self) -> list[float]:
        return [t / s if s else 0.0 for t, s in zip(self.rep_tokens, self.rep_seconds)]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.rep_tokens_per_s)

    def speedups(self, base: "Tally") -> list[float]:
        """Throughput over the baseline's, repeat by repeat (each pair ran interleaved)."""
        return [a / b if b else 0.0 for a, b in zip(self.rep_tokens_per_s, base.rep_tokens_per_s)]

    @property
    def tau(self) -> float | None:
        return self.new_tokens / self.row_rounds if self.row_rounds else None

    @property
    def acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at_depth, self.proposed_at_depth)]

    def time_split(self) -> dict:
        """Engine time: drafting, target verification, everything else (the target's prompt prefill,
        which the engine does not time on its own, and engine overhead)."""
        other = max(self.engine_seconds - self.draft_seconds - self.verify_seconds, 0.0)
        total = self.engine_seconds or 1.0
        return {"draft_s": self.draft_seconds, "verify_s": self.verify_seconds, "other_s": other,
                "draft_frac": self.draft_seconds / total, "verify_frac": self.verify_seconds / total,
                "other_frac": other / total}


def _add(acc: list, values: list) -> None:
    acc.extend([0] * (len(values) - len(acc)))
    for d, v in enumerate(values):
        acc[d] += v


def _order(contenders: list, flip: bool) -> list:
    return contenders[::-1] if flip else contenders


class PeerFailed(RuntimeError):
    """A peer's own generate raised: the comparison drops that peer and goes on (a bug in a peer
    is the peer's result, not a reason to lose the run)."""

    def __init__(self, peer, error: BaseException):
        super().__init__(f"{peer.label} failed: {type(error).__name__}: {error}")
        self.peer = peer


def time_interleaved(contenders: list, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                     repeats: int, seed: int, tick: Callable[[], None] = lambda: None,
                     memory=None, on_peer_failed: Callable[[PeerFailed], None] | None = None) -> dict[str, Tally]:
    """Every contender on every prompt (batch 1), `repeats` times, interleaved; then, if a
    PeakMemory is given, one untimed call each on the longest prompt to measure memory.

    A peer whose generate raises (PeerFailed) is handed to `on_peer_failed` and left out from then
    on; the others' runs go on, so nothing already timed is lost. Without `on_peer_failed` it raises.
    `tick` is called once per planned call (1 + repeats x prompts, + 1 with memory, each), a dropped
    peer's calls included, so a progress bar still ends full."""
    contenders = list(contenders)
    tallies = {c.label: Tally() for c in contenders}
    planned = 1 + repeats * len(prompts) + (memory is not None)
    made = {c.label: 0 for c in contenders}

    def run(c, rows, new_tokens, row_seed):
        made[c.label] += 1
        try:
            return c.run(rows, new_tokens, temperature, row_seed)
        except PeerFailed as e:
            if on_peer_failed is None:
                raise
            contenders.remove(c)
            del tallies[c.label]
            on_peer_failed(e)
            for _ in range(planned - made[c.label]):  # (the failed call's own tick comes after it)
                tick()
            return None

    for c in list(contenders):  # warm-up: first calls pay for allocations and lazy initialisation
        run(c, prompts[:1], min(8, max_new_tokens), seed)
        tick()
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            for c in _order(list(contenders), (rep + i) % 2 == 1):
                # Same seed for every contender on a prompt: the draws differ anyway (drafters
                # consume randomness differently), but the runs are repeatable.
                result = run(c, [prompt], max_new_tokens, seed + i)
                if result is not None:
                    tallies[c.label].add(result, rep)
                tick()
    if memory is not None:
        longest = max(prompts, key=len)
        for c in list(contenders):
            peak = memory.measure(lambda: run(c, [longest], max_new_tokens, seed))
            if c.label in tallies:
                tallies[c.label].peak_bytes = peak
            tick()
    return tallies


def sweep_batch(rows: list[list[int]], batch_size: int, rep: int) -> list[list[int]]:
    """The batch a sweep's repeat `rep` runs at this batch size: the next batch_size rows."""
    return [rows[(rep * batch_size + j) % len(rows)] for j in range(batch_size)]


def batch_sweep(contenders: list, rows: list[list[int]], batch_sizes: list[int], *, max_new_tokens: int,
                temperature: float, repeats: int, seed: int, baseline: str,
                tick: Callable[[], None] = lambda: None) -> dict[int, dict[str, tuple[Tally, Tally]]]:
    """{batch size: {label: (its Tally, its baseline Tally)}}. Repeat r runs the batch of rows
    r*b .. r*b + b - 1 (cycled), so a small batch size is measured on `repeats` different prompts,
    not on one prompt that a drafter happens to suit or not (the first row of the bundled set, on
    which fixed n-gram lookup found almost nothing: tau 1.05). A batch runs for seconds, so a baseline measured once
    per repeat sits tens of seconds away from most contenders on a machine whose speed drifts by
    5-15% over that time: every contender is paired with its own baseline runs on the same batch,
    A B B A, and its speedup is taken pair by pair. The baseline's own entry holds all its runs."""
    base = next(c for c in contenders if c.label == baseline)
    others = [c for c in contenders if c is not base]
    out = {}
    for b in batch_sizes:
        for c in contenders:  # warm-up at this batch size
            c.run(sweep_batch(rows, b, 0), min(4, max_new_tokens), temperature, seed)
            tick()
        everything, pairs = Tally(), {c.label: (Tally(), Tally()) for c in others}
        for rep in range(repeats):
            batch = sweep_batch(rows, b, rep)
            for c in others or [None]:  # (a sweep of the baseline alone still measures it)
                for runner in _order([base, c] if c else [base], rep % 2 == 1):
                    run = runner.run(batch, max_new_tokens, temperature, seed)
                    if c:
                        contender_tally, its_baseline = pairs[c.label]
                        (its_baseline if runner is base else contender_tally).add(run, rep)
                    if runner is base:
                        everything.add(run, len(everything.rep_tokens))
                    tick()
        out[b] = {baseline: (everything, everything), **pairs}
    return out


@torch.no_grad()
def first_divergence(target, prompt: list[int], expected: list[int], got: list[int]) -> dict:
    """Where `got` first differs from `expected` (the plain greedy output), and the target's
    top-2 logit gap there, from one forward pass: a gap near 0 means two tokens nearly tie, so
    float rounding (batch shape, kernel choice) can flip the argmax; a large gap means a bug."""
    pos = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    device = next(target.parameters()).device
    ids = torch.tensor([prompt + expected[:pos]], dtype=torch.long, device=device)
    logits = target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {"position": pos, "top2_logit_gap": float(top.values[0] - top.values[1]),
            "expected_token": expected[pos] if pos < len(expected) else None,
            "got_token": got[pos] if pos < len(got) else None}
