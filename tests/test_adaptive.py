"""Adaptive speculation: the cost model stops drafting when drafts never win, keeps drafting when
they do, and the output stays the target's own."""
import math
import time

import pytest
import torch

import draftsman
from draftsman.drafters import Drafter, DraftTree, register
from draftsman.drafters.adaptive import AdaptiveDrafter, CostTable, OnlineLinearFit, depth_counts

from toy_drafters import ToyDrafter


def test_online_fit_recovers_a_line_and_never_predicts_falling_costs():
    fit = OnlineLinearFit(decay=1.0)
    for x in (1, 2, 5, 9):
        fit.add(x, 0.002 + 0.001 * x)
    assert fit.predict(17) == pytest.approx(0.019)
    falling = OnlineLinearFit(decay=1.0)
    falling.add(1, 0.01)
    falling.add(5, 0.005)
    assert falling.predict(9) >= falling.predict(5) - 1e-12
    # One size seen: verification is priced flat (its fixed cost dominates); drafting, which
    # grows from nothing with depth, through the origin, so depth 1 is not priced like depth 5.
    flat, proportional = OnlineLinearFit(decay=1.0), OnlineLinearFit(decay=1.0, proportional=True)
    for fit in (flat, proportional):
        fit.add(5, 0.010)
    assert flat.predict(1) == pytest.approx(0.010) and proportional.predict(1) == pytest.approx(0.002)


def test_cost_table_takes_measured_sizes_as_measured():
    """A CPU's pass cost is not even monotone in its size (at batch 1 here 2-3 tokens cost more
    than 5): measured sizes are priced as measured, others interpolated, and sizes past the largest
    extrapolated along the average slope from the smallest, never downward."""
    table = CostTable()
    for x, y in ((1, 0.010), (4, 0.016), (5, 0.012), (13, 0.014)):
        table.add(x, y)
    assert table.predict(1) == pytest.approx(0.010) and table.predict(4) == pytest.approx(0.016)
    assert table.predict(5) == pytest.approx(0.012)  # cheaper than 4, as measured
    assert table.predict(9) == pytest.approx(0.013) and table.predict(2) == pytest.approx(0.012)
    assert table.predict(25) == pytest.approx(0.014 + 0.004 / 12 * 12)  # slope from size 1 to 13
    falling = CostTable()
    falling.add(2, 0.020)
    falling.add(5, 0.015)
    assert falling.predict(9) == pytest.approx(0.015)  # flat, never falling past the largest
    assert CostTable().predict(3) == 0.0 and not CostTable().seen


def test_a_size_not_measured_for_a_while_is_tried_again():
    """A width measured only during a stall (45 ms for a 15 ms pass) would price itself out of
    every later decision and never be measured again: after forget_after samples of other sizes it
    is doubted, priced at most like the nearest smaller size in use, so a bet on it is tried again,
    and its next sample starts afresh. Doubted sizes keep their place: a line drawn from the small
    widths in use would price wide passes far too high on a CPU where 2-3 tokens cost more than 9."""
    table = CostTable(forget_after=4)
    table.add(1, 0.011)
    table.add(7, 0.045)  # the stall
    table.add(9, 0.016)  # a wide pass, cheap as measured
    for x, y in ((1, 0.011), (3, 0.020)):
        table.add(x, y)
    assert table.predict(7) == pytest.approx(0.045)  # 3 samples since: still as measured
    table.add(1, 0.011)
    table.add(3, 0.020)
    assert table.predict(7) == pytest.approx(0.020)  # doubted: no dearer than width 3, in use
    assert table.predict(9) == pytest.approx(0.016)  # doubted too, but already cheaper: kept
    table.add(7, 0.015)
    assert table.predict(7) == pytest.approx(0.015)  # measured again, the stall's sample dropped
    stalled = CostTable()  # a size measured through a stall, then twice cleanly
    for y in (0.045,) * 6 + (0.015,):
        stalled.add(7, y)
    assert stalled.predict(7) == pytest.approx(0.045)  # one clean sample could be luck...
    stalled.add(7, 0.015)
    assert stalled.predict(7) == pytest.approx(0.015)  # ...two: the lower quartile of the last 8
    plain_only = CostTable(forget_after=4)
    plain_only.add(5, 0.015)
    for _ in range(8):
        plain_only.add(1, 0.011)  # plain rounds only: width 5 must not be priced like a plain step
    assert plain_only.predict(5) == pytest.approx(0.015)


def test_a_size_that_stays_dear_is_doubted_less_and_less_often():
    """At batch 16 a wide pass is measured about once a request: doubted after every
    forget_after samples, a 7-wide n-gram pass (2.6x a plain step) was priced like a narrow one
    again in every request. A doubted size whose new sample confirms its price waits twice as long
    before the next doubt, up to max_forget_after; one that comes back cheaper (its old price was
    a stall) starts over at forget_after."""
    table = CostTable(forget_after=4, max_forget_after=16)
    table.add(7, 0.026)

    def narrow_rounds(n):  # widths 1 and 2 stay in use
        for i in range(n):
            table.add(1 + i % 2, 0.010 + 0.002 * (i % 2))

    def doubted_after(rounds, price=0.026):
        narrow_rounds(rounds - 1)
        kept = table.predict(7) == pytest.approx(price)
        narrow_rounds(1)
        return kept and table.predict(7) == pytest.approx(0.012)  # priced like width 2, in use

    assert doubted_after(4)
    table.add(7, 0.026)  # measured again: as dear as before
    assert doubted_after(8)
    table.add(7, 0.026)
    assert doubted_after(16)
    table.add(7, 0.026)
    assert doubted_after(16)  # no longer than max_forget_after
    table.add(7, 0.015)  # cheaper this time: the old price was a stall, so the wait starts over
    assert doubted_after(4, price=0.015)


def test_pass_cost_tells_rows_from_tokens():
    """One row of 16 tokens is not 16 rows of one token: each batch size has its own widths, and a
    width it has not measured is scaled from its widest measured one along the shape of all passes."""
    from draftsman.drafters.adaptive import PassCost

    cost = PassCost()
    for width in (1, 4, 16):
        cost.add(1, width, 0.010 + 0.0005 * width)  # batch 1: cheap tokens
    cost.add(16, 1, 0.030)  # batch 16: one token per row already costs 3x
    assert cost.predict(16, 1) == pytest.approx(0.030)
    assert cost.predict(1, 16) == pytest.approx(0.018)
    # Width 4 at batch 16 is unmeasured: 0.030 times the token-count table's growth from 16 to 64
    # tokens (batch 1 x 16 at 0.018 is the nearest measured; 16 tokens cost 0.030 or 0.018).
    growth = cost.by_tokens.predict(64) / cost.by_tokens.predict(16)
    assert cost.predict(16, 4) == pytest.approx(0.030 * growth) and growth >= 1.0
    assert cost.predict(3, 2) == pytest.approx(cost.by_tokens.predict(6))  # batch never seen


def register_always_wrong():
    @register
    class AlwaysWrong(ToyDrafter):
        """Proposes k tokens no target would pick (acceptance forced to zero at greedy), slowly."""
        name = "always_wrong_test"

        def propose(self, contexts):
            depth = self.k if self.depth_limit is None else min(self.k, self.depth_limit)
            time.sleep(0.002 * depth)  # drafting costs something per level, as every real drafter's does
            return [DraftTree.chain([(c[-1] + 1) % self.vocab] * self.k) for c in contexts]


def test_zero_acceptance_means_zero_drafts(tiny_models):
    register_always_wrong()
    target = str(tiny_models["llama"][0])
    plain = draftsman.load({"target": {"path": target}}).generate(input_ids=[[5, 6, 7]], max_new_tokens=150)
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "always_wrong_test", "adaptive": True}})
    out = dec.generate(input_ids=[[5, 6, 7]], max_new_tokens=150)
    assert out.token_ids == plain.token_ids
    assert isinstance(dec.drafter, AdaptiveDrafter)
    depths = dec.drafter.depth_log
    # Once acceptance has been measured near zero, plain rounds dominate; probes are rare.
    later = depths[len(depths) // 2:]
    assert later.count(0) >= 0.85 * len(later), depths
    # Each fruitless probe (probe_rounds rounds in a row, at the closest bet's depth: one level
    # for a drafter whose every level fails) doubles the wait (16, 32, 64 rounds...): over the last
    # ~75 rounds at most two probes remain (one every 16 rounds would be four or five).
    probes = "".join("x" if d else " " for d in later).split()
    assert {d for d in later if d} <= {1} and len(probes) <= 2, depths


def test_full_acceptance_keeps_drafting(tiny_models):
    """A free drafter that knows the greedy continuation: every draft is accepted, so deep
    drafts pay and plain rounds never win. (The target itself as draft model would not do: its
    drafting costs as much as plain decoding, and adaptive rightly stops using it.)"""
    target = str(tiny_models["llama"][0])
    prompt = [5, 6, 7]
    plain = draftsman.load({"target": {"path": target}}).generate(input_ids=[prompt], max_new_tokens=40)
    known = prompt + plain.token_ids[0]

    @register
    class Oracle(ToyDrafter):
        name = "oracle_test"

        def propose(self, contexts):
            return [DraftTree.chain(known[len(c): len(c) + self.k]) for c in contexts]

    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "oracle_test", "adaptive": True}})
    out = dec.generate(input_ids=[prompt], max_new_tokens=40)
    assert out.token_ids == plain.token_ids
    # Timing noise on a loaded machine can cost a few plain rounds; the decision itself is checked
    # exactly in test_choose_depth_follows_the_estimates.
    assert out.stats.tau > 2.0
    # Round 1 measures plain decoding; rounds 2 and 3 the full bet (round 2's drafting includes the
    # drafter's catch-up on the prompt, so only round 3 enters the cost fit).
    assert dec.drafter.depth_log[1:3] == [4, 4]


def test_choose_depth_follows_the_estimates():
    """The bet with controlled estimates (no timing): verification costs 1 + 0.1 per extra token."""
    from draftsman.drafters.adaptive import AdaptiveSettings
    from draftsman.verifier.sampling import SamplingParams

    class Inner(Drafter):
        name = "inner_test"

        def max_depth(self):
            return 4

    drafter = AdaptiveDrafter(Inner(), AdaptiveSettings(probe_every=1000, measure_rounds=0))
    drafter.begin([[1]], SamplingParams(), torch.Generator())
    for x in (1, 2, 5):
        drafter.verify_cost.add(1, x, 1.0 + 0.1 * (x - 1))
    drafter.record_draft_cost(1, 4, 0.0)
    drafter.offered_count = [100.0] * 4
    drafter.accepted_count = [100.0] * 4  # every draft accepted: bet the most
    assert drafter.choose_depth(batch=1) == 4
    drafter.accepted_count = [0.0] * 4  # nothing accepted: plain decoding
    assert drafter.choose_depth(batch=1) == 0
    drafter.accepted_count = [70.0] * 4  # 70% per depth: pays at batch 1...
    assert drafter.choose_depth(batch=1) == 4
    assert drafter.choose_depth(batch=64) == 0  # ...not when 64 rows make every extra token expensive
    # A drafter that proposes in a quarter of the rounds (n-gram lookup without a match) widens
    # the pass only then: the other rounds cost a plain step, and the bet is priced so.
    drafter.proposal_rate = 0.25
    assert drafter.expected_seconds(4, 1) == pytest.approx(0.25 * (1.0 + 0.1 * 4) + 0.75 * 1.0)


def test_adaptive_must_be_a_bool(tiny_models):
    with pytest.raises(ValueError, match="adaptive must be true or false"):
        draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": {"name": "ngram", "adaptive": "yes"}})


def test_a_second_request_starts_from_what_the_first_measured(tiny_models):
    """Costs are the machine's and acceptance the drafter's: the second request on a Decoder does
    not re-measure plain decoding and the full bet; a drafter that never matches stays off from
    round 1. Other sampling settings start acceptance from the prior again and measure it (costs
    stay)."""
    from draftsman.verifier.sampling import SamplingParams

    register_always_wrong()
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                          "drafter": {"name": "always_wrong_test", "adaptive": True}})
    dec.generate(input_ids=[[5, 6, 7]], max_new_tokens=40)
    D = dec.drafter.max_depth()
    assert dec.drafter.depth_log[:3] == [0, D, D]  # the first request measures
    dec.generate(input_ids=[[8, 9]], max_new_tokens=40)
    assert dec.drafter.depth_log[:16] == [0] * 16, dec.drafter.depth_log  # the second knows
    dec.drafter.begin([[1]], SamplingParams(temperature=1.0), torch.Generator())
    assert dec.drafter.offered_count == [0.0] * D and dec.drafter.verify_cost.seen  # from the prior again
    # ...and measure the full bet again: from the 0.5 prior alone an EAGLE-3 head that ran 1.2-1.3x
    # at T=1 bet its first round there and then stayed plain.
    dec.generate(input_ids=[[8, 9]], max_new_tokens=40, temperature=1.0, seed=1)
    M = dec.drafter.settings.measure_rounds
    assert dec.drafter.depth_log[:M] == [D] * M, dec.drafter.depth_log
    dec.generate(input_ids=[[8, 9]], max_new_tokens=40)  # T=0 again: measured already
    assert dec.drafter.depth_log[:16] == [0] * 16, dec.drafter.depth_log


def _controlled(max_depth: int, **settings):
    """An AdaptiveDrafter past its measuring rounds, with no timings: estimates are set by hand."""
    from draftsman.drafters.adaptive import AdaptiveSettings
    from draftsman.verifier.sampling import SamplingParams

    class Inner(Drafter):
        name = "inner_test"
        trees: list = []

        def max_depth(self):
            return max_depth

        def propose(self, contexts):
            return list(self.trees)

    drafter = AdaptiveDrafter(Inner(), AdaptiveSettings(probe_every=1000, measure_rounds=0, **settings))
    drafter.begin([[1]], SamplingParams(), torch.Generator())
    drafter.record_draft_cost(16, max_depth, 0.0)
    drafter.optimism = 0.0  # past the request's first decision
    return drafter


def _chain(n, start=3):
    return DraftTree.chain(list(range(start, start + n)))


def test_one_wide_row_does_not_widen_the_whole_batch():
    """After drafting, the pass is priced by the trees actually drafted: the batch is padded to
    its widest row, so one row's 18-node n-gram tree among 15 rows without a match would make
    every row pay 19 tokens for a few expected tokens. The round goes plain; with a match in
    every row the full depth pays."""
    drafter = _controlled(6)
    for width in (1, 7, 19):  # batch 16: a step costs 20 ms, and 5 ms per extra token per row
        drafter.verify_cost.add(16, width, 0.020 + 0.005 * (width - 1))
    drafter.offered_count = [100.0] * 6
    drafter.accepted_count = [95.0] * 6
    three_chains = [-1, 0, 1, 2, 3, 4, -1, 6, 7, 8, 9, 10, -1, 12, 13, 14, 15, 16]
    wide = DraftTree(torch.arange(3, 21), torch.tensor(three_chains), torch.zeros(18, dtype=torch.long))
    assert wide.size == 18 and max(wide.depths()) == 6
    assert drafter.verify_depth(depth_counts([wide] + [DraftTree.empty()] * 15, 6)) == 0
    assert drafter.verify_depth(depth_counts([_chain(6)] * 16, 6)) == 6
    # Through propose: the inner drafter's trees are cut to what verify_depth chose.
    drafter.inner.trees = [wide] + [DraftTree.empty()] * 15
    drafter.choose_depth = lambda batch, unseen=0, in_stretch=False: 6
    assert all(t.size == 0 for t in drafter.propose([[1, 2]] * 16)) and drafter.depth_log[-1] == 0


def test_sampled_trees_are_never_cut_after_drafting():
    """verify_depth would drop these trees, but they were sampled: whether a node is kept must not
    depend on what was drawn, so the round verifies them as drafted."""
    from draftsman.drafters.base import IID

    drafter = _controlled(2)
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 3, 0.200)  # a wide pass is ruinous: a deterministic tree would be cut
    q = torch.full((2, 8), 1 / 8)
    sampled = DraftTree.chain([1, 2], kind=IID, draft_probs=q)
    drafter.inner.trees = [sampled] * 16
    drafter.choose_depth = lambda batch, unseen=0, in_stretch=False: 2
    assert drafter.verify_depth(depth_counts([sampled] * 16, 2)) == 0
    assert [t.size for t in drafter.propose([[1, 2]] * 16)] == [2] * 16
    drafter.inner.trees = [_chain(2)] * 16
    assert [t.size for t in drafter.propose([[1, 2]] * 16)] == [0] * 16


@pytest.mark.parametrize("kind_name", ["deterministic", "iid"])
def test_cutting_by_drafted_tokens_is_exact_only_for_deterministic_drafts(kind_name):
    """Why the guard above: exact enumeration of one round of the real verifier, where the tree
    is cut to depth 1 whenever its depth-2 token is 0 (a rule that looks at what was drafted, as
    verify_depth does). Deterministic drafts stay exactly the target's distribution; sampled ones
    do not."""
    from draftsman.drafters.adaptive import cut_after_drafting_is_exact
    from draftsman.drafters.base import DETERMINISTIC, IID
    from draftsman.verifier.sampling import SamplingParams
    from exact_enumeration import ToyWorld, draw_tree, enumerate_outcomes, path_tokens, total_variation_from_target
    from draftsman.verifier.rejection import verify_sampled
    from draftsman.verifier.tree import pack_drafts

    kind = DETERMINISTIC if kind_name == "deterministic" else IID
    world = ToyWorld(3, SamplingParams(temperature=1.0), seed=5)
    parents = [-1, 0]

    def one_round(coin):
        tree = draw_tree(world, parents, [kind, kind], coin)
        if int(tree.tokens[1]) == 0:
            tree = tree.truncated_to_depth(1)
        toks = tree.tokens.tolist()
        contexts = [()] + [path_tokens(parents[: tree.size], toks, i) for i in range(tree.size)]
        target = torch.stack([world.target_probs(c) for c in contexts])[None]
        verdict = verify_sampled(target, pack_drafts([tree], world.vocab, "cpu", prob_dtype=torch.float64), coin)
        path = verdict.accepted[0, : int(verdict.num_accepted[0])].tolist()
        return tuple(tree.tokens[path].tolist()) + (int(verdict.next_token[0]),)

    tv = total_variation_from_target(world, enumerate_outcomes(one_round), 3)
    probe = draw_tree(world, parents, [kind, kind], None if kind == DETERMINISTIC else _FirstCoin())
    if kind == DETERMINISTIC:
        assert cut_after_drafting_is_exact([probe]) and tv < 1e-12, tv
    else:
        assert not cut_after_drafting_is_exact([probe]) and tv > 1e-3, tv


class _FirstCoin:
    """Draws token 0 wherever asked (to build one sampled tree for the guard)."""

    def sample(self, probs, mask):
        return torch.zeros(1, dtype=torch.long)


def test_deeper_levels_start_from_the_level_above():
    """Unmeasured depths are shrunk toward the estimate one level up, not a flat 0.5: probes draft
    one level only, and a drafter that accepts 90% there is not assumed a coin below it."""
    drafter = _controlled(4)
    drafter.offered_count = [50.0, 0.0, 0.0, 0.0]
    drafter.accepted_count = [45.0, 0.0, 0.0, 0.0]
    assert drafter.acceptance[0] == pytest.approx(45.5 / 51)
    assert drafter.acceptance[1:] == pytest.approx([45.5 / 51] * 3)
    drafter.offered_count[1], drafter.accepted_count[1] = 50.0, 5.0  # measured low at depth 2
    assert drafter.acceptance[1] < 0.15 and drafter.acceptance[3] == pytest.approx(drafter.acceptance[1])


def test_a_costly_catch_up_keeps_a_thin_lead_from_starting():
    """Starting to speculate after plain rounds first pays the drafter's catch-up (an EAGLE head
    reading the whole prompt). A lead of a few percent does not buy a start that costs 16 rounds'
    worth of that lead; the same lead with nothing to catch up, or once speculating, does."""
    drafter = _controlled(1)
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 2, 0.030)
    drafter.offered_count, drafter.accepted_count = [100.0], [60.0]  # E = 1.6 tokens for 0.030 s
    assert drafter.choose_depth(16, unseen_tokens=0) == 1  # 1.6 / 0.030 = 53 vs 50 tokens/s
    drafter.catch_up_cost.add(4096, 0.300)
    assert drafter.choose_depth(16, unseen_tokens=4096) == 0
    drafter.previous_depth = 1  # already speculating: the drafter is caught up
    assert drafter.choose_depth(16, unseen_tokens=4096) == 1


def test_a_start_near_the_end_of_a_request_must_pay_its_catch_up_back_in_the_rounds_left():
    """A start's catch-up is charged over catch_up_rounds rounds, or over the rounds the request
    has left if fewer: a lead that repays it over 16 rounds does not over the last four."""
    drafter = _controlled(1)
    drafter.verify_cost.add(1, 1, 0.020)
    drafter.verify_cost.add(1, 2, 0.024)
    drafter.record_draft_cost(1, 1, 0.0)
    drafter.offered_count, drafter.accepted_count = [100.0], [60.0]  # E = 1.6 tokens for 0.024 s: 1.33x
    drafter.catch_up_cost.add(200, 0.040)  # two plain steps: 1.6 / (0.024 + 0.040 / 16) = 1.21x
    drafter.token_budget = 64
    assert drafter.catch_up_spread(1.6) == 16
    assert drafter.choose_depth(1, unseen_tokens=200) == 1
    drafter.row_tokens = [58]  # 6 tokens left: about 4 rounds at 1.6 tokens a round
    assert drafter.catch_up_spread(1.6) == pytest.approx(6 / 1.6)
    assert drafter.choose_depth(1, unseen_tokens=200) == 0  # 1.6 / (0.024 + 0.040 / 3.75) = 0.92x
    assert drafter.choose_depth(1, unseen_tokens=0) == 1  # nothing to catch up on: the lead stands
    drafter.previous_depth = 1  # already speculating: no catch-up to pay
    assert drafter.choose_depth(1, unseen_tokens=200) == 1


def test_rows_with_their_own_limits_have_their_own_tokens_left():
    """A batch of requests with different max_tokens: the engine sets one budget per row, and a
    row keeps its own after others leave the batch."""
    drafter = _controlled(1)
    drafter.token_budget, drafter.row_tokens, drafter.row_ids = [64, 20, 30], [5, 8, 29], [1, 2]
    assert drafter.remaining_tokens() == [12, 1]
    drafter.token_budget = 64
    assert drafter.remaining_tokens() == [56, 35]


def test_a_plain_stretch_prices_the_bets_every_few_rounds_not_every_round():
    """A plain round verifies nothing, so the estimates behind the bets stay put: a request's
    rounds reuse the last prices for plain_reprice_every rounds in all, then price afresh (at batch
    16 pricing cost 1.1 ms a round, 4% of a plain step). A bet ends the stretch; a direct call
    always prices afresh."""
    drafter = _controlled(1)
    drafter.verify_cost.add(1, 1, 0.020)
    drafter.verify_cost.add(1, 2, 0.030)
    drafter.record_draft_cost(1, 1, 0.0)
    drafter.offered_count, drafter.accepted_count = [100.0], [10.0]  # 1.1 tokens for 0.030 s: plain wins
    priced_at = []
    price = drafter.depth_rates
    drafter.depth_rates = lambda *args: priced_at.append(len(drafter.depth_log)) or price(*args)
    for _ in range(9):
        assert drafter.choose_depth(1, in_stretch=True) == 0
        drafter.depth_log.append(0)  # the round ran plain, as propose records it
    assert priced_at == [0, 4, 8]
    assert drafter.choose_depth(1) == 0 and priced_at[-1] == 9  # a direct call: afresh
    drafter.accepted_count = [95.0]  # the estimates move (in a run, only a bet or a probe moves them)...
    drafter.inner.trees = [_chain(1)]
    drafter.propose([[1, 2]])  # ...and this round, priced on the stretch's stale estimates, stays plain
    assert drafter.depth_log[-1] == 0 and priced_at[-1] == 9
    drafter.depth_log += [0, 0, 0]
    drafter.propose([[1, 2]])  # four rounds on: priced afresh, and the bet starts
    assert priced_at[-1] == 13 and drafter.depth_log[-1] == 1 and drafter._stretch is None


def test_a_catch_up_measured_during_a_stall_does_not_keep_a_paying_drafter_off():
    """Only a start measures a catch-up again. One stalled measurement (seconds for a prompt) would
    keep every later start and probe off for good; it counts at most as what the target's own pass
    over the same tokens costs, and a drafter that pays clearly starts anyway."""
    drafter = _controlled(4)
    for width in (1, 2, 3, 4, 5):
        drafter.verify_cost.add(1, width, 0.012 + 0.001 * (width - 1))
    drafter.draft_costs = {}
    drafter.record_draft_cost(1, 4, 0.010)
    drafter.offered_count, drafter.accepted_count = [50.0] * 4, [45.0] * 4  # 0.9 a level
    drafter.catch_up_cost.add(200, 5.0)  # a 200-token prompt "took" 5 s
    assert drafter.catch_up_seconds(1, 200) == pytest.approx(drafter.verify_cost.predict(1, 201))
    assert drafter.catch_up_seconds(1, 200) < 0.3
    assert drafter.choose_depth(1, unseen_tokens=200) == 4
    drafter.offered_count, drafter.accepted_count = [50.0] * 4, [10.0] * 4  # 0.2 a level: never pays
    assert drafter.choose_depth(1, unseen_tokens=200) == 0


def test_rounds_that_verify_a_tree_pay_their_own_overhead():
    """The engine's share of a round is larger when it verifies a tree (packing, accepted paths,
    a head's features). Priced like a plain round's, a bet that loses looked like a win."""
    drafter = _controlled(2)
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 3, 0.024)
    drafter.draft_costs = {}
    drafter.record_draft_cost(16, 2, 0.004)
    drafter.offered_count, drafter.accepted_count = [50.0, 50.0], [25.0, 25.0]  # E(2) = 1.75
    drafter.round_overhead.add(16, 0.002)
    assert drafter.expected_seconds(2, 16) == pytest.approx(0.030)  # tree rounds unmeasured: as plain
    assert drafter.choose_depth(16) == 2  # 1.75 / 0.030 = 58 tokens/s against 1 / 0.022 = 45
    drafter.tree_overhead.add(16, 0.012)
    assert drafter.expected_seconds(0, 16) == pytest.approx(0.022)
    assert drafter.expected_seconds(2, 16) == pytest.approx(0.040)
    assert drafter.choose_depth(16) == 0  # 1.75 / 0.040 = 44 tokens/s: below plain decoding


def test_a_probe_bets_as_deep_as_the_closest_bet_when_that_is_cheap():
    """A one-level probe says nothing about the levels a deep bet lives on. When plain decoding
    wins narrowly, the probe drafts the closest bet's depth for probe_rounds rounds, if its
    expected cost (what those rounds add to plain ones, less the plain steps their expected tokens
    save, plus the drafter's catch-up) fits the budget: probe_budget of the plain rounds since the
    last probe."""
    drafter = _controlled(4, probe_rounds=3, probe_budget=0.05)  # 16 rounds x 20 ms x 5% = 16 ms
    for width in (1, 2, 3, 4, 5):
        drafter.verify_cost.add(16, width, 0.020 + 0.002 * (width - 1))
    drafter.draft_costs = {}
    drafter.record_draft_cost(16, 1, 0.022)  # 20 ms a round to start drafting, 2 ms a level
    drafter.record_draft_cost(16, 4, 0.028)
    drafter.offered_count = [20.0] * 4
    drafter.accepted_count = [14.0] * 4  # 0.69 a level: depth 4 makes 48.7 tokens/s, plain 50

    def probe(rounds_since_probe, unseen_tokens):
        drafter.probing, drafter.probe_left, drafter.probe_interval = False, 0, 16
        drafter.rounds_since_probe = rounds_since_probe
        return drafter.choose_depth(16, unseen_tokens)

    assert probe(16, unseen_tokens=0) == 4 and drafter.probing
    # A probe bets probe_rounds rounds in a row (one round is one noisy sample), then stops.
    assert [drafter.choose_depth(16) for _ in range(3)] == [4] * (drafter.settings.probe_rounds - 1) + [0]
    assert drafter.probe_interval == 32  # it did not pay: the next one waits twice as long
    drafter.catch_up_cost.add(1000, 0.020)  # catching up on 1000 tokens: over the 16 ms budget
    assert probe(16, unseen_tokens=1000) == 0 and not drafter.probing
    assert probe(32, unseen_tokens=1000) == 4 and drafter.probing  # twice the rounds, twice the budget


def test_a_request_starts_with_the_benefit_of_the_doubt():
    """The first decision of a request counts start_optimism extra accepted rounds: carried
    estimates just below break-even start a bet (its own rounds then decide); later decisions on
    the same estimates do not."""
    drafter = _controlled(2)
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 3, 0.025)
    drafter.record_draft_cost(16, 2, 0.020)
    drafter.offered_count, drafter.accepted_count = [8.0, 8.0], [3.0, 3.0]
    assert drafter.choose_depth(16) == 0  # 39% a level: just short of paying
    drafter.optimism = drafter.settings.start_optimism
    drafter.inner.trees = [_chain(2)] * 16
    drafter.propose([[1, 2]] * 16)
    assert drafter.depth_log[-1] > 0 and drafter.optimism == 0.0
    drafter.previous_depth = 0
    assert drafter.choose_depth(16) == 0


def test_plain_seconds_for_a_ragged_batch_run_rows_in_lockstep():
    from draftsman.drafters.adaptive_costs import lockstep_plain_seconds
    # Rows needing 3 and 5 tokens: 3 steps of 2 rows, then 2 steps of 1 row.
    assert lockstep_plain_seconds([5, 0, 3], lambda rows: float(rows)) == 3 * 2.0 + 2 * 1.0
    assert lockstep_plain_seconds([], lambda rows: 1.0) == 0.0


def test_a_batch_size_whose_bets_ran_slower_than_predicted_demands_more_gain():
    """The per-round model misses what shows over a whole request (a ragged batch's last rounds
    with a few rows, catch-ups in short requests). A request that bet, predicted 1.2x and ran
    0.8x raises its batch size's bar by half the shortfall; bets at that size then need their
    predicted lead to beat it, other batch sizes and sampling settings are untouched, and requests
    that did not bet, or still beat plain decoding, let it fade."""
    from draftsman.verifier.sampling import SamplingParams
    drafter = _controlled(1)
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 2, 0.025)
    drafter.offered_count, drafter.accepted_count = [100.0], [50.0]  # 1.5 tokens for 25 ms: 1.2x
    drafter.begin([[1]] * 16, drafter.sampling, torch.Generator())
    drafter.optimism = 0.0
    assert drafter.choose_depth(16) == 1

    def finish_request(predicted_gain: float, realized_gain: float, bet_rounds: int = 20):
        # 20 rounds at 25 ms; every row emitted what a plain step per token would take 0.02 s for.
        drafter.bet_rounds = bet_rounds
        drafter.predicted_seconds = 20 * 0.025
        drafter.predicted_plain_seconds = predicted_gain * drafter.predicted_seconds
        drafter.row_tokens = [30] * 16
        drafter.spent_seconds = 30 * 0.020 / realized_gain
        drafter.begin([[1]] * 16, drafter.sampling, torch.Generator())
        drafter.optimism = 0.0

    finish_request(predicted_gain=1.2, realized_gain=0.8)
    key = (16, drafter.sampling)
    assert drafter.gain_penalty == {key: pytest.approx(0.2)}
    assert drafter.choose_depth(16) == 0  # 1.2x predicted no longer clears 1 + 3% + 20%
    # A request with fewer than two bets teaches nothing and lets the bar fade by a quarter: a bar
    # above every bet's prediction would otherwise keep the decoder plain for good.
    drafter.begin([[1]] * 2, drafter.sampling, torch.Generator())  # (the 16-row request had no bets)
    assert drafter.gain_penalty == {key: pytest.approx(0.15)}
    assert drafter.required_gain(2) == drafter.settings.new_batch_gain  # another batch size: its own bar
    drafter.begin([[1]] * 16, drafter.sampling, torch.Generator())
    assert drafter.gain_penalty == {key: pytest.approx(0.15)}
    finish_request(predicted_gain=1.2, realized_gain=0.8, bet_rounds=1)
    assert drafter.gain_penalty == {key: pytest.approx(0.1125)}
    assert drafter.choose_depth(16) == 1  # 1.2x clears 1 + 3% + 11% again
    finish_request(predicted_gain=1.2, realized_gain=0.8)
    raised = 0.1125 / 2 + 0.2
    assert drafter.gain_penalty == {key: pytest.approx(raised)}
    finish_request(predicted_gain=1.6, realized_gain=1.1)  # short of its prediction, ahead of plain
    assert drafter.gain_penalty == {key: pytest.approx(raised / 2)}  # the bar only fades
    assert drafter.choose_depth(16) == 1
    # Other sampling settings keep their own bar (bets at T=1 miss by more, on noisier acceptance).
    drafter.begin([[1]] * 16, SamplingParams(temperature=1.0), torch.Generator())
    assert drafter.required_gain(16) == drafter.settings.min_gain


def test_a_prompt_that_accepts_less_than_estimated_does_not_raise_the_bar():
    """The bar learns how far the machine's costs ran over their predictions, not how far one
    prompt's acceptance fell below the estimates: the estimates follow a prompt round by round,
    and the next prompt is another. Counting expected tokens, one prompt on which EAGLE-3 accepted
    little kept the next two batch-1 requests plain where fixed EAGLE-3 ran 1.3x and 1.6x."""
    from draftsman.drafters.base import RoundFeedback
    drafter = _controlled(1)
    drafter.verify_cost.add(1, 1, 0.010)
    drafter.verify_cost.add(1, 2, 0.012)
    drafter.offered_count, drafter.accepted_count = [100.0], [90.0]  # 1.9 tokens for 12 ms expected

    def request(tokens_per_round: int, verify_seconds: float) -> float:
        drafter.begin([[1]], drafter.sampling, torch.Generator())
        drafter.optimism = 0.0
        for _ in range(20):
            drafter._belief = drafter._predict(1, 1, 0)
            emitted = [[7] * tokens_per_round]
            drafter._count_outcome(RoundFeedback(accepted_nodes=[[0]], emitted=emitted,
                                                 verify_seconds=verify_seconds), 0.0, 1)
        drafter.begin([[1]], drafter.sampling, torch.Generator())  # learns from the request above
        return drafter.gain_penalty.get((1, drafter.sampling), 0.0)

    # Nothing accepted, every round as costly as predicted: 0.83x of plain decoding, all of it
    # this prompt's acceptance.
    assert request(tokens_per_round=1, verify_seconds=0.012) == pytest.approx(0.0)
    # Tokens as expected, rounds twice as costly as predicted: 0.83x where 1.67x was predicted.
    assert request(tokens_per_round=2, verify_seconds=0.024) == pytest.approx(0.5 * (40 * 0.010 / (20 * 0.012) - 40 * 0.010 / (20 * 0.024)))


def test_a_ragged_batch_teaches_its_tail_to_the_bar():
    """Rows in lockstep count their rounds' tokens as expected: a batch runs until its slowest row,
    and the rounds that row runs alone each emit a token that plain decoding had already emitted
    beside the other rows. Counted as emitted, those rounds passed for gains and the bar stayed low
    while n-gram bets at batch 8 and 16 ran at 0.94x and 0.93x of plain decoding."""
    from draftsman.drafters.base import RoundFeedback
    drafter = _controlled(1)
    for rows in (1, 2):
        drafter.verify_cost.add(rows, 1, 0.010)
    drafter.begin([[1]] * 2, drafter.sampling, torch.Generator())
    from draftsman.drafters.adaptive import RoundPrediction
    belief = RoundPrediction(seconds=0.012, plain_step=0.010, tokens=2.0, lockstep_scale=1.0, bet=True)

    def round_(emitted):
        drafter._belief = belief
        drafter._count_outcome(RoundFeedback(accepted_nodes=[[0]] * len(emitted), emitted=emitted,
                                             verify_seconds=0.012), 0.0, len(emitted))

    for _ in range(4):  # 2 tokens a row on average, as expected: rows 0 and 1 at 3 and 1 a round
        round_([[7] * 3, [7]])
    drafter.keep_rows([1])
    for _ in range(8):  # row 1 alone for its last 8 tokens
        round_([[7]])
    assert drafter.row_tokens == [12, 12]
    drafter.begin([[1]] * 2, drafter.sampling, torch.Generator())
    predicted, realized = 2.0 * 0.010 / 0.012, 12 * 0.010 / (12 * 0.012)
    assert drafter.gain_penalty[(2, drafter.sampling)] == pytest.approx(0.5 * (predicted - realized))


def test_a_plain_step_measured_once_is_measured_again_before_bets_rely_on_it():
    """A batch size's plain step priced from one round (often a request's cold first step) can be
    far off, and a bet with a wide predicted lead never runs a plain round to correct it."""
    drafter = _controlled(1)
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 2, 0.021)
    drafter.offered_count, drafter.accepted_count = [100.0], [50.0]  # a 43% lead
    drafter.rounds_since_plain = drafter.settings.probe_every
    assert drafter.choose_depth(16) == 0
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 1, 0.020)
    assert drafter.choose_depth(16) == 1
    drafter.rounds_since_plain = 0
    drafter.verify_cost = type(drafter.verify_cost)()
    drafter.verify_cost.add(16, 1, 0.020)
    drafter.verify_cost.add(16, 2, 0.021)
    assert drafter.choose_depth(16) == 1  # (only every probe_every rounds)


def test_a_plain_step_measured_long_ago_is_measured_again_whatever_the_lead():
    """Machines drift: a plain step measured during a slow stretch makes every bet look far ahead,
    and a bet with a wide lead never runs the plain round that would correct it."""
    drafter = _controlled(1)
    for _ in range(drafter.settings.cost_window):
        drafter.verify_cost.add(16, 1, 0.040)  # a slow stretch: twice the real plain step
    drafter.offered_count, drafter.accepted_count = [100.0], [90.0]
    stale = drafter.settings.forget_cost_after
    for _ in range(stale - 1):
        drafter.verify_cost.add(16, 2, 0.025)
    drafter.rounds_since_plain = drafter.settings.probe_every  # a plain round would be due, if doubtful
    assert drafter.choose_depth(16) == 1  # 1.9 tokens for 25 ms against 40 ms a token: bet
    drafter.verify_cost.add(16, 2, 0.025)
    assert drafter.choose_depth(16) == 0  # measured 64 rounds ago: measure it again
    drafter.verify_cost.add(16, 1, 0.020)
    assert drafter.verify_cost.predict(16, 1) == pytest.approx(0.020)  # the old samples make way
    drafter.rounds_since_plain = 0
    assert drafter.choose_depth(16) == 1  # (still ahead: 1.9 tokens for 25 ms against 20 ms)


def test_lockstep_seconds_follow_the_slowest_row():
    from draftsman.drafters.adaptive_costs import lockstep_seconds, priced_on_grid
    # Rows needing 12 and 12 tokens at 3 and 1 tokens a round: 4 rounds of 2 rows, then 8 of 1.
    assert lockstep_seconds([12, 12], [3.0, 1.0], lambda rows: float(rows)) == 4 * 2.0 + 8 * 1.0
    # Priced at 1, 2, 4, 8 and the top only, linear in between.
    calls = []
    price = priced_on_grid(lambda rows: calls.append(rows) or float(rows * rows), 12)
    assert sorted(calls) == [1, 2, 4, 8, 12]
    assert price(8) == 64.0 and price(10) == 64.0 + (144.0 - 64.0) / 2 and price(1) == 1.0


def test_rows_whose_tokens_vary_keep_a_batch_waiting_for_the_unluckiest():
    """A row's tokens per round vary (an n-gram row gains nothing in most rounds, six tokens in a
    few), so rows finish at scattered rounds and the batch waits for the last: t tokens at mean m
    and variance v per round take t/m rounds, give or take sqrt(t*v/m^3), and the last of b rows
    comes expected_largest_normal(b) deviations late."""
    from draftsman.drafters.adaptive_costs import expected_largest_normal, lockstep_seconds
    assert expected_largest_normal(1) == 0.0
    assert expected_largest_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert expected_largest_normal(16) == pytest.approx(1.766, abs=1e-3)
    step = lambda rows: 1.0  # noqa: E731
    # 16 rows of 64 tokens at 2 a round, variance 1: 32 rounds on average, the last row later.
    late = 32 + expected_largest_normal(16) * math.sqrt(64 * 1.0 / 2 ** 3)
    assert lockstep_seconds([64] * 16, [2.0] * 16, step, [1.0] * 16) == pytest.approx(late)
    assert lockstep_seconds([64] * 16, [2.0] * 16, step) == pytest.approx(32)  # no variance given
    assert lockstep_seconds([64], [2.0], step, [1.0]) == pytest.approx(32)  # one row waits for no other


def test_token_moments_match_an_enumeration():
    """A row's tokens in a round drafted d deep: 1 plus A accepted tokens, A >= j with chance
    rate * reach_j. The mean and variance token_moments_by_depth gives equal those of the
    distribution of A written out."""
    from draftsman.drafters.adaptive_rows import RowEstimates
    rows = RowEstimates(2, 3, 0.95, 4.0)
    rows.rounds, rows.proposed = [10.0, 10.0], [9.0, 2.0]
    rows.offered = [[10.0, 8.0, 6.0], [2.0, 1.0, 1.0]]
    rows.accepted = [[8.0, 6.0, 3.0], [1.0, 1.0, 0.0]]
    acceptance, batch_rate = [0.7, 0.6, 0.5], 0.5
    means, variances = rows.token_moments_by_depth(acceptance, batch_rate)
    for rate, reach, mean, var in zip(rows.proposal_rates(batch_rate), rows.reach(acceptance), means, variances):
        for d in range(4):
            at_least = [1.0] + [rate * r for r in reach[:d]] + [0.0]  # P(A >= j), j = 0..d+1
            p = [at_least[j] - at_least[j + 1] for j in range(d + 1)]  # P(A = j)
            m = sum(j * pj for j, pj in enumerate(p))
            assert mean[d] == pytest.approx(1 + m)
            assert var[d] == pytest.approx(sum((j - m) ** 2 * pj for j, pj in enumerate(p)))


def test_a_batch_bet_that_only_pays_for_the_average_row_goes_plain(monkeypatch):
    """Every row of a batch of 16 has a one-token proposal half the time, each accepted; drafting
    widens the pass 1.42x. Each row's expected tokens promise 1.05x, but the last of 16 rows to
    finish takes about four rounds more than the average row: 1.02x, short of the 3% a bet must
    gain, so plain decoding. One row waits for no other: the same bet is taken at batch 1.
    Lockstep without the scatter (the broken variant) bets at batch 16, caught."""
    import draftsman.drafters.adaptive as adaptive
    assert _half_proposing(16).choose_depth(16) == 0
    assert _half_proposing(1).choose_depth(1) == 1
    scattered = adaptive.lockstep_seconds
    monkeypatch.setattr(adaptive, "lockstep_seconds", lambda remaining, per_round, price, variance=None:
                        scattered(remaining, per_round, price))
    assert _half_proposing(16).choose_depth(16) == 1  # the broken variant bets


def test_a_probe_in_lockstep_is_credited_only_with_the_tokens_every_row_gains():
    """A probe round ends a lockstep batch sooner only by the tokens every row gains. With rows
    that each accept a one-token draft half the time, at batch 16 that is 0.5^16 of a token: the
    probe costs its whole wider pass (42% of a plain step), which 8 plain rounds' 3% budget does
    not cover and 16 rounds' does. One row gains its half token: the same probe pays for itself.
    Credited with the rows' average (the broken variant), the batch-16 probe passes for free."""
    one, batch = _half_proposing(1), _half_proposing(16)
    assert one.probe_cost(1, 0, 1) < 0
    plain = batch.expected_seconds(0, 16)
    assert batch.probe_cost(16, 0, 1) == pytest.approx(batch.expected_seconds(1, 16) - plain, rel=1e-3)
    assert batch.probe_cost(16, 0, 1) == pytest.approx(0.42 * plain, rel=1e-3)

    def probes_after(rounds):
        batch.probing, batch.probe_left, batch.probe_interval = False, 0, rounds
        batch.rounds_since_probe = rounds
        return batch.choose_depth(16)

    assert probes_after(8) == 0 and probes_after(16) == 1
    batch.probe_savings = lambda rows, depth: batch.expected_tokens(depth) - 1.0  # the broken variant
    assert batch.probe_cost(16, 0, 1) < 0 and probes_after(8) == 1


def _half_proposing(batch: int):
    """`batch` rows of a 64-token request, each with a one-token proposal half the time, each
    accepted; drafting widens the pass 1.42x."""
    drafter = _rows_controlled(batch, 1, widening=0.42)
    drafter.offered_count, drafter.accepted_count = [100.0], [100.0]
    drafter.proposal_rate = 0.5
    drafter.rows.rounds, drafter.rows.proposed = [50.0] * batch, [25.0] * batch
    drafter.rows.offered = [[50.0] for _ in range(batch)]
    drafter.rows.accepted = [[50.0] for _ in range(batch)]
    return drafter


def _rows_controlled(batch: int, max_depth: int, widening: float = 0.2):
    """_controlled, begun on `batch` rows of a 64-token request, each row with its own estimates."""
    drafter = _controlled(max_depth)
    drafter.token_budget = 64
    drafter.begin([[1, 2]] * batch, drafter.sampling, torch.Generator())
    drafter.optimism = 0.0
    drafter.record_draft_cost(batch, max_depth, 0.0)
    for rows in range(1, batch + 1):  # a step costs 10 ms + 1 ms a row; each extra token `widening` more
        for width in (1, 2, 3, 4, 5):
            drafter.verify_cost.add(rows, width, (0.010 + 0.001 * rows) * (1 + widening * (width - 1)))
    return drafter


def _half_matching_batch():
    """A batch of 8 in which rows 0, 2, 4, 6 got a proposal in each of their rounds, all of it
    accepted, and the other rows never got one."""
    drafter = _rows_controlled(8, 4)
    drafter.offered_count = [100.0] * 4
    drafter.accepted_count = [100.0] * 4
    drafter.proposal_rate = 0.5
    drafter.rows.rounds = [50.0] * 8
    drafter.rows.proposed = [50.0, 0.0] * 4
    for i in range(8):
        drafter.rows.offered[i] = [50.0] * 4 if i % 2 == 0 else [0.0] * 4
        drafter.rows.accepted[i] = list(drafter.rows.offered[i])
    return drafter


def test_the_row_that_gains_least_decides_a_batch_bet():
    """A batch runs until its slowest row is done. The batch's average (1 + 0.5 * 4 tokens for a
    1.8x wider pass) promises 1.7x, but the rows without a proposal still need a round per token,
    each round now wider: plain decoding. With a proposal in every row the bet is taken. Pricing
    rows by the batch's average (a row's own rounds weighed as nothing) is the broken variant,
    caught."""
    drafter = _half_matching_batch()
    assert drafter.choose_depth(8) == 0
    tokens = drafter.expected_tokens(4) * drafter.expected_seconds(0, 8) / drafter.expected_seconds(4, 8)
    assert tokens > 1.5  # what the average promised
    drafter.rows.prior_rounds = 1e9  # the broken variant bets
    assert drafter.choose_depth(8) == 4
    drafter.rows.prior_rounds = drafter.settings.row_prior_rounds

    drafter.proposal_rate = 1.0
    drafter.rows.proposed = [50.0] * 8
    drafter.rows.offered = [[50.0] * 4 for _ in range(8)]
    drafter.rows.accepted = [[50.0] * 4 for _ in range(8)]
    assert drafter.choose_depth(8) == 4


def test_after_drafting_tokens_only_rows_far_ahead_gain_are_not_verified():
    """The same batch after drafting: four rows drafted 4-token chains that would all be accepted,
    four drafted nothing. Verifying the chains widens every row's pass 1.8x for rows that finish
    early anyway; the rows without a match set the request's length: the round goes plain. When
    the rows that drafted nothing are nearly done, the chains are worth verifying."""
    drafter = _half_matching_batch()
    trees = [_chain(4), DraftTree.empty()] * 4
    counts = depth_counts(trees, 4)
    assert drafter.verify_depth(counts, 4) == 0
    drafter.rows.prior_rounds = 1e9  # rows priced as the batch's average: the broken variant verifies
    assert drafter.verify_depth(counts, 4) == 4
    drafter.rows.prior_rounds = drafter.settings.row_prior_rounds
    drafter.row_tokens = [0, 62] * 4  # the rows without a match have 2 tokens left
    assert drafter.verify_depth(counts, 4) == 4


def test_each_row_keeps_its_own_estimates_through_a_batch(tiny_models):
    """Through real batched generation: rows 0 and 2 have an oracle's drafts, rows 1 and 3 never
    get one. The output is plain greedy decoding's; the per-row estimates follow the active rows as
    they finish, and the rows with drafts show the higher proposal rate."""
    target = str(tiny_models["llama"][0])
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20]]
    plain = draftsman.load({"target": {"path": target}}).generate(input_ids=prompts, max_new_tokens=30)
    known = {tuple(p): p + out for p, out in zip(prompts, plain.token_ids)}

    @register
    class HalfOracle(ToyDrafter):
        name = "half_oracle_test"

        def propose(self, contexts):
            trees = []
            for c in contexts:
                row = next(i for i, p in enumerate(prompts) if tuple(c[: len(p)]) == tuple(p))
                full = known[tuple(prompts[row])]
                trees.append(DraftTree.chain(full[len(c): len(c) + self.k]) if row % 2 == 0 else DraftTree.empty())
            return trees

    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "half_oracle_test", "adaptive": True}})
    seen = []
    observe = dec.drafter.observe

    def recording(feedback):
        observe(feedback)
        seen.append((len(feedback.emitted), len(dec.drafter.rows), list(dec.drafter.row_ids),
                     dec.drafter.rows.proposal_rates(dec.drafter.proposal_rate)))
    dec.drafter.observe = recording
    out = dec.generate(input_ids=prompts, max_new_tokens=30)
    assert out.token_ids == plain.token_ids
    assert all(active == rows for active, rows, _, _ in seen)
    assert any(ids == [1, 3] for _, _, ids, _ in seen)  # the rows with drafts finished first
    full_batch = [rates for active, _, ids, rates in seen if ids == [0, 1, 2, 3]]
    assert full_batch and full_batch[-1][0] > full_batch[-1][1] and full_batch[-1][2] > full_batch[-1][3]
