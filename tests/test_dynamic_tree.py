"""The EAGLE-2 dynamic tree's early stop (drafters/dynamic_tree.py) on a drafter whose confidences
are known: growth stops once no frontier node can enter the kept set, and the tree is the one
the full expansion keeps."""
import pytest
import torch

from draftsman.drafters.dynamic_tree import dynamic_tree

VOCAB = 10
CHILD = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))  # every node's next-token distribution


class SlotCount:
    """All dynamic_tree reads of the drafter's cache: how many slots the grown levels hold."""
    num_slots = 0


def _draft(total_tokens, min_confidence=0.0, depth=5):
    grown, cache = [], SlotCount()

    def grow(states, tokens, depth, visible):
        grown.append(depth)
        cache.num_slots += tokens.shape[1]
        return None, CHILD.clamp(min=1e-9).log().expand(*tokens.shape, VOCAB).clone()

    root = torch.tensor([[0.5, 0.5] + [0.0] * (VOCAB - 2)]).clamp(min=1e-9).log()
    [tree] = dynamic_tree(cache, grow, root, None, depth, 2, total_tokens, [True],
                          min_confidence=min_confidence)
    return tree, grown


def _path_confidence(tree):
    root = [0.5, 0.5]
    out = []
    for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        out.append(root[token] if parent < 0 else out[parent] * CHILD[token].item())
    return out


def test_growth_stops_once_no_frontier_node_can_be_kept():
    full, grown = _draft(total_tokens=10_000)
    assert grown == [1, 2, 3, 4]
    # Best three: the two depth-1 nodes (0.5) and a 0.3 child; depth-3 nodes score 0.18 at best.
    tree, grown = _draft(total_tokens=3)
    assert grown == [1, 2]  # depth 3 would add nodes below the third best: not grown
    assert _path_confidence(tree) == pytest.approx([0.5, 0.5, 0.3]) and tree.parents.tolist() == [-1, -1, 0]
    # With room for 7, the 0.18 nodes count: growth goes one level further.
    tree, grown = _draft(total_tokens=7)
    assert grown == [1, 2, 3]
    assert sorted(_path_confidence(tree), reverse=True) == pytest.approx([0.5, 0.5, 0.3, 0.3, 0.18, 0.18, 0.15])


def test_min_confidence_stops_growth_and_drops_nodes_below_it():
    tree, grown = _draft(total_tokens=10_000, min_confidence=0.16)
    assert grown == [1, 2, 3]  # depth-4 nodes score 0.108 at best: their children are not grown
    assert sorted(_path_confidence(tree), reverse=True) == pytest.approx([0.5, 0.5, 0.3, 0.3, 0.18, 0.18])
    tree, grown = _draft(total_tokens=10_000, min_confidence=0.9)
    assert grown == [] and tree.size == 1  # nothing reaches it: the best node alone
