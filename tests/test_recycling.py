"""The `recycling` drafter (Token Recycling): the target's top candidates after every token of a
round's block fill an adjacency matrix, and a fixed template of candidate ranks read from it is
the next draft tree. Greedy equality with the target's own generate is in test_greedy_equality.py;
sampling stays the target's (chi-square below)."""
import random
from types import SimpleNamespace

import pytest
import torch

import draftsman
from draftsman.drafters import IID, RoundFeedback
from draftsman.drafters.recycling import RecyclingDrafter
from draftsman.drafters.recycling_trees import sampled_chain
from draftsman.verifier.sampling import SamplingParams

from test_engine_sampling import ALPHA, exact_marginals, fit_pvalue
from tiny_models import load_for_reference

VOCAB = 24


def recycling(vocab: int = VOCAB, **opts) -> RecyclingDrafter:
    drafter = RecyclingDrafter(RecyclingDrafter.Options(**opts), SimpleNamespace(device="cpu", vocab_size=vocab))
    drafter.begin([[0]], SamplingParams(0.0), torch.Generator())
    return drafter


def paths_of(tree) -> set[tuple[int, ...]]:
    """Every node's token path from the root."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def test_the_tree_reads_each_rank_from_the_matrix_and_skips_unseen_tokens():
    """60 random matrices (some tokens never seen) and templates: the tree holds exactly the
    template paths whose every step the matrix knows, each node the rank-r candidate of its
    parent's token, parents before children."""
    rng = random.Random(0)
    for trial in range(60):
        top_k = rng.randint(1, 4)
        ranks = [tuple(rng.randrange(top_k) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 12))]
        template = {p[:i] for p in ranks for i in range(1, len(p) + 1)}  # each path's parents too
        d = recycling(top_k=top_k, tree=[list(p) for p in template])
        for token in rng.sample(range(VOCAB), rng.randint(0, VOCAB)):
            d.matrix.ids[token] = torch.tensor(rng.sample(range(VOCAB), top_k), dtype=torch.int32)
        root = rng.randrange(VOCAB)
        tree = d.propose([[3, root]])[0]
        expected = set()
        for path in template:
            tokens, last = [], root
            for rank in path:
                last = int(d.matrix.ids[last, rank])
                if last < 0:
                    break
                tokens.append(last)
            if len(tokens) == len(path):
                expected.add(tuple(tokens))
        assert paths_of(tree) == expected, trial
        assert tree.size == len(expected), trial  # no two nodes share a path
        assert all(p < i for i, p in enumerate(tree.parents.tolist())), trial


def test_a_token_seen_twice_keeps_the_candidates_of_the_text_the_row_continues():
    """Token 5 is the root and also a rejected draft: the root's candidates win, whichever slot
    comes last. Between rows, a row's accepted text wins over another's rejected drafts, and
    otherwise the later row's."""
    d = recycling(top_k=2)
    block = torch.tensor([5, 7, 5, 9])  # root, then nodes 0..2: 7 and 5 under the root, 9 under 7
    top = torch.tensor([[1, 2], [3, 4], [10, 11], [12, 13]])
    d.observe(RoundFeedback([[0, 2]], [[7, 9, 6]], target_top=[(block, top, top.float())]))
    assert d.matrix.ids[5].tolist() == [1, 2] and d.matrix.ids[7].tolist() == [3, 4]
    assert d.matrix.ids[9].tolist() == [12, 13]
    d.observe(RoundFeedback([[], [], []], [[6], [2], [3]], target_top=[
        (torch.tensor([7, 5]), torch.tensor([[14, 15], [16, 17]]), torch.rand(2, 2)),
        (torch.tensor([2, 7]), torch.tensor([[18, 19], [20, 21]]), torch.rand(2, 2)),
        (torch.tensor([2]), torch.tensor([[22, 23]]), torch.tensor([[0.5, 0.25]]))]))
    assert d.matrix.ids[7].tolist() == [14, 15] and d.matrix.ids[5].tolist() == [16, 17]
    assert d.matrix.ids[2].tolist() == [22, 23]
    assert d.matrix.probs[2].tolist() == [0.5, 0.25]  # the probabilities travel with their candidates


def test_the_matrix_holds_the_targets_top_candidates_after_every_verified_token(tiny_models):
    """Each slot of each round's block (root, kept and rejected drafts) comes back with the
    target's top_k next tokens after its own context and their probabilities, checked against a
    full forward of it."""
    target = tiny_models["llama"][0]
    dec = draftsman.load({"target": {"path": str(target)},
                          "drafter": {"name": "recycling", "top_k": 3, "tree_budget": 6}})
    rounds, propose, observe = [], dec.engine.drafter.propose, dec.engine.drafter.observe

    def recording_propose(contexts):
        trees = propose(contexts)
        rounds.append((list(map(list, contexts)), trees))
        return trees

    def recording_observe(feedback):
        rounds[-1] += (feedback,)
        observe(feedback)

    dec.engine.drafter.propose, dec.engine.drafter.observe = recording_propose, recording_observe
    dec.generate(input_ids=[[1, 2, 3, 4, 1, 2, 3], [7, 8, 9]], max_new_tokens=12, temperature=0.0)
    model = load_for_reference(target)
    checked = 0
    for contexts, trees, feedback in rounds:
        for context, tree, (slot_tokens, slot_top, slot_probs) in zip(contexts, trees, feedback.target_top):
            paths: list[list[int]] = []
            for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
                paths.append((paths[parent] if parent >= 0 else []) + [token])
            assert slot_tokens.tolist() == [context[-1]] + tree.tokens.tolist()
            for slot, path in enumerate([[]] + paths):
                with torch.no_grad():
                    logits = model(torch.tensor([context + path])).logits[0, -1]
                # By value, not id: a tie may order two ids either way.
                assert torch.allclose(logits[slot_top[slot]], logits.topk(3).values, atol=1e-4), (context, path)
                assert torch.allclose(slot_probs[slot], logits.softmax(-1)[slot_top[slot]], atol=1e-5), (context, path)
                checked += 1
    assert checked > 30 and any(t.size for _, ts, _ in rounds for t in ts), checked  # drafts were verified too


def test_a_fresh_matrix_drafts_nothing_until_the_target_ranked_the_root(tiny_models):
    """Without the prompt seed, the first round of a fresh drafter has nothing to draft; the
    same request again drafts from its first round (hot start); forget_outputs empties the matrix."""
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                          "drafter": {"name": "recycling", "seed_from_prompt": False}})
    sizes, propose = [], dec.engine.drafter.propose

    def recording(contexts):
        trees = propose(contexts)
        sizes.append(trees[0].size)
        return trees

    dec.engine.drafter.propose = recording
    first_rounds = []
    for forget in (False, False, True):
        if forget:
            dec.drafter.forget_outputs()
        sizes.clear()
        dec.generate(input_ids=[[3, 4, 5, 6]], max_new_tokens=10, temperature=0.0)
        first_rounds.append(sizes[0])
        assert max(sizes[1:]) > 0  # from the second round on, the target ranked the root
    assert first_rounds[0] == 0 and first_rounds[1] > 0 and first_rounds[2] == 0, first_rounds


def test_the_prompt_seeds_tokens_the_target_has_not_ranked(tiny_models):
    """A fresh drafter's first round drafts what followed the root's last occurrence in the
    prompt, and so on down the chain; a token the target ranked keeps the target's candidates."""
    d = recycling(top_k=2, tree=[[0], [0, 0], [0, 0, 0], [1]])
    d.begin([[3, 4, 5, 3, 6, 3]], SamplingParams(0.0), torch.Generator())
    tree = d.propose([[3, 4, 5, 3, 6, 3]])[0]
    assert paths_of(tree) == {(6,), (6, 3), (6, 3, 6)}  # 3 -> 6 (its last follower), 6 -> 3; no rank 1
    d.matrix.ids[6] = torch.tensor([8, 9], dtype=torch.int32)  # the target ranked 6
    d.begin([[6, 1, 3, 2]], SamplingParams(0.0), torch.Generator())
    assert d.matrix.ids[6].tolist() == [8, 9] and d.matrix.ids[1].tolist() == [3, -1]
    assert d.matrix.ids[3].tolist() == [6, -1]  # seeded before, still unranked: the first seed stays


def test_report_counts_how_often_each_rank_is_accepted_below_an_accepted_parent():
    d = recycling(top_k=2, tree=[[0], [1], [0, 0], [0, 1], [1, 0]])
    d.matrix.ids[1] = torch.tensor([2, 3], dtype=torch.int32)
    d.matrix.ids[2] = torch.tensor([4, 5], dtype=torch.int32)
    d.matrix.ids[3] = torch.tensor([6, 7], dtype=torch.int32)
    tree = d.propose([[1]])[0]
    assert tree.tokens.tolist() == [2, 3, 4, 5, 6]
    d.observe(RoundFeedback([[0, 3]], [[2, 5, 9]], target_top=[(torch.tensor([1, 2, 3, 4, 5, 6]),
                                                                   torch.zeros(6, 2, dtype=torch.long),
                                                                   torch.zeros(6, 2))]))
    report = d.report()
    # Depth 1: both ranks tried, rank 0 right; depth 2: only below the accepted node 2, rank 1 right.
    assert report["rank_trials"] == [[1, 1], [1, 1]]
    assert report["rank_accuracy"] == [[1.0, 0.0], [0.0, 1.0]]
    rebuilt = recycling(top_k=2, tree_budget=3, rank_accuracy=[[1.0, None], [0.0, 1.0]])  # None: never tried
    assert {(0,), (0, 1)} <= set(rebuilt.template.paths) and len(rebuilt.template.paths) == 3, rebuilt.template.paths


def test_a_sampled_round_drafts_no_deeper_than_its_chain():
    """max_depth() is the round's: sampled_depth for a sampled request (adaptive speculation bets
    on depths up to it), the greedy tree's depth otherwise."""
    d = recycling(top_k=2, tree=[[0], [0, 0], [0, 0, 0]], sampled_depth=2)
    assert d.max_depth() == 3
    d.begin([[1, 2]], SamplingParams(1.0), torch.Generator())
    assert d.max_depth() == 2
    d.matrix.ids[:, 0] = torch.arange(VOCAB, dtype=torch.int32).roll(-1)  # token t -> t + 1
    d.matrix.probs[:, 0] = 0.9
    assert d.propose([[1, 2]])[0].tokens.tolist() == [3, 4]
    d.begin([[1, 2]], SamplingParams(0.0), torch.Generator())
    assert d.max_depth() == 3 and d.propose([[1, 2]])[0].tokens.tolist() == [3, 4, 5]


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"ranks in \[0, top_k=2\)"):
        recycling(top_k=2, tree=[[0], [0, 2]])
    with pytest.raises(ValueError, match=r"recycling tree: path \[1, 0\] has no parent path \[1\]"):
        recycling(tree=[[0], [1, 0]])
    with pytest.raises(ValueError, match="rank_accuracy is a list per depth"):
        recycling(rank_accuracy=[0.5, 0.2])
    with pytest.raises(ValueError, match="must be >= 1"):
        recycling(tree_budget=0)
    with pytest.raises(ValueError, match="valid options"):
        draftsman.drafters.build_drafter({"name": "recycling", "k": 4}, None)


@pytest.mark.parametrize("sampled_depth", [4, 0], ids=["sampled-chain", "tree"])
def test_sampling_with_a_warm_matrix_follows_the_target(tiny_models, sampled_depth):
    """T=0.5 (the tiny target is near uniform at T=1, where its top candidates are rarely drawn):
    a first call ranks the prompt's last token; in the second, 6000 rows draft from the matrix
    (chains drawn from its probabilities, or the greedy tree), drafts are accepted and rejected,
    and the first two tokens still follow the target's exact marginals."""
    target = tiny_models["llama"][0]
    prompt, rows = [1, 2, 3, 4, 5, 1, 2, 3], 6000
    dec = draftsman.load({"target": {"path": str(target)},
                          "drafter": {"name": "recycling", "tree_budget": 8, "sampled_depth": sampled_depth}})
    dec.generate(input_ids=[prompt], max_new_tokens=1, temperature=0.5, seed=1)  # ranks the root, in this context
    out = dec.generate(input_ids=[prompt] * rows, max_new_tokens=2, temperature=0.5, seed=2)
    accepted = sum(sum(r) for r in out.stats.accepted_per_round)
    assert 0.1 * rows < accepted < 0.9 * rows, accepted  # drafts accepted and rejected
    p1, p2 = exact_marginals(load_for_reference(target), prompt, SamplingParams(0.5), dec.engine.eos_token_ids)
    tokens = torch.tensor([t[:2] for t in out.token_ids if len(t) >= 2])
    assert fit_pvalue(torch.tensor([t[0] for t in out.token_ids]), p1) > ALPHA
    assert fit_pvalue(tokens[:, 1], p2) > ALPHA


def test_a_sampled_chain_is_drawn_from_the_q_it_carries():
    """A sampled row's chain: each step's q is the recorded probabilities of the candidates of
    the token above, ** (1 / T) and normalised, with a candidate the row may not draft left out;
    20000 first draws follow that q (chi-square); the chain ends where the matrix knows nothing."""
    d = recycling(top_k=3, sampled_depth=3)
    d.matrix.ids[4] = torch.tensor([7, 8, 9], dtype=torch.int32)
    d.matrix.probs[4] = torch.tensor([0.5, 0.3, 0.1])
    d.matrix.ids[7] = torch.tensor([4, 5, -1], dtype=torch.int32)
    d.matrix.probs[7] = torch.tensor([0.6, 0.2, 0.0])
    chain = sampled_chain(d.matrix, 4, 3, 0.5, torch.Generator().manual_seed(0))
    expected = torch.zeros(VOCAB)
    expected[[7, 8, 9]] = torch.tensor([0.25, 0.09, 0.01]) / 0.35  # p ** 2, normalised
    assert torch.allclose(chain.draft_probs[0], expected, atol=1e-6)
    assert chain.kinds.tolist() == [IID] * chain.size and chain.parents.tolist() == list(range(-1, chain.size - 1))
    banned = sampled_chain(d.matrix, 4, 1, 1.0, torch.Generator(), allowed=lambda path: path[-1] != 7)
    assert banned.tokens.tolist() != [7] and banned.draft_probs[0, 7] == 0
    assert torch.allclose(banned.draft_probs[0, [8, 9]], torch.tensor([0.75, 0.25]))
    generator = torch.Generator().manual_seed(1)
    firsts = torch.tensor([sampled_chain(d.matrix, 4, 1, 0.5, generator).tokens[0] for _ in range(20000)])
    assert fit_pvalue(firsts, expected.double()) > ALPHA
    tiny = sampled_chain(d.matrix, 4, 1, 1e-320, generator)  # p ** (1 / T) overflowed: q was NaN
    assert tiny.tokens.tolist() == [7] and tiny.draft_probs[0, 7] == 1.0 and tiny.draft_probs.sum() == 1.0
    d.matrix.ids[8] = -1
    lengths = {sampled_chain(d.matrix, 4, 3, 1.0, generator).size for _ in range(200)}
    assert 1 in lengths and 3 in lengths  # below 8 nothing is known; below 7 -> 4 -> ... it goes on


def test_benchmarks_time_each_call_with_a_fresh_matrix(tiny_models):
    """A prompt run again drafts from what its first run taught the matrix; compare and demo's
    timed calls start from a fresh one, alone and inside cascade and adaptive."""
    from draftsman.bench.runner import Ours

    plain = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": {"name": "none"}})
    prompt = [1, 2, 3, 4, 5, 6, 7]
    for spec in ({"name": "recycling"}, {"name": "recycling", "adaptive": True},
                 {"name": "cascade", "drafters": [{"name": "ngram", "min_ngram": 3}, {"name": "recycling"}]}):
        decoder = plain.with_drafter(spec)
        first = decoder.generate(input_ids=[prompt], max_new_tokens=24, temperature=0.0)
        again = decoder.generate(input_ids=[prompt], max_new_tokens=24, temperature=0.0)
        assert again.stats.tau > first.stats.tau, spec  # the second run drafts from the first
        timed = Ours("recycling", decoder).run([prompt], 24, 0.0, 0)
        assert timed.tokens == first.token_ids, spec
        if not spec.get("adaptive"):  # adaptive's choices depend on its timings
            assert timed.stats.tau == first.stats.tau, spec


def test_drafts_never_hold_an_eos_the_row_may_not_emit_yet(tiny_models):
    """Under min_new_tokens the target's EOS logit is -inf until the minimum: no tree drafts EOS
    at a depth that comes too early, while the free run from the same matrix (EOS every token's
    best candidate) does draft it."""
    target = tiny_models["llama"][0]
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "recycling", "tree_budget": 20}})
    prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12], [7, 7, 7]]
    free = dec.generate(input_ids=prompts, max_new_tokens=24, temperature=0.0).token_ids
    eos = max(set(sum(free, [])), key=lambda t: sum(t in row[:12] for row in free))
    dec.engine.eos_token_ids = {eos}
    early: dict[int, int] = {}
    propose = dec.engine.drafter.propose
    for minimum in (0, 16):
        early[minimum] = 0

        def recording(contexts, minimum=minimum):
            trees = propose(contexts)
            for context, tree in zip(contexts, trees):
                produced = len(context) - len(next(p for p in prompts if context[:len(p)] == p))
                # A node at depth d would be new token produced + d: EOS may not be one of the first 16.
                early[minimum] += sum(t == eos and produced + d <= 16 for t, d in zip(tree.tokens.tolist(),
                                                                                      tree.depths()))
            return trees

        dec.engine.drafter.propose = recording
        dec.drafter.matrix.ids.fill_(-1)
        dec.drafter.matrix.ids[:, 0] = eos  # every token's best candidate, until the target ranks it
        out = dec.generate(input_ids=prompts, max_new_tokens=24, min_new_tokens=minimum, temperature=0.0)
        assert all(len(t) >= minimum for t in out.token_ids)
    assert early[16] == 0 and early[0] > 0, early
