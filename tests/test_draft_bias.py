"""Drafting under logit_bias (drafters/draft_bias.py): model drafters add the request's bias to
their own logits before any penalty, as the engine adds it to the target's, so a draft model that
is the target itself is accepted whole, no drafter drafts a banned token, and output stays the
target's own."""
from collections import Counter

import pytest
import torch

import draftsman
from draftsman.drafters.draft_bias import DraftBias
from draftsman.drafters.repeats import DraftContext

from toy_drafters import watching_proposals

PROMPTS = [[5, 6, 7, 8], [9], [1, 2, 3, 1, 2, 3], [40, 41]]
NEW = 20


def test_the_bias_lands_on_the_drafters_own_columns():
    logits = torch.zeros(2, 3, 5)
    full = DraftBias(((1, 2.0), (3, -100.0), (4, -1.0), (7, -100.0)), width=5, vocab_map=None, device="cpu")
    out = full.apply(logits)  # -100, the floor, is a ban in drafts; 7 is past the logits
    assert out[0, 0].tolist() == [0.0, 2.0, 0.0, -torch.inf, -1.0] and out.eq(out[:1, :1]).all()
    assert logits.eq(0).all()  # a new tensor: the caller's logits are left as they were
    vocab_map = torch.tensor([9, 4, 2, 7, 3])  # draft row -> token id; 8 is not in the draft vocabulary
    reduced = DraftBias(((2, 1.5), (7, -3.0), (8, 5.0), (9, 0.5)), width=5, vocab_map=vocab_map, device="cpu")
    assert reduced.columns.tolist() == [0, 2, 3] and reduced.values.tolist() == [0.5, 1.5, -3.0]
    assert reduced.apply(torch.zeros(4, 5))[0].tolist() == [0.5, 0.0, 1.5, -3.0, 0.0]
    nothing = DraftBias(((8, 5.0),), width=5, vocab_map=vocab_map, device="cpu")
    assert nothing.apply(logits) is logits


def _without_the_draft_bias(monkeypatch):
    monkeypatch.setattr(DraftContext, "biased", lambda self, sampling, logits, vocab_map, rows=None: logits)


def _drafted(dec, prompts, **kwargs) -> tuple[Counter, list[Counter], object]:
    """(every drafted token, per round the root's children, the output) of one request."""
    everything, children = Counter(), []

    def watch(contexts, trees):
        for tree in trees:
            everything.update(tree.tokens.tolist())
            children.append(Counter(t for t, d in zip(tree.tokens.tolist(), tree.depths()) if d == 1))

    with watching_proposals(dec, watch):
        out = dec.generate(input_ids=prompts, max_new_tokens=NEW, **kwargs)
    return everything, children, out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("options", [{"k": 4}, {"k": 4, "top_k": 3, "total_tokens": 30}], ids=["chain", "tree"])
def test_the_target_drafting_for_itself_is_accepted_under_a_bias(tiny_models, options, temperature, monkeypatch):
    """The target as its own draft model, its favourite draft token banned, another favoured, and a
    repetition penalty that the draft model applies too (penalise_drafts): output equals plain
    decoding's; a chain of the target's own choices, biased then penalised as the target's are,
    is always accepted, greedy or sampled (q = p). Drafting from unbiased logits is accepted less;
    so is biasing after the penalty (the favoured token is one the context holds)."""
    if temperature and "top_k" in options:
        pytest.skip("a top-k tree is a greedy-only option")
    # Sampled, 16 rows: the unaware drafts below then meet 6-15 rejections (seeds 0-15 on this
    # CPU), where 4 rows met as few as one; CUDA's random stream differs from the CPU's.
    prompts = PROMPTS * 4 if temperature else PROMPTS
    target = str(tiny_models["llama"][0])
    drafter = {"name": "draft_model", "path": target, "penalise_drafts": True, **options}
    dec = draftsman.load({"target": {"path": target}, "drafter": drafter,
                          "sampling": {"temperature": temperature, "repetition_penalty": 1.3}})
    everything, _, unbiased = _drafted(dec, prompts, seed=3)
    banned = everything.most_common(1)[0][0]
    favoured = Counter(t for row in unbiased.token_ids for t in row if t != banned).most_common(1)[0][0]
    bias = {banned: -100, favoured: 2.5}
    everything, _, out = _drafted(dec, prompts, seed=3, logit_bias=bias)
    assert banned not in everything and out.token_ids != unbiased.token_ids
    if temperature == 0:
        plain = dec.with_drafter({"name": "none"}).generate(input_ids=prompts, max_new_tokens=NEW, logit_bias=bias)
        assert out.token_ids == plain.token_ids
    if "top_k" not in options:  # every draft accepted whole: 20 tokens in 4 rounds, unless a row drew EOS
        assert _rejections(out) == 0 and all(r[-1] == 4 for r in out.stats.accepted_per_round), \
            out.stats.accepted_per_round
    _without_the_draft_bias(monkeypatch)
    everything, _, unaware = _drafted(dec, prompts, seed=3, logit_bias=bias)
    assert banned in everything
    if temperature:
        assert _rejections(unaware) > 0, unaware.stats.accepted_per_round
        return
    assert unaware.token_ids == out.token_ids
    # A tree keeps its best nodes by path probability, which on this near-uniform random target are
    # not all on the greedy path: a banned node displaces a sibling only, so the margin is smaller.
    margin = 0.0 if "top_k" in options else 0.5
    assert out.stats.tau > unaware.stats.tau + margin, (out.stats.accepted_per_round, unaware.stats.accepted_per_round)


def _rejections(out, k: int = 4) -> int:
    """Rounds, a row's last one aside, that accepted fewer than the chain's k drafts."""
    return sum(1 for rounds in out.stats.accepted_per_round for accepted in rounds[:-1] if accepted < k)


DRAFTERS = {"eagle": {"name": "eagle", "depth": 4, "top_k": 3, "total_tokens": 12},
            "eagle3": {"name": "eagle", "depth": 4, "top_k": 3, "total_tokens": 12},
            "mtp": {"name": "mtp", "depth": 3},
            "medusa": {"name": "medusa"},
            "draft_model": {"name": "draft_model", "k": 4},
            "draft_model_tree": {"name": "draft_model", "k": 4, "top_k": 3, "total_tokens": 12}}


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_drafter_drafts_no_banned_token_and_the_favoured_one_first(name, fresh_heads, tiny_models,
                                                                      monkeypatch):
    """Every model drafter, greedy: the token it drafts most is never drafted once banned (and
    is, unaware of the bias); a token pushed by +100 is every round's first child of the root.
    Output equals plain decoding's under the same bias at batch 1 and 4."""
    target, draft = tiny_models["llama"]
    path = draft if name.startswith("draft_model") else fresh_heads / name
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {**DRAFTERS[name], "path": str(path)}})
    everything, _, _ = _drafted(dec, PROMPTS)
    banned = everything.most_common(1)[0][0]
    # One it (almost) never drafts, and not EOS (which would end every row at once).
    favoured = min(set(range(60)) - dec.engine.eos_token_ids, key=lambda t: (everything[t], t))
    expected = dec.with_drafter({"name": "none"})
    for bias in ({banned: -100}, {favoured: 100}):
        everything, children, out = _drafted(dec, PROMPTS, logit_bias=bias)
        want = expected.generate(input_ids=PROMPTS, max_new_tokens=NEW, logit_bias=bias).token_ids
        assert out.token_ids == want
        for b, prompt in enumerate(PROMPTS):
            assert dec.generate(input_ids=[prompt], max_new_tokens=NEW, logit_bias=bias).token_ids[0] == want[b]
        if favoured in bias:
            drafting = [c for c in children if c]
            assert len(drafting) >= 4 and all(c[favoured] for c in drafting), children
        else:
            assert banned not in everything
    _without_the_draft_bias(monkeypatch)
    assert banned in _drafted(dec, PROMPTS, logit_bias={banned: -100})[0]


@pytest.mark.parametrize("name", ["eagle3", "medusa", "draft_model_tree"])
def test_one_token_bad_words_are_not_drafted(name, fresh_heads, tiny_models):
    """A one-token bad word is banned from drafts as a -100 bias is (it could only be rejected);
    output equals plain decoding's under the same words. A longer word is left to the verifier."""
    from draftsman.drafters.repeats import draft_biases
    from draftsman.verifier.sampling import SamplingParams

    target, draft = tiny_models["llama"]
    path = draft if name.startswith("draft_model") else fresh_heads / name
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {**DRAFTERS[name], "path": str(path)}})
    banned = _drafted(dec, PROMPTS)[0].most_common(1)[0][0]
    words = [[banned], [banned + 1, banned + 2]]
    everything, _, out = _drafted(dec, PROMPTS, bad_words_ids=words)
    assert banned not in everything
    want = dec.with_drafter({"name": "none"}).generate(input_ids=PROMPTS, max_new_tokens=NEW, bad_words_ids=words)
    assert out.token_ids == want.token_ids
    both = SamplingParams(0.0, logit_bias={3: 2.0, banned: 5.0}, bad_words_ids=words)
    assert draft_biases(both) == tuple(sorted({3: 2.0, banned: -100.0}.items()))  # the ban wins over a bias


@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp", "draft_model"])
def test_a_sampled_chain_is_drawn_from_the_biased_distribution(name, fresh_heads, tiny_models, monkeypatch):
    """At T=1 a chain token is drawn from the drafter's biased distribution, and that is its q:
    a banned token holds no mass worth the name, and q is still a distribution. Unaware of the
    bias the same drafters put mass on it."""
    target, draft = tiny_models["llama"]
    path = draft if name == "draft_model" else fresh_heads / name
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {**DRAFTERS[name], "path": str(path)},
                          "sampling": {"temperature": 1.0}})
    banned = _drafted(dec, PROMPTS, seed=3)[0].most_common(1)[0][0]

    def banned_mass() -> tuple[float, float]:
        mass, off = [0.0], [0.0]

        def watch(contexts, trees):
            for tree in trees:
                if tree.size:
                    mass[0] += float(tree.draft_probs[:, banned].sum())
                    off[0] = max([off[0], *(tree.draft_probs.sum(-1) - 1).abs().tolist()])

        with watching_proposals(dec, watch):
            dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, seed=3, logit_bias={banned: -100})
        return mass[0], off[0]

    mass, off = banned_mass()
    assert mass < 1e-30 and off < 1e-5
    _without_the_draft_bias(monkeypatch)
    assert banned_mass()[0] > 1e-3


@pytest.mark.parametrize("bias, drafted", [
    (None, [7, 4, 9, 8]),
    ({9: -100}, [7, 4]),  # the continuation ends before the banned token
    ({7: -100}, []),
    ({9: -99.5, 4: 5.0}, [7, 4, 9, 8]),  # only the floor bans
])
def test_ngram_ends_a_continuation_before_a_banned_token(bias, drafted):
    """ngram's trees are deterministic, so it cuts a continuation at a token the request bans."""
    from draftsman.drafters.ngram import NgramDrafter
    from draftsman.verifier.sampling import SamplingParams

    prompt = [1, 2, 3, 7, 4, 9, 8, 1, 2, 3]
    ngram = NgramDrafter(NgramDrafter.Options(k=4, branches=1))
    ngram.begin([prompt], SamplingParams(0.0, logit_bias=bias), torch.Generator())
    assert ngram.propose([prompt])[0].tokens.tolist() == drafted


def test_ngram_under_a_ban_equals_plain_decoding(tiny_models):
    """A prompt that repeats itself, the token ngram would copy next banned: output equals plain
    decoding's under the same bias at batch 1 and 4, and no draft holds the banned token."""
    target = str(tiny_models["llama"][0])
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "ngram", "k": 4}})
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [1, 2, 3, 1, 2, 3], [40, 41, 40, 41, 40]]
    for bias in ({7: -100, 10: -100, 41: -100, 2: -100}, {3: -100, 11: -100}):
        everything, _, out = _drafted(dec, prompts, logit_bias=bias)
        assert sum(everything.values()) >= 4 and not set(bias) & set(everything), everything
        want = dec.with_drafter({"name": "none"}).generate(input_ids=prompts, max_new_tokens=NEW, logit_bias=bias)
        assert out.token_ids == want.token_ids
        for b, prompt in enumerate(prompts):
            alone = dec.generate(input_ids=[prompt], max_new_tokens=NEW, logit_bias=bias)
            assert alone.token_ids[0] == want.token_ids[b]
