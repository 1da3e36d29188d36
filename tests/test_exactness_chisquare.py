"""Test 2 of the core issue: seeded chi-square tests on the real sampling code (processed_probs,
GeneratorCoin, verify_sampled), a whole batch of 2e5 rows at once, alpha = 1e-6.

The toy target is a Markov chain (next-token distribution depends on the last token), so exact
joint probabilities of the first three tokens are known in closed form."""
import pytest
import torch
from scipy.stats import chisquare

from draftsman.drafters.base import DETERMINISTIC as DET, IID, WITHOUT_REPLACEMENT as WOR
from draftsman.verifier.rejection import GeneratorCoin, verify_sampled
from draftsman.verifier.sampling import SamplingParams, draw, processed_probs
from draftsman.verifier.tree import PackedDrafts

ALPHA = 1e-6
SAMPLES = 200_000
# Root has three children; the first child has two children of its own (depth 2).
PARENTS = [-1, -1, -1, 0, 0]


class MarkovToy:
    def __init__(self, vocab: int, params: SamplingParams, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        logits = torch.randn(vocab + 1, vocab, generator=g) * 1.5  # row `vocab` = after the prompt
        draft_logits = logits + torch.randn(vocab + 1, vocab, generator=g)  # a similar, imperfect drafter
        self.target = processed_probs(logits, params)  # (V + 1, V)
        self.draft = processed_probs(draft_logits, params)

    def joint3(self) -> torch.Tensor:
        root, T = self.target[self.vocab], self.target[: self.vocab]
        return root[:, None, None] * T[:, :, None] * T[None, :, :]  # (V, V, V)


def draft_batch(toy: MarkovToy, kind: int, B: int, g: torch.Generator) -> tuple[PackedDrafts, torch.Tensor]:
    """Sample B trees of shape PARENTS; return them packed and the target probs (B, N + 1, V)."""
    V, N = toy.vocab, len(PARENTS)
    tokens = torch.zeros(B, N, dtype=torch.long)
    q_rows = torch.zeros(B, N, V)
    for i, p in enumerate(PARENTS):
        q = toy.draft[toy.vocab].expand(B, V) if p < 0 else toy.draft[tokens[:, p]]
        q_rows[:, i] = q
        if kind == DET:
            earlier = [j for j in range(i) if PARENTS[j] == p]
            masked = q.clone()
            for j in earlier:
                masked[torch.arange(B), tokens[:, j]] = -1
            tokens[:, i] = masked.argmax(-1)
        elif kind == IID:
            tokens[:, i] = draw(q, g)
        else:
            masked = q.clone()
            for j in (j for j in range(i) if PARENTS[j] == p):
                masked[torch.arange(B), tokens[:, j]] = 0
            tokens[:, i] = draw(masked, g)
    children = torch.full((N + 1, 3), -1, dtype=torch.long)
    for slot in range(N + 1):
        kids = [i for i, p in enumerate(PARENTS) if p + 1 == slot]
        children[slot, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    depth = torch.tensor([1, 1, 1, 2, 2])
    drafts = PackedDrafts(tokens, torch.full((B, N), kind), torch.ones(B, N, dtype=torch.bool),
                          q_rows, children.expand(B, N + 1, 3), depth.expand(B, N))
    target = torch.cat([toy.target[toy.vocab].expand(B, 1, V), toy.target[tokens]], dim=1)
    return drafts, target


def first_three(toy, kind, seed, transform=None) -> torch.Tensor:
    """Sample SAMPLES rounds; complete each emitted prefix to three tokens with the target."""
    g = torch.Generator().manual_seed(seed)
    drafts, target = draft_batch(toy, kind, SAMPLES, g)
    if transform is not None:
        drafts = transform(drafts)
    verdict = verify_sampled(target, drafts, GeneratorCoin(g))
    rows = torch.arange(SAMPLES)
    seq = torch.full((SAMPLES, 3), -1, dtype=torch.long)
    for d in range(2):  # accepted path (depth <= 2)
        node = verdict.accepted[:, d]
        take = verdict.num_accepted > d
        seq[take, d] = drafts.tokens[rows[take], node[take]]
    seq[rows, verdict.num_accepted] = verdict.next_token
    for d in range(1, 3):  # plain target sampling for positions the round did not reach
        missing = seq[:, d] < 0
        seq[missing, d] = draw(toy.target[seq[missing, d - 1]], g)
    return seq


def goodness_of_fit(observed_codes: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(observed_codes, minlength=expected_probs.numel()).double()
    expected = expected_probs.reshape(-1).double() * observed_codes.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token of zero target probability was emitted"
    return float(chisquare(counts[support], expected[support] * counts[support].sum() / expected[support].sum()).pvalue)


CASES = {
    "T1": SamplingParams(temperature=1.0),
    "T0.8_topk3": SamplingParams(temperature=0.8, top_k=3),
    "T1.2_topp0.9": SamplingParams(temperature=1.2, top_p=0.9),
}


@pytest.mark.parametrize("kind", [IID, WOR, DET], ids=["iid", "wor", "det"])
@pytest.mark.parametrize("case", list(CASES))
def test_first_token_vocab8(case, kind):
    toy = MarkovToy(8, CASES[case], seed=1)
    seq = first_three(toy, kind, seed=2)
    assert goodness_of_fit(seq[:, 0], toy.target[8]) > ALPHA


@pytest.mark.parametrize("kind", [IID, WOR], ids=["iid", "wor"])
@pytest.mark.parametrize("case", ["T1", "T1.2_topp0.9"])
def test_joint_first_three_tokens_vocab4(case, kind):
    toy = MarkovToy(4, CASES[case], seed=3)
    seq = first_three(toy, kind, seed=4)
    codes = seq[:, 0] * 16 + seq[:, 1] * 4 + seq[:, 2]
    assert goodness_of_fit(codes, toy.joint3()) > ALPHA


def test_chisquare_has_power_against_a_broken_drafter():
    """A drafter that reports q without its temperature (q sharpened) while sampling from the
    real q biases the output; the same test must reject it. (Treating sampled drafts as
    deterministic would not do: that is lossless, only slower.)"""
    toy = MarkovToy(4, CASES["T1"], seed=3)

    def wrong_q(d):
        sharpened = processed_probs(d.draft_probs.clamp_min(1e-30).log(), SamplingParams(temperature=0.5))
        return PackedDrafts(d.tokens, d.kinds, d.valid, sharpened, d.children, d.depth)

    seq = first_three(toy, IID, seed=4, transform=wrong_q)
    codes = seq[:, 0] * 16 + seq[:, 1] * 4 + seq[:, 2]
    assert goodness_of_fit(codes, toy.joint3()) < ALPHA
