"""The target distribution is made exactly as Hugging Face's sampler makes it."""
import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from draftsman.verifier.sampling import (SORT_CANDIDATES, SamplingParams, penalize_counts, penalize_repeats,
                                         processed_logprobs, processed_probs, sample_from)


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
    assert_same_up_to_ties(processed_probs(logits, params), hf_probs(logits, params), logits)


def assert_same_up_to_ties(ours, hf, logits, most_rows_tied: int = 2):
    """Equal, except in a row where tokens of equal score straddle top-p's boundary: Hugging Face
    leaves them in torch.sort's unspecified order, draftsman ranks the lower id first. There both
    keep as many tokens, with the same probabilities, and differ only among the tied ones."""
    tied = 0
    for row in range(ours.shape[0]):
        kept, hf_kept = ours[row] > 0, hf[row] > 0
        if torch.equal(kept, hf_kept):
            assert torch.allclose(ours[row], hf[row], atol=1e-6), row
            continue
        tied += 1
        differ = (kept ^ hf_kept).nonzero().flatten()
        assert kept.sum() == hf_kept.sum() and logits[row, differ].unique().numel() == 1, row
        assert differ[kept[differ]].max() < differ[hf_kept[differ]].min(), row  # the lower ids kept
        assert torch.allclose(ours[row].sort().values, hf[row].sort().values, atol=1e-6), row
    assert tied <= most_rows_tied


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_top_p_over_a_large_vocabulary_keeps_what_hf_keeps(top_p):
    """Over more tokens than top-p's candidates (SORT_CANDIDATES), rows whose likeliest tokens
    hold top_p of the mass sort only those, the others the whole vocabulary: both keep exactly the
    tokens Hugging Face's TopPLogitsWarper keeps (after top-k too), with its probabilities."""
    g = torch.Generator().manual_seed(2)
    vocab = 4 * SORT_CANDIDATES
    peaked = torch.randn(24, vocab, generator=g) * 4  # the likeliest 1024 hold nearly all the mass
    flat = torch.randn(24, vocab, generator=g) * 0.3  # they hold about a third
    logits = torch.cat([peaked, flat])[torch.randperm(48, generator=g)]
    mass = logits.softmax(-1).topk(SORT_CANDIDATES, -1).values.sum(-1)
    assert (mass >= top_p).sum() >= 20 and (mass < top_p).sum() >= 20  # both ways are taken
    for params in (SamplingParams(1.0, top_p=top_p), SamplingParams(0.7, top_k=2000, top_p=top_p)):
        ours, hf = processed_probs(logits, params), hf_probs(logits, params)
        assert torch.equal(ours > 0, hf > 0), params
        assert torch.allclose(ours, hf, atol=1e-6), params
        # A row warps alone as in a batch (plain decoding warps one position, the verifier a tree's).
        assert all(torch.equal(processed_probs(logits[r:r + 1], params)[0], ours[r]) for r in range(0, 48, 7))


@pytest.mark.parametrize("candidates", ["default", "whole vocabulary", "too few"])
def test_top_p_ranks_tied_tokens_by_id_on_every_path(candidates, monkeypatch):
    """Where top-p's boundary falls among tokens of equal score, the lower ids are kept: ranking
    the likeliest candidates, the whole vocabulary, or falling back to it when the candidates hold
    too little of the mass; alone or in a batch."""
    from draftsman.verifier import sampling

    vocab = 4 * SORT_CANDIDATES
    monkeypatch.setattr(sampling, "SORT_CANDIDATES", {"default": SORT_CANDIDATES, "whole vocabulary": vocab,
                                                       "too few": 2}[candidates])
    logits = torch.full((1, vocab), -6.0)
    logits[0, 4000] = 3.0
    logits[0, [3000, 7, 2048, 512, 100]] = 2.0  # tied
    probs = logits.softmax(-1)[0]
    top_p = float(probs[4000] + 1.5 * probs[7])  # the top token and two of the five tied ones
    got = processed_probs(logits, SamplingParams(1.0, top_p=top_p))
    assert (got[0] > 0).nonzero().flatten().tolist() == [7, 100, 4000]
    batch = torch.cat([torch.randn(3, vocab), logits])
    assert torch.equal(processed_probs(batch, SamplingParams(1.0, top_p=top_p))[3], got[0])


def test_top_p_ranks_a_tied_block_past_the_candidates_by_id():
    """3000 tokens of equal score, more than top-p's candidates: torch.topk picks which of them
    are candidates in no set order, so a boundary among them is found over the whole vocabulary,
    keeping the lowest ids."""
    g = torch.Generator().manual_seed(3)
    vocab = 4 * SORT_CANDIDATES
    logits = torch.full((1, vocab), -6.0)
    tied = torch.randperm(vocab, generator=g)[:3000]
    logits[0, tied] = 2.0
    probs = logits.softmax(-1)[0]
    got = processed_probs(logits, SamplingParams(1.0, top_p=float(500.5 * probs[tied[0]])))
    assert (got[0] > 0).nonzero().flatten().tolist() == tied.sort().values[:501].tolist()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(1.0, top_k=5), SamplingParams(1.0, top_p=0.8),
                                    SamplingParams(1.0, min_p=0.1), SamplingParams(1.0, typical_p=0.9),
                                    SamplingParams(1.0, epsilon_cutoff=3e-4), SamplingParams(1.0, eta_cutoff=3e-4),
                                    SamplingParams(1.0, top_h=0.5)])
def test_warping_at_temperature_one_leaves_the_callers_logits_alone(params):
    """At T=1 the scores start as the caller's logits themselves (no division): no warper may write
    into them, and both functions give what they give at a temperature that divides."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    before = logits.clone()
    probs, logprobs = processed_probs(logits, params), processed_logprobs(logits, params)
    assert torch.equal(logits, before)
    nearly_one = dataclasses.replace(params, temperature=1.0 + 1e-7)  # divides; the same warps
    assert torch.allclose(probs, processed_probs(logits, nearly_one), atol=1e-5)
    assert torch.allclose(logprobs.exp(), processed_probs(logits, nearly_one), atol=1e-5)


def test_greedy_is_one_hot_on_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert processed_probs(logits, SamplingParams(0.0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_sample_from_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, 5)
    u = torch.tensor([0.0, 0.25, 0.5, 0.999999, 1.0 - 1e-16], dtype=torch.float64)
    assert sample_from(probs, u).tolist() == [1, 1, 3, 3, 3]  # the last: u rounds to 1 in float32
    # A tail too small to move the float32 CDF: u * total reaching the total picks a token with mass.
    tail = torch.tensor([[0.0, 1.0, 1e-12, 0.0]])
    assert sample_from(tail, torch.tensor([1.0 - 1e-16], dtype=torch.float64)).tolist() == [1]


def test_bad_sampling_values_are_named():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(1.0, top_k=-2)  # (0 and -1 are vLLM's "every token")
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
