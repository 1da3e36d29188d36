"""Drafting under min_new_tokens (drafters/eos_ban.py): drafters draft no EOS where the
target's EOS logit is masked, so a draft model that is the target itself is always accepted, and
no drafter wastes a node on a token the verifier must reject. EOS here is a token the drafter
proposes often, so without the ban it is drafted at banned depths."""
from collections import Counter

import pytest
import torch

import draftsman
from draftsman.drafters.eos_ban import EosBan

from toy_drafters import watching_proposals

PROMPTS = [[5, 6, 7, 8], [9], [1, 2, 3, 1, 2, 3], [40, 41]]
NEW = 20


def test_the_ban_masks_eos_columns_up_to_each_rows_depth():
    logits = torch.zeros(2, 3, 5)  # (rows, positions, draft vocabulary)
    vocab_map = torch.tensor([9, 4, 2, 7, 3])  # draft row -> token id
    columns = EosBan.columns_of({2, 3, 8}, width=5, vocab_map=vocab_map, device="cpu")
    ban = EosBan.for_round([3, 6], minimums=[7, 7], columns=columns, device="cpu")
    assert ban.columns.tolist() == [2, 4] and ban.deepest.tolist() == [4, 1]
    # Each row its own request's minimum (rows of requests batched together).
    assert EosBan.for_round([3, 6], [4, 9], columns, "cpu").deepest.tolist() == [1, 3]
    assert EosBan.for_round([3, 6], [0, 9], columns, "cpu").deepest.tolist() == [-3, 3]
    out = ban.apply(logits, torch.tensor([1, 2, 5]))  # one depth per position
    banned = out[..., [2, 4]].isinf()
    assert banned[..., 0].tolist() == [[True, True, False], [True, False, False]]
    assert torch.equal(banned[..., 0], banned[..., 1]) and out[..., [0, 1, 3]].eq(0).all()
    assert logits.eq(0).all()  # a new tensor: the caller's logits are left as they were
    assert ban.apply(torch.zeros(2, 5), 2)[:, 2].isinf().tolist() == [True, False]
    assert ban.rows(torch.tensor([1])).apply(torch.zeros(1, 5), 1)[0, 4].isinf()
    # Nothing to ban: every row has its min_new_tokens, no EOS, or none in the draft vocabulary.
    assert EosBan.for_round([7, 9], [7, 7], columns, "cpu") is None
    assert EosBan.for_round([7, 9], [0, 9], columns, "cpu") is None
    for eos, draft_vocab in ((set(), None), ({8}, vocab_map), ({5}, None)):  # ({5}: past the drafter's logits)
        assert EosBan.for_round([0], [7], EosBan.columns_of(eos, 5, draft_vocab, "cpu"), "cpu") is None


def test_the_dynamic_tree_bans_eos_per_row_at_every_level():
    """EOS is every node's favourite here: each row drafts it from the first depth its ban allows,
    and not before. Row 0 has no ban left, as when another row of its batch still has one; rows 1
    and 2 end theirs at the root's children and one level below. (Each level's depth one off
    either way, the root's included, fails it.)"""
    from draftsman.drafters.dynamic_tree import dynamic_tree

    V, eos = 6, 2

    class Slots:  # the cached model's slot count is all the tree reads of it
        num_slots = 0

    def favouring_eos(*shape):
        logits = torch.zeros(*shape, V)
        logits[..., eos], logits[..., 3] = 5.0, 1.0
        return logits

    def grow(state, tokens, depth, visible):
        lm.num_slots += tokens.shape[1]
        return None, favouring_eos(*tokens.shape)

    lm, deepest = Slots(), [0, 1, 2]
    ban = EosBan(torch.tensor(deepest), torch.tensor([eos]))
    trees = dynamic_tree(lm, grow, favouring_eos(3), None, 4, 2, 30, [True] * 3, eos_ban=ban)
    for tree, banned_to in zip(trees, deepest):
        eos_depths = {d for t, d in zip(tree.tokens.tolist(), tree.depths()) if t == eos}
        assert min(eos_depths) == banned_to + 1, (banned_to, eos_depths)


def _frequent_eos(dec, prompts) -> int:
    """A token the drafter drafts often (without min_new_tokens)."""
    drafted = Counter()

    def watch(contexts, trees):
        drafted.update(t for tree in trees for t in tree.tokens.tolist())

    with watching_proposals(dec, watch):
        dec.generate(input_ids=prompts, max_new_tokens=NEW)
    return drafted.most_common(1)[0][0]


def _drafted_by_new_token_number(dec, prompt, min_new=0) -> dict[int, Counter]:
    """{n: Counter of the tokens drafted as the row's new token number n}, over one batch-1 request.
    Only n <= 4 is read, drafted in rounds that start with at most 3 tokens produced: 8 new tokens
    leave those rounds (4 deep at most) uncut, and cost a third of NEW's."""
    drafted: dict[int, Counter] = {}

    def watch(contexts, trees):
        produced = len(contexts[0]) - len(prompt)
        for token, depth in zip(trees[0].tokens.tolist(), trees[0].depths()):
            drafted.setdefault(produced + depth, Counter())[token] += 1

    with watching_proposals(dec, watch):
        dec.generate(input_ids=[prompt], max_new_tokens=8, min_new_tokens=min_new)
    return drafted


def _draft_q(dec, eos) -> tuple[float, float]:
    """(EOS's draft probability summed over every sampled node, the largest distance of a node's q
    from summing to 1) over a min_new_tokens = max_new_tokens run: every node that can be emitted
    is banned (a drafter may draft past max_new_tokens; the engine drops those nodes)."""
    mass, off = [0.0], [0.0]
    prompt_length = {p[0]: len(p) for p in PROMPTS}  # rows told apart by their first token

    def watch(contexts, trees):
        for ctx, tree in zip(contexts, trees):
            if tree.draft_probs is None or not tree.size:
                continue
            produced = len(ctx) - prompt_length[ctx[0]]
            q = tree.draft_probs[[i for i, d in enumerate(tree.depths()) if produced + d <= NEW]]
            mass[0] += float(q[:, eos].sum())
            off[0] = max([off[0], *(q.sum(-1) - 1).abs().tolist()])

    with watching_proposals(dec, watch):
        dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, seed=3)
    return mass[0], off[0]


def _without_the_ban(monkeypatch):
    monkeypatch.setattr(EosBan, "for_round", classmethod(lambda cls, *a, **k: None))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("options", [{"k": 4}, {"k": 4, "top_k": 3, "total_tokens": 30}], ids=["chain", "tree"])
def test_the_target_drafting_for_itself_is_accepted(tiny_models, options, temperature, monkeypatch):
    """The target as its own draft model under min_new_tokens = max_new_tokens: output equals plain
    decoding's; a chain of the target's own (masked) choices is always accepted, greedy or sampled
    (q = p); drafting that ignores the ban is accepted less."""
    if temperature and "top_k" in options:
        pytest.skip("a top-k tree is a greedy-only option")
    target = str(tiny_models["llama"][0])
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "draft_model", "path": target, **options},
                          "sampling": {"temperature": temperature}})
    eos = _frequent_eos(dec, PROMPTS)
    dec.engine.eos_token_ids = {eos}
    plain = dec.with_drafter({"name": "none"})
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, seed=3)
    assert all(len(row) == NEW and eos not in row for row in out.token_ids)
    if temperature == 0:
        assert out.token_ids == plain.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW).token_ids
    if "top_k" not in options:
        assert out.stats.tau == 5.0, out.stats.accepted_per_round  # 20 tokens in 4 rounds per row
    if "top_k" not in options and temperature == 0:
        # Past min_new_tokens EOS is drafted again where the target may pick it: every round but a
        # row's last (cut by EOS or length) is still accepted whole.
        half = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW // 2, seed=3)
        assert any(len(row) < NEW for row in half.token_ids) and all(len(row) >= NEW // 2 for row in half.token_ids)
        assert all(a == 4 for row in half.stats.accepted_per_round for a in row[:-1]), half.stats.accepted_per_round
    if temperature:  # a sampled token's q holds no EOS mass (this random target rarely samples EOS)
        assert _draft_q(dec, eos)[0] == 0
        _without_the_ban(monkeypatch)
        assert _draft_q(dec, eos)[0] > 0
        return
    _without_the_ban(monkeypatch)
    unaware = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, seed=3)
    assert unaware.token_ids == out.token_ids
    # A tree keeps its best nodes by path probability, which on this near-uniform random target are
    # not all on the greedy path: EOS displaces a sibling only, so the margin is smaller.
    margin = 0.0 if "top_k" in options else 0.5
    assert out.stats.tau > unaware.stats.tau + margin, (out.stats.accepted_per_round, unaware.stats.accepted_per_round)


DRAFTERS = {"eagle": {"name": "eagle", "depth": 4, "top_k": 3, "total_tokens": 12},
            "eagle3": {"name": "eagle", "depth": 4, "top_k": 3, "total_tokens": 12},
            "mtp": {"name": "mtp", "depth": 3},
            "medusa": {"name": "medusa"},
            "draft_model": {"name": "draft_model", "k": 4}}


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_drafter_bans_eos_up_to_min_new_tokens_and_no_further(name, fresh_heads, tiny_models):
    """Every model drafter, greedy, with min_new_tokens m of 1 to 3 (the ban ends inside a round's
    tree or at its root): EOS, chosen as the token drafted most as new token m without the ban,
    is never drafted as new token <= m; chosen as the one drafted most as token m + 1, it still is
    drafted there. Output equals plain decoding's at batch 1 and 4."""
    target, draft = tiny_models["llama"]
    path = draft if name == "draft_model" else fresh_heads / name
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {**DRAFTERS[name], "path": str(path)}})
    unbanned = [_drafted_by_new_token_number(dec, p) for p in PROMPTS]
    checked = 0
    for m in (1, 2, 3):
        for prompt, free in zip(PROMPTS, unbanned):
            if m not in free or m + 1 not in free:  # (a head drafts nothing before its first feature)
                continue
            last_banned, first_free = free[m].most_common(1)[0][0], free[m + 1].most_common(1)[0][0]
            dec.engine.eos_token_ids = {last_banned}
            drafted = _drafted_by_new_token_number(dec, prompt, m)
            assert not any(drafted.get(n, {}).get(last_banned) for n in range(1, m + 1)), (m, prompt)
            if first_free != last_banned:
                dec.engine.eos_token_ids = {first_free}
                assert _drafted_by_new_token_number(dec, prompt, m).get(m + 1, {}).get(first_free), (m, prompt)
            checked += 1
    assert checked >= 6
    dec.engine.eos_token_ids = {unbanned[0][2].most_common(1)[0][0]}
    expected = dec.with_drafter({"name": "none"}).generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)
    assert dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW).token_ids == expected.token_ids
    for b, prompt in enumerate(PROMPTS):
        got = dec.generate(input_ids=[prompt], max_new_tokens=NEW, min_new_tokens=NEW).token_ids[0]
        assert got == expected.token_ids[b]


@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp"])
def test_a_heads_sampled_chain_is_drawn_from_the_masked_distribution(name, fresh_heads, tiny_models, monkeypatch):
    """At T=1 a head's chain token is drawn from its processed distribution with EOS masked, and
    that distribution is its q: no EOS mass where banned, and still a distribution (sums to 1).
    Without the ban the same heads put mass on EOS there."""
    target = tiny_models["llama"][0]
    drafter = {**DRAFTERS[name], "path": str(fresh_heads / name)}
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": drafter, "sampling": {"temperature": 1.0}})
    dec.engine.eos_token_ids = {_frequent_eos(dec, PROMPTS)}
    eos = next(iter(dec.engine.eos_token_ids))
    mass, off = _draft_q(dec, eos)
    assert mass == 0 and off < 1e-5
    _without_the_ban(monkeypatch)
    assert _draft_q(dec, eos)[0] > 0


@pytest.mark.parametrize("prompt, generated, min_new, drafted", [
    ([1, 2, 3, 7, 4, 9, 8, 1, 2, 3], [], 1, [7, 4, 9, 8]),  # EOS (4) would be new token 2: allowed
    ([1, 2, 3, 7, 4, 9, 8, 1, 2, 3], [], 2, [7]),  # banned: the continuation ends before it
    ([1, 2, 3, 7, 4, 9, 8], [5, 1, 2, 3], 5, [7, 4, 9, 8]),  # 4 produced: EOS would be new token 6
    ([1, 2, 3, 7, 4, 9, 8], [5, 1, 2, 3], 6, [7]),
])
def test_ngram_ends_a_continuation_before_a_banned_eos(prompt, generated, min_new, drafted):
    """ngram's trees are deterministic, so it cuts a continuation at a banned EOS."""
    from draftsman.drafters.ngram import NgramDrafter
    from draftsman.verifier.sampling import SamplingParams

    ngram = NgramDrafter(NgramDrafter.Options(k=4, branches=1))
    ngram.min_new_tokens, ngram.eos_token_ids = min_new, frozenset({4})
    ngram.begin([prompt], SamplingParams(0.0), torch.Generator())
    assert ngram.propose([prompt + generated])[0].tokens.tolist() == drafted


def test_a_cascade_and_adaptive_speculation_pass_the_ban_on(tiny_models):
    """Wrappers hand min_new_tokens and the EOS ids to the drafters they hold."""
    target = str(tiny_models["llama"][0])
    for drafter in ({"name": "cascade", "drafters": [{"name": "ngram"}, {"name": "draft_model", "path": target}]},
                    {"name": "draft_model", "path": target, "adaptive": True}):
        dec = draftsman.load({"target": {"path": target}, "drafter": drafter})
        dec.engine.eos_token_ids = {7}
        dec.generate(input_ids=PROMPTS[:1], max_new_tokens=8, min_new_tokens=5)
        inner = dec.drafter.children[-1] if drafter["name"] == "cascade" else dec.drafter.inner
        assert (inner.min_new_tokens, inner.eos_token_ids) == (5, frozenset({7}))
