"""Unit tests of the drafter side: the tree format, n-gram lookup, the registry."""
from dataclasses import dataclass

import pytest
import torch

import draftsman
from draftsman.drafters import DETERMINISTIC, IID, Drafter, DraftTree, available, register
from draftsman.drafters.ngram import NgramDrafter
from draftsman.verifier.sampling import SamplingParams


def ngram(**opts):
    d = NgramDrafter(NgramDrafter.Options(**opts))
    return d


def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    d = ngram(k=3, branches=1, min_ngram=1, max_ngram=3)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    d.begin([ctx], SamplingParams(), torch.Generator())
    (tree,) = d.propose([ctx])
    assert tree.tokens.tolist() == [7, 8, 5]  # the later of the two [1, 2, 3] matches
    assert tree.parents.tolist() == [-1, 0, 1]
    assert bool((tree.kinds == DETERMINISTIC).all())


def test_ngram_branches_merge_into_a_trie():
    d = ngram(k=3, branches=3, min_ngram=1, max_ngram=2)
    ctx = [4, 1, 2, 6, 4, 1, 2, 7, 4, 1, 5, 4, 1]
    d.begin([ctx], SamplingParams(), torch.Generator())
    (tree,) = d.propose([ctx])
    # [4, 1] was followed by [5, 4, 1], [2, 7, 4] and [2, 6, 4]: a trie with a shared '2' branch.
    assert tree.tokens.tolist() == [5, 4, 1, 2, 7, 4, 6, 4]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3, 4, 3, 6]


def test_ngram_without_a_match_proposes_nothing_and_updates_incrementally():
    d = ngram(k=2, min_ngram=2, max_ngram=2)
    ctx = [1, 2, 3]
    d.begin([ctx], SamplingParams(), torch.Generator())
    assert d.propose([ctx])[0].size == 0
    ctx = ctx + [1, 2]  # the engine appends emitted tokens; the index catches up
    assert d.propose([ctx])[0].tokens.tolist() == [3, 1]


def test_ngram_bad_options_are_named():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramDrafter.Options(min_ngram=3, max_ngram=2)


def test_tree_validation_and_depth_truncation():
    with pytest.raises(ValueError, match="parent index"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="need draft_probs"):
        DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.tensor([IID]))
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, -1, 1]), torch.zeros(4, dtype=torch.long))
    assert tree.depths() == [1, 2, 1, 3]
    cut = tree.truncated_to_depth(2)
    assert cut.tokens.tolist() == [5, 6, 7] and cut.parents.tolist() == [-1, 0, -1]
    assert tree.truncated_to_depth(0).size == 0


def test_chains_are_told_from_trees():
    """The engine's greedy chain path must never get a branching tree (it would accept a sibling
    as if it were the next token)."""
    assert DraftTree.chain([4, 5, 6]).is_chain() and DraftTree.empty().is_chain()
    branching = DraftTree(torch.tensor([4, 5, 6]), torch.tensor([-1, 0, 0]), torch.zeros(3, dtype=torch.long))
    two_roots = DraftTree(torch.tensor([4, 5]), torch.tensor([-1, -1]), torch.zeros(2, dtype=torch.long))
    assert not branching.is_chain() and not two_roots.is_chain()


def test_a_new_drafter_is_one_class_and_one_registration(tiny_models):
    @register
    class RepeatLast(Drafter):
        """Proposes the last token again, k times (a toy, for this test)."""
        name = "repeat_last_test"

        @dataclass
        class Options:
            k: int = 2

        def __init__(self, options, target):
            self.k = options.k

        def propose(self, contexts):
            return [DraftTree.chain([c[-1]] * self.k) for c in contexts]

    assert "repeat_last_test" in available()
    target = str(tiny_models["llama"][0])
    plain = draftsman.load({"target": {"path": target}}).generate(input_ids=[[3, 3, 3]], max_new_tokens=12)
    mine = draftsman.load({"target": {"path": target}, "drafter": {"name": "repeat_last_test", "k": 3}}).generate(
        input_ids=[[3, 3, 3]], max_new_tokens=12)
    assert mine.token_ids == plain.token_ids


def test_hidden_states_of_the_accepted_path_reach_the_drafter(tiny_models):
    """A drafter that declares it needs the target's last hidden state gets, after each round,
    those of the root and the accepted nodes, equal to a plain forward over the committed text."""
    from draftsman.drafters import TargetNeeds
    from tiny_models import load_for_reference

    seen = []

    @register
    class Recorder(Drafter):
        name = "hidden_recorder_test"
        needs = TargetNeeds(hidden_state_layers=(-1,))

        @dataclass
        class Options:
            pass

        def __init__(self, options, target):
            pass

        def propose(self, contexts):
            self.contexts = [list(c) for c in contexts]
            return [DraftTree.chain([c[-1], c[-1]]) for c in contexts]

        def observe(self, feedback):
            seen.append((self.contexts[0], feedback.emitted[0], feedback.target_hidden[0][-1]))

    target = tiny_models["llama"][0]
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "hidden_recorder_test"}})
    dec.generate(input_ids=[[3, 3, 3, 3]], max_new_tokens=10)
    model = load_for_reference(target).to(dec.device)
    for context, emitted, hidden in seen:
        # Kept slots: the root (last context token) and the accepted drafts (all but the last emitted).
        fed = context + emitted[:-1]
        with torch.no_grad():
            ids = torch.tensor([fed], device=dec.device)
            full = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        assert hidden.shape[0] == len(emitted)
        assert torch.allclose(hidden, full[len(context) - 1:], atol=1e-4)


def test_stream_yields_the_same_text_as_generate(tiny_models):
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                          "drafter": {"name": "draft_model", "path": str(tiny_models["llama"][1]), "k": 3}})
    for temperature in (0.0, 1.0):
        full = dec.generate(["def parse("], max_new_tokens=30, temperature=temperature, seed=3)
        stats = draftsman.GenerationStats()
        pieces = list(dec.stream("def parse(", max_new_tokens=30, temperature=temperature, seed=3, stats=stats))
        assert "".join(pieces) == full.texts[0]
        assert len(pieces) > 1 and stats.new_tokens == len(full.token_ids[0])


def test_draft_model_tree_keeps_only_nodes_of_enough_path_confidence(tiny_models):
    """With top_k > 1, draft_model's min_confidence bounds the tree by path confidence: every node
    kept has a product of the draft model's probabilities along its path (recomputed here with a
    plain forward) of at least the bound, and unsure rows keep fewer nodes."""
    from tiny_models import load_for_reference

    path = tiny_models["llama"][1]
    contexts = [[5, 6, 7, 8, 9, 10], [1, 2, 3], [7, 7, 7, 7]]
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                          "drafter": {"name": "draft_model", "path": str(path), "k": 4, "top_k": 3,
                                      "total_tokens": 8, "min_confidence": 0.02}})
    drafter, model = dec.drafter, load_for_reference(path)
    drafter.begin(contexts, SamplingParams(0.0), torch.Generator())
    trees = drafter.propose(contexts)
    for context, tree in zip(contexts, trees):
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for i in range(tree.size):
            nodes = []
            while i >= 0:
                nodes.insert(0, i)
                i = parents[i]
            sequence = context + [tokens[n] for n in nodes]
            with torch.no_grad():
                probs = model(input_ids=torch.tensor([sequence])).logits[0].double().softmax(-1)
            confidence = 1.0
            for j in range(len(context), len(sequence)):
                confidence *= float(probs[j - 1, sequence[j]])
            assert confidence >= 0.02 * (1 - 1e-4), (context, nodes, confidence)
    assert min(tree.size for tree in trees) < 8  # the bound cut some row's tree
