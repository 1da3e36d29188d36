"""Penalties over a verification block (verifier/block_penalties.py) equal, bit for bit, the dense
formula: each position's own (V,) table of its context, penalised with verifier/sampling.py."""
import pytest
import torch

from draftsman.verifier.block_penalties import penalize_block_counts_, penalize_block_repeats_
from draftsman.verifier.sampling import penalize_counts, penalize_repeats
from draftsman.verifier.tree import ancestors_and_depth


def dense_seen(tokens, ancestors, before):
    """(B, T, V): the committed tokens and every ancestor-or-self token, per position."""
    B, T = tokens.shape
    seen = before[:, None, :].expand(B, T, before.shape[-1]).clone()
    b, j, k = ancestors.nonzero(as_tuple=True)
    seen[b, j, tokens[b, k]] = True
    return seen


def dense_counts(tokens, ancestors, before):
    """(B, T, V): generated counts plus each ancestor's token, the root (column 0) not counted."""
    B, T = tokens.shape
    counts = before[:, None, :].expand(B, T, before.shape[-1]).clone()
    b, j, k = ancestors[:, :, 1:].nonzero(as_tuple=True)
    counts.index_put_((b, j, tokens[b, k + 1]), torch.ones_like(b, dtype=counts.dtype), accumulate=True)
    return counts


def random_block(g, B, T, V):
    """Random trees with padding (parent -1, a node on its own), over a small vocabulary so tokens
    repeat along paths and overlap the committed ones."""
    parents = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        size = int(torch.randint(1, T + 1, (1,), generator=g))
        for j in range(1, size):
            parents[b, j] = int(torch.randint(0, j, (1,), generator=g))
    tokens = torch.randint(0, V, (B, T), generator=g)
    ancestors, _ = ancestors_and_depth(parents)
    return tokens, ancestors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_block_penalties_equal_the_dense_formula(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        B, T, V = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)), 11
        tokens, ancestors = random_block(g, B, T, V)
        logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
        seen = torch.rand(B, V, generator=g) < 0.3
        generated = torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32) * (torch.rand(B, V, generator=g) < 0.4)
        penalty, presence, frequency = [1.3, 0.8][trial % 2], [0.5, -1.0, None][trial % 3], [0.25, None, 1.5][trial % 3]

        want = penalize_repeats(logits, dense_seen(tokens, ancestors, seen), penalty)
        assert torch.equal(penalize_block_repeats_(logits.clone(), tokens, ancestors, seen, penalty), want)
        want = penalize_counts(logits, dense_counts(tokens, ancestors, generated), presence, frequency)
        assert torch.equal(penalize_block_counts_(logits.clone(), tokens, ancestors, generated, presence, frequency),
                           want)


def test_each_position_sees_its_context_and_its_own_ancestors():
    """Root 0 (token 7) -> nodes 1 (3), 2 (4); node 1 -> node 3 (5). A node's logits predict the
    token after it, so its own token counts; a sibling's never does."""
    tokens = torch.tensor([[7, 3, 4, 5]])
    ancestors, _ = ancestors_and_depth(torch.tensor([[-1, 0, 0, 1]]))
    seen = torch.zeros(1, 10, dtype=torch.bool)
    seen[0, [7, 9]] = True  # the committed context (the root included)
    out = penalize_block_repeats_(torch.full((1, 4, 10), 2.0), tokens, ancestors, seen, 2.0)
    assert [(out[0, j] == 1.0).nonzero().squeeze(1).tolist() for j in range(4)] == [
        [7, 9], [3, 7, 9], [4, 7, 9], [3, 5, 7, 9]]


def test_counts_take_ancestors_but_never_the_root():
    """Root 0 (token 7) -> nodes 1 (3), 2 (3); node 1 -> node 3 (3). Generated before: token 9 once."""
    tokens = torch.tensor([[7, 3, 3, 3]])
    ancestors, _ = ancestors_and_depth(torch.tensor([[-1, 0, 0, 1]]))
    generated = torch.zeros(1, 10, dtype=torch.int32)
    generated[0, 9] = 1
    out = penalize_block_counts_(torch.zeros(1, 4, 10), tokens, ancestors, generated, None, 1.0)
    assert (-out[0, :, 3]).tolist() == [0, 1, 1, 2] and out[0, :, 7].tolist() == [0, 0, 0, 0]
    assert (-out[0, :, 9]).tolist() == [1, 1, 1, 1]


def test_float32_logits_are_penalised_in_place_others_copied():
    tokens, ancestors = torch.tensor([[1, 2]]), torch.ones(1, 2, 2, dtype=torch.bool)
    seen = torch.zeros(1, 4, dtype=torch.bool)
    logits = torch.ones(1, 2, 4)
    assert penalize_block_repeats_(logits, tokens, ancestors, seen, 2.0) is logits and logits[0, 1, 2] == 0.5
    half = torch.ones(1, 2, 4, dtype=torch.bfloat16)
    out = penalize_block_counts_(half, tokens, ancestors, seen.int(), 1.0, None)
    assert out.dtype == torch.float32 and out[0, 1, 2] == 0.0 and bool((half == 1).all())
