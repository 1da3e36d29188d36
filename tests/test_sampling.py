"""The target distribution is made exactly as Hugging Face's sampler makes it."""
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from draftsman.verifier.sampling import SamplingParams, penalize_counts, penalize_repeats, processed_probs, sample_from


def hf_probs(logits, p: SamplingParams):
    scores = TemperatureLogitsWarper(p.temperature)(None, logits.clone())
    if p.top_k is not None:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p is not None:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p is not None:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8),
                                    SamplingParams(0.9, top_k=20, top_p=0.5), SamplingParams(2.0, top_k=1),
                                    SamplingParams(1.0, min_p=0.1), SamplingParams(1.5, min_p=1.0),
                                    SamplingParams(0.8, top_k=20, top_p=0.9, min_p=0.05)])
def test_processed_probs_match_hf_warpers(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    logits[:, 10] = logits[:, 11]  # ties at the top-k boundary are kept, as in HF
    assert torch.allclose(processed_probs(logits, params), hf_probs(logits, params), atol=1e-6)


def test_greedy_is_one_hot_on_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert processed_probs(logits, SamplingParams(0.0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_sample_from_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, 5)
    u = torch.tensor([0.0, 0.25, 0.5, 0.999999, 1.0 - 1e-16], dtype=torch.float64)
    assert set(sample_from(probs, u).tolist()) <= {1, 3}


def test_bad_sampling_values_are_named():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(1.0, top_k=0)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(1.0, min_p=1.5)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(1.0, min_p=-0.1)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(1.0, repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\]"):
        SamplingParams(1.0, presence_penalty=3.0)
    with pytest.raises(ValueError, match=r"frequency_penalty must be in \[-2, 2\]"):
        SamplingParams(1.0, frequency_penalty=-2.5)


def test_presence_and_frequency_penalties_subtract_per_generated_token():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    counts = torch.tensor([[0, 1, 3, 0]])
    got = penalize_counts(logits, counts, presence=0.5, frequency=0.25)
    assert torch.allclose(got, torch.tensor([[1.0, 2.0 - 0.25 - 0.5, 3.0 - 0.75 - 0.5, 4.0]]))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(penalty):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g) * 2
    context = torch.randint(0, 30, (4, 12), generator=g)
    seen = torch.zeros(4, 30, dtype=torch.bool).scatter_(1, context, True)
    want = RepetitionPenaltyLogitsProcessor(penalty)(context, logits.clone())
    assert torch.equal(penalize_repeats(logits, seen, penalty), want)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = processed_probs(probs.log(), SamplingParams(1.0, min_p=0.3)) > 0  # threshold 0.15
    assert kept.tolist() == [[True, True, True, False]]
    assert torch.equal(processed_probs(probs.log(), SamplingParams(1.0, min_p=0.0)),
                       processed_probs(probs.log(), SamplingParams(1.0)))


def test_greedy_chain_path_equals_the_tree_walk():
    """verify_greedy_chains (the engine's path for greedy chain rounds) gives exactly what the
    general tree walk gives, on random chains of ragged lengths over a small vocabulary."""
    from draftsman.drafters.base import DraftTree
    from draftsman.verifier.rejection import verify_greedy, verify_greedy_chains
    from draftsman.verifier.tree import pack_drafts, verification_block

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(0, 5, (6,), generator=g).tolist()
        trees = [DraftTree.chain(torch.randint(0, 3, (n,), generator=g)) for n in lengths]
        roots = torch.randint(0, 3, (6,), generator=g)
        block = verification_block(roots, trees, "cpu", chains=True)
        argmax = torch.randint(0, 3, block.tokens.shape, generator=g)
        walk = verify_greedy(argmax, pack_drafts(trees, 3, "cpu"))
        fast = verify_greedy_chains(argmax, block.tokens[:, 1:], block.valid[:, 1:])
        assert torch.equal(walk.num_accepted, fast.num_accepted)
        assert torch.equal(walk.next_token, fast.next_token)
        for b, n in enumerate(walk.num_accepted.tolist()):
            assert walk.accepted[b, :n].tolist() == fast.accepted[b, :n].tolist() == list(range(n))
