"""Drafts drawn under each row's own settings: in a batch whose rows have their own temperature,
top_p, ..., a drafter that draws its drafts (draft_model, EAGLE's and MTP's chains) draws each
row's from that row's own processed distribution: a greedy row drafts its argmax, a sampled row
from its own q (drafters/chain_draws.py). Exactness is the verifier's (tests/test_row_sampling.py);
these tests check that the rows accept what they would accept alone."""
import pytest
import torch

import draftsman
from draftsman import JoiningPrompt
from draftsman.drafters.base import DETERMINISTIC, IID

from test_row_min_new_tokens import close_draft  # noqa: F401 (a fixture)
from test_row_sampling import PROMPTS
from tiny_models import load_for_reference

NEW = 24
K = 4


def self_drafting(target, **extra) -> dict:
    """The target as its own draft model: a row drafted under its own settings has q = p, so it
    accepts every draft (up to float rounding between the two caches)."""
    return {"name": "draft_model", "path": str(target), "k": K, **extra}


def assert_all_accepted(stats) -> None:
    """The rows accepted (almost) every draft at every depth, so each drew its drafts from its own
    distribution: a quarter of the rows drafted under other settings would accept far less."""
    rates = stats.per_position_acceptance
    assert stats.proposed_at_depth and stats.proposed_at_depth[0] >= 8 and min(rates) > 0.95, rates


@pytest.mark.parametrize("temperatures", [[1.3, 0.0, 0.5, 1.3], [0.0, 1.3, 0.0, 0.5]],
                         ids=["sampled-majority", "greedy-majority"])
@pytest.mark.parametrize("wrap", ["plain", "adaptive", "cascade"])
def test_each_row_drafts_under_its_own_settings(tiny_models, temperatures, wrap):
    """Rows of other temperatures, greedy ones among them, each accept every draft of the target
    drafting for itself; rows leave at different times, so the rows' settings follow the rows.
    (Not cross_tokenizer: it drafts after the row's text encoded again, and a random model's
    tokens are rarely what encoding their text gives, so even the target drafting for itself
    drafts from other contexts.)"""
    target = tiny_models["llama"][0]
    spec = {"plain": self_drafting(target), "adaptive": self_drafting(target, adaptive=True),
            "cascade": {"name": "cascade", "drafters": [self_drafting(target)]}}[wrap]
    decoder = draftsman.load({"target": {"path": str(target)}, "drafter": spec})
    limits = [8, NEW, 16, NEW]
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=limits, temperature=temperatures, seed=3,
                           ignore_eos=True)
    assert [len(t) for t in out.token_ids] == limits
    assert_all_accepted(out.stats)


def test_a_joining_row_drafts_under_its_own_warpers(tiny_models):
    target = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(target)}, "drafter": self_drafting(target)})
    waiting = [JoiningPrompt(PROMPTS[1], NEW, warpers={"temperature": 0.6, "top_p": 0.9})]
    stats = draftsman.GenerationStats()
    tokens = {}
    for row, chunk in decoder.stream_batch([PROMPTS[0], PROMPTS[2]], max_new_tokens=NEW, temperature=[0.0, 1.2],
                                           ignore_eos=True, seed=1, stats=stats,
                                           joining=lambda: [waiting.pop()] if waiting else []):
        tokens.setdefault(row, []).extend(chunk.token_ids)
    assert [len(tokens[r]) for r in range(3)] == [NEW] * 3
    assert_all_accepted(stats)


def recorded_trees(decoder) -> list:
    """Every round's trees, as (row settings the drafter was given, trees)."""
    drafter, rounds = decoder.engine.drafter, []
    propose = drafter.propose

    def recording(contexts):
        trees = propose(contexts)
        rounds.append((drafter.row_sampling, trees))
        return trees

    drafter.propose = recording
    return rounds


@pytest.mark.parametrize("name", ["draft_model", "mtp", "eagle3", "cross_tokenizer"])
def test_greedy_rows_propose_deterministic_chains_beside_sampled_ones(tiny_models, fresh_heads, name,
                                                                      close_draft):  # noqa: F811
    """Sampled rows most of the batch (the drafter draws chains): each greedy row's chain is
    deterministic (its argmax), each sampled row's IID with its q; the greedy row generates what
    the target does alone."""
    spec = {"draft_model": {"name": "draft_model", "path": str(close_draft), "k": 3},
            "cross_tokenizer": {"name": "cross_tokenizer", "path": str(close_draft), "k": 3},
            "mtp": {"name": "mtp", "path": str(fresh_heads / "mtp")},
            "eagle3": {"name": "eagle", "path": str(fresh_heads / "eagle3"), "depth": 3}}[name]
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": spec})
    rounds = recorded_trees(decoder)
    temperatures = [0.9, 0.0, 0.9, 0.7]
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=8, temperature=temperatures, seed=2, ignore_eos=True)
    model = load_for_reference(tiny_models["llama"][0])
    prompt = torch.tensor([PROMPTS[1]])
    greedy = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                            attention_mask=torch.ones_like(prompt))[0, prompt.shape[1]:].tolist()
    assert out.token_ids[1] == greedy
    mixed = [trees for row_sampling, trees in rounds if row_sampling is not None and len(trees) == len(PROMPTS)]
    assert mixed and any(t.size for trees in mixed for t in trees)
    for trees in mixed:
        for r, tree in enumerate(trees):
            want = DETERMINISTIC if temperatures[r] == 0.0 else IID
            assert tree.size == 0 or set(tree.kinds.tolist()) == {want}, (name, r, tree.kinds)


def test_rows_left_sharing_one_setting_draft_in_its_shape(tiny_models, fresh_heads):
    """EAGLE drafts a top-k tree for greedy rounds and a chain for sampled ones: once the sampled
    row has left a batch that began sampled, the greedy row left drafts trees again."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": {"name": "eagle", "path": str(fresh_heads / "eagle3"), "depth": 3,
                                          "top_k": 2, "total_tokens": 6}})
    rounds = recorded_trees(decoder)
    drafter = decoder.engine.drafter
    drafter.head_config = {**drafter.head_config, "greedy_score_scale": 3.0}
    decoder.generate(input_ids=[PROMPTS[0], PROMPTS[0], PROMPTS[1]], max_new_tokens=[2, 2, 16],
                     temperature=[0.8, 0.8, 0.0], seed=4, ignore_eos=True)
    assert drafter.sampling.temperature == 0.8 and drafter.score_scale == 3.0  # the greedy trees' own ranking
    alone = [trees[0] for _, trees in rounds if len(trees) == 1 and trees[0].size]
    assert alone and all(torch.bincount(t.parents + 1).max() > 1 for t in alone)  # branching: trees
    assert all(set(t.kinds.tolist()) == {DETERMINISTIC} for t in alone)
