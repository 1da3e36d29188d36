"""Packed grammar masks (verifier/token_masks.py) against the plain way: each mask unpacked bit by
bit into a bool per token, and masked_fill. The masked logits must be equal bit for bit, in every
dtype, wherever the masks land among the rows, with logits narrower and wider than the masks."""
import random

import pytest
import torch

from draftsman.verifier.token_masks import TokenMasks


def random_masks(n: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """int32 (n, words): random bits, and words all set, all clear, and with only the sign bit."""
    words = (tokens + 31) // 32
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, words), dtype=torch.int32, generator=generator)
    bitmask[0, :2] = -1
    bitmask[-1, -2:] = 0
    bitmask[n // 2, 0] = -2 ** 31  # token 31 alone in its word
    return bitmask


def unpacked(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool (n, width), one token at a time: bit t % 32 of word t // 32; False beyond the words."""
    n, words = bitmask.shape
    out = torch.zeros(n, width, dtype=torch.bool)
    for i in range(n):
        for t in range(min(width, words * 32)):
            out[i, t] = bool((int(bitmask[i, t // 32]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 70, 130])  # as the masks' 96 tokens, narrower, wider
def test_packed_masks_mask_as_masked_fill_does(dtype, width):
    g = torch.Generator().manual_seed(width)
    masks = TokenMasks(random_masks(7, 96, g))
    logits = torch.randn(4, 5, width, generator=g).to(dtype)
    logits[0, 0, :10] = -torch.inf  # banned before, allowed or not
    logits[1, 2, 3] = -0.0
    rows = [0, 1, 2, 6, 7, 13, 19]  # runs of one, two and three rows
    out = logits.clone()
    masks.apply_(out.view(-1, width), rows)

    expected = logits.clone().view(-1, width)
    allowed = unpacked(masks.bitmask, width)
    for i, row in enumerate(rows):
        expected[row] = expected[row].masked_fill(~allowed[i], -torch.inf)
    assert out.dtype == dtype
    assert torch.equal(out.view(-1, width), expected)
    assert torch.equal(out.view(-1, width).signbit(), expected.signbit())  # -0.0 stays -0.0
    assert torch.equal(masks.allowed(width), allowed)


def test_draft_columns_take_their_tokens_masks():
    g = torch.Generator().manual_seed(1)
    masks = TokenMasks(random_masks(3, 64, g))
    columns = torch.tensor([63, 0, 31, 32, 5])  # a draft vocabulary's token ids
    logits = torch.randn(3, 5, generator=g)
    out = logits.clone()
    masks.apply_(out, [2, 0, 1], columns)
    allowed = unpacked(masks.bitmask, 64)[:, columns]
    for i, row in enumerate([2, 0, 1]):
        assert torch.equal(out[row], logits[row].masked_fill(~allowed[i], -torch.inf))
    assert torch.equal(masks.allows(columns.tolist()), allowed)


def test_bits_are_read_set_and_packed_as_llguidance_writes_them():
    g = torch.Generator().manual_seed(2)
    bitmask = random_masks(4, 64, g)
    masks = TokenMasks(bitmask.clone())
    ids = [0, 31, 32, 63, 64, 200]  # 64 and beyond: no token of these masks
    expected = unpacked(bitmask, 256)[:, ids]
    assert torch.equal(masks.allows(ids), expected)
    which = torch.tensor([True, False, True, False])
    masks.allow_(which, [31, 40, 500])  # the sign bit; one in the second word; one beyond the words
    before = unpacked(bitmask, 64)
    expected = before.clone()
    expected[0, [31, 40]] = expected[2, [31, 40]] = True
    assert torch.equal(unpacked(masks.bitmask, 64), expected)
    none = TokenMasks(torch.zeros(4, 2, dtype=torch.int32))
    none.allow_(which, [31, 40, 500])
    assert none.allowed(64).nonzero().tolist() == [[0, 31], [0, 40], [2, 31], [2, 40]]
    assert torch.equal(TokenMasks.packed(before).bitmask, bitmask)
    rng = random.Random(0)
    loose = torch.tensor([[rng.random() < 0.5 for _ in range(45)] for _ in range(3)])
    assert torch.equal(TokenMasks.packed(loose).allowed(45), loose)
