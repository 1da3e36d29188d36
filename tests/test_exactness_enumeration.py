"""Test 1 of the core issue: the verifier's output distribution equals the target's, to 1e-12 in
total variation, by exact float64 enumeration of the real code; three deliberately broken
verifiers must fail the same check."""
import dataclasses

import pytest
import torch

from draftsman.drafters.base import DETERMINISTIC as DET, IID, WITHOUT_REPLACEMENT as WOR
from draftsman.verifier.sampling import SamplingParams

from exact_enumeration import ToyWorld, emitted_distribution, total_variation_from_target

# Tree shapes (parent of each node, -1 = root) with the kind of every node; depth <= 3, branching <= 3.
SHAPES = {
    "chain3": [-1, 0, 1],
    "star3": [-1, -1, -1],
    "fork2x2": [-1, -1, 0, 0],
    "deep_fork": [-1, -1, 0, 2],
}
KIND_SETS = {
    "det": lambda n: [DET] * n,
    "iid": lambda n: [IID] * n,
    "wor": lambda n: [WOR] * n,
}
PARAMS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7_topk2": SamplingParams(temperature=0.7, top_k=2),
    "T1.3_topp0.8": SamplingParams(temperature=1.3, top_p=0.8),
    "T1.2_minp0.3": SamplingParams(temperature=1.2, min_p=0.3),
    "T1_typical0.6": SamplingParams(temperature=1.0, typical_p=0.6),
    "T0.9_eta0.2_eps0.05": SamplingParams(temperature=0.9, eta_cutoff=0.2, epsilon_cutoff=0.05),
    "T1.1_toph0.6": SamplingParams(temperature=1.1, top_h=0.6),
    "greedy_onehot": SamplingParams(temperature=0.0),
}
VOCAB = {"chain3": 5, "star3": 6, "fork2x2": 4, "deep_fork": 4}
TOL = 1e-12


def _depth(parents):
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth)


@pytest.mark.parametrize("params", list(PARAMS), ids=list(PARAMS))
@pytest.mark.parametrize("kind", list(KIND_SETS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_verification_is_exact(shape, kind, params):
    parents = SHAPES[shape]
    # Without replacement needs as many tokens with draft mass as siblings: give WOR a full-support q.
    world = ToyWorld(VOCAB[shape], PARAMS[params], seed=hash((shape, kind)) % 1000, draft_processed=kind != "wor")
    emitted = emitted_distribution(world, parents, KIND_SETS[kind](len(parents)))
    assert abs(sum(emitted.values()) - 1.0) < TOL
    assert total_variation_from_target(world, emitted, _depth(parents) + 1) < TOL


def test_mixed_kinds_and_unprocessed_draft_are_exact():
    """WOR children whose own children are IID and deterministic; q not processed like p (its
    support differs from the top-k target's)."""
    parents, kinds = [-1, -1, 0, 0, 1], [WOR, WOR, IID, IID, DET]
    for params in (PARAMS["T0.7_topk2"], PARAMS["T1"]):
        world = ToyWorld(4, params, seed=7, draft_processed=False)
        emitted = emitted_distribution(world, parents, kinds)
        assert total_variation_from_target(world, emitted, 3) < TOL


def test_empty_tree_is_plain_sampling():
    world = ToyWorld(6, PARAMS["T1.3_topp0.8"], seed=3)
    emitted = emitted_distribution(world, [], [])
    assert total_variation_from_target(world, emitted, 1) < TOL


# ---- Deliberately broken verifiers: each must be caught -------------------------------------

def iid_treated_as_without_replacement(drafts):
    return dataclasses.replace(drafts, kinds=torch.where(drafts.kinds == IID, WOR, drafts.kinds))


def duplicate_iid_children_merged(drafts):
    children = drafts.children.clone()
    for slot in range(children.shape[1]):
        seen, kept = set(), []
        for c in children[0, slot].tolist():
            if c < 0:
                continue
            tok = int(drafts.tokens[0, c])
            if tok not in seen:
                kept.append(c)
            seen.add(tok)
        children[0, slot] = -1
        children[0, slot, : len(kept)] = torch.tensor(kept, dtype=torch.long)
    return dataclasses.replace(drafts, children=children)


def iid_children_resorted_by_draft_score(drafts):
    children = drafts.children.clone()
    for slot in range(children.shape[1]):
        kids = [c for c in children[0, slot].tolist() if c >= 0]
        score = {c: float(drafts.draft_probs[0, c, drafts.tokens[0, c]]) for c in kids}
        kids.sort(key=lambda c: -score[c])
        children[0, slot, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    return dataclasses.replace(drafts, children=children)


BROKEN = [iid_treated_as_without_replacement, duplicate_iid_children_merged, iid_children_resorted_by_draft_score]


@pytest.mark.parametrize("broken", BROKEN, ids=[b.__name__ for b in BROKEN])
def test_broken_verifiers_are_caught(broken):
    """Each broken variant must miss exactness by far more than the tolerance on IID siblings."""
    worst = 0.0
    for shape in ("star3", "fork2x2"):
        for params in ("T1", "T1.3_topp0.8"):
            parents = SHAPES[shape]
            world = ToyWorld(VOCAB[shape], PARAMS[params], seed=11)
            emitted = emitted_distribution(world, parents, [IID] * len(parents), transform=broken)
            worst = max(worst, total_variation_from_target(world, emitted, _depth(parents) + 1))
    assert worst > 1e-3, f"{broken.__name__} was not caught (TV {worst:.2e})"
