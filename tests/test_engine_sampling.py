"""The whole engine at temperature > 0 (real tiny Llama, real drafters, one big ragged batch):
the first two emitted tokens follow the target's exact marginals (chi-square, alpha = 1e-6), and
a seeded run is reproducible."""
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)

import draftsman
from draftsman.verifier.sampling import SamplingParams, processed_probs

from tiny_models import load_for_reference, perturbed_copy, target_device

ALPHA = 1e-6
ROWS = 6000
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]


def exact_marginals(model, prompt, params, eos_ids):
    """p(x1), and p(x2 | x1 is not EOS) = sum over non-EOS x1 of p(x1) p(x2 | x1), renormalised
    (a row that emitted EOS first has no second token)."""
    def penalised(input_ids, logits):  # Hugging Face's own processors, as generate() runs them
        if params.penalizes_repeats:
            logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, logits)
        if params.bans_repeated_ngrams:
            logits = NoRepeatNGramLogitsProcessor(params.no_repeat_ngram_size)(input_ids, logits)
        if params.bans_words:
            logits = NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids])(input_ids, logits)
        return logits

    with torch.no_grad():
        first = torch.tensor([prompt])
        p1 = processed_probs(penalised(first, model(input_ids=first).logits[:, -1].double())[0], params)
        cont = p1.clone()
        cont[list(eos_ids)] = 0
        support = cont.nonzero().squeeze(1)
        batch = torch.cat([torch.tensor([prompt]).expand(len(support), -1), support[:, None]], dim=1)
        p2_given = processed_probs(penalised(batch, model(input_ids=batch).logits[:, -1].double()), params)
    p2 = (cont[support, None] * p2_given).sum(0)
    return p1, p2 / p2.sum()


def assert_sampled_marginals_fit(dec, target_folder, prompt, temperature, rows=3000, seed=5):
    """Sample `rows` copies of prompt through dec (3 new tokens): drafts were accepted (so the
    rejection path ran), and the first and second emitted tokens fit the target's exact marginals."""
    out = dec.generate(input_ids=[prompt] * rows, max_new_tokens=3, temperature=temperature, seed=seed)
    assert out.stats.tau > 1.0
    p1, p2 = exact_marginals(load_for_reference(target_folder), prompt, SamplingParams(temperature),
                             dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    assert fit_pvalue(first, p1) > 1e-6 and fit_pvalue(second, p2) > 1e-6


def fit_pvalue(samples, probs):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs * samples.numel()
    assert counts[probs == 0].sum() == 0, "emitted a token the target gives zero probability"
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.fixture(scope="module")
def medium_draft(tiny_models, tmp_path_factory):
    return perturbed_copy(tiny_models["llama"][0], tmp_path_factory.mktemp("medium"), noise=0.3)


SETTINGS = {"T1": SamplingParams(1.0), "T0.9_topk20_topp0.9": SamplingParams(0.9, top_k=20, top_p=0.9),
            "T1_minp0.2": SamplingParams(1.0, min_p=0.2),
            "T0.8_repetition1.5": SamplingParams(0.8, repetition_penalty=1.5),
            "T1_typical0.5_eta0.01": SamplingParams(1.0, typical_p=0.5, eta_cutoff=0.01),
            "T1_no_repeat1": SamplingParams(1.0, no_repeat_ngram_size=1),
            "T1_bad_words": SamplingParams(1.0, bad_words_ids=[[t] for t in range(10, 40)] + [[3, 5], [6, 7]])}
# Every setting with each way a round is verified: the plain path, a sampled chain, a deterministic
# tree. The draft model's confidence cut and int8 weights change q, not how a setting processes it:
# they run with the plain setting and two that reshape both p and q (the suite's time is spent here).
CASES = [(setting, drafter) for setting in SETTINGS for drafter in ("none", "draft_model", "ngram")] + \
        [(setting, drafter) for setting in ("T1", "T0.9_topk20_topp0.9", "T1_bad_words")
         for drafter in ("draft_model_confidence", "draft_model_int8")]


@pytest.mark.parametrize("setting, drafter", CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_first_two_tokens_follow_the_target(setting, drafter, tiny_models, medium_draft):
    params = SETTINGS[setting]
    target = tiny_models["llama"][0]
    cfg = {"name": "ngram", "k": 3, "branches": 2} if drafter == "ngram" else \
          {"name": "draft_model", "path": str(medium_draft), "k": 3}
    if drafter == "draft_model_confidence":  # chains cut where the draft model was unsure
        cfg["min_confidence"] = 0.3
    if drafter == "draft_model_int8":  # q is what the int8 model computed, not the float32 model's
        cfg["quantize"] = "int8"
    if drafter == "none":  # every round takes the engine's plain path (verify_plain)
        cfg = {"name": "none"}
    dec = draftsman.load({"target": {"path": str(target), "device": target_device(cfg)}, "drafter": cfg})
    out = dec.generate(input_ids=[PROMPT] * ROWS, max_new_tokens=2, temperature=params.temperature,
                       top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                       repetition_penalty=params.repetition_penalty, typical_p=params.typical_p,
                       eta_cutoff=params.eta_cutoff, no_repeat_ngram_size=params.no_repeat_ngram_size,
                       bad_words_ids=params.bad_words_ids, seed=123)
    tokens = torch.tensor([t[:2] for t in out.token_ids if len(t) >= 2])
    assert len(tokens) > 0.9 * ROWS  # rows ending at EOS after one token are rare here
    p1, p2 = exact_marginals(load_for_reference(target), PROMPT, params, dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert fit_pvalue(first, p1) > ALPHA
    assert fit_pvalue(tokens[:, 1], p2) > ALPHA
    if params.no_repeat_ngram_size or params.bad_words_ids:  # power: the banned tokens carry mass without the ban
        unbanned, _ = exact_marginals(load_for_reference(target), PROMPT, SamplingParams(params.temperature),
                                      dec.engine.eos_token_ids)
        assert unbanned[p1 == 0].sum() * ROWS > 100
    if params.min_p or params.typical_p:  # the check has power: the samples do not fit the unwarped target
        unfiltered, _ = exact_marginals(load_for_reference(target), PROMPT, SamplingParams(params.temperature),
                                        dec.engine.eos_token_ids)
        assert (p1 == 0).sum() > 10 and fit_pvalue(first, unfiltered) < ALPHA
    if drafter.startswith("draft_model"):  # with 2 new tokens, tau = 1 + acceptance of the first draft
        assert out.stats.tau > 1.01, "both accept and reject paths must be exercised"


def test_seeded_runs_are_reproducible(tiny_models, medium_draft):
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                          "drafter": {"name": "draft_model", "path": str(medium_draft), "k": 3}})
    a = dec.generate(input_ids=[PROMPT, PROMPT[:3]], max_new_tokens=20, temperature=1.0, seed=5)
    b = dec.generate(input_ids=[PROMPT, PROMPT[:3]], max_new_tokens=20, temperature=1.0, seed=5)
    c = dec.generate(input_ids=[PROMPT, PROMPT[:3]], max_new_tokens=20, temperature=1.0, seed=6)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_a_tiny_temperature_samples_the_argmax(tiny_models, medium_draft, temperature):
    """logits / T overflowed float32 below about 1e-37: the softmax was NaN and the sampler drew id V,
    outside the vocabulary (an IndexError in the next step). At such a temperature the distribution
    is the argmax (ties shared), and the output is greedy decoding's, drafts accepted or not."""
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0, float("-inf")]])
    for dtype in (torch.float32, torch.float64):
        probs = processed_probs(logits.to(dtype), SamplingParams(temperature=temperature, top_p=0.9))
        assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0, 0.0]]
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                          "drafter": {"name": "draft_model", "path": str(medium_draft), "k": 3}})
    greedy = dec.generate(input_ids=[PROMPT, PROMPT[:3]], max_new_tokens=12)
    tiny = dec.generate(input_ids=[PROMPT, PROMPT[:3]], max_new_tokens=12, temperature=temperature, seed=3,
                        logprobs="processed")
    assert tiny.token_ids == greedy.token_ids and tiny.stats.tau > 1.0
    assert all(value == 0.0 for row in tiny.logprobs for value in row)  # each token drawn with probability 1


def test_kept_hidden_states_are_each_rows_kept_slots():
    """The drafter is fed, per row, the target's states at exactly the slots it kept (the root and
    its accepted path, in order), whatever the other rows kept."""
    import torch

    from draftsman.verifier.engine import SpeculativeEngine

    engine = object.__new__(SpeculativeEngine)
    engine.device = torch.device("cpu")
    hidden = {2: torch.randn(3, 6, 4), 5: torch.randn(3, 6, 4)}
    for keep in ([[0], [0], [0]], [[0, 1, 2], [0, 1, 2], [0, 1, 2]], [[0, 2, 5], [0], [0, 1]], [[], [], []]):
        kept = engine._kept_hidden(hidden, keep)
        for row, slots in enumerate(keep):
            assert set(kept[row]) == (set(hidden) if slots else set())
            for layer, h in kept[row].items():
                assert torch.equal(h, hidden[layer][row, slots])
    assert engine._kept_hidden({}, [[0]]) == []


@pytest.mark.parametrize("drafter", ["none", "draft_model", "ngram"])
def test_presence_and_frequency_penalties_when_sampling(drafter, tiny_models):
    """The second token repeats the first with the exact penalised probability: presence -1.5 and
    frequency -0.5 make a repeat about e^2 times likelier, and only the first token counts (the
    prompt does not). Binomial test on 6000 rows; the unpenalised probability must fail it. The
    draft model is the target itself: its first draft is almost always accepted, so the second
    token is verified at that node, counting it as an ancestor."""
    from scipy.stats import binomtest

    target = tiny_models["llama"][0]
    cfg = {"name": "ngram", "k": 3, "branches": 2} if drafter == "ngram" else \
          {"name": "draft_model", "path": str(target), "k": 3} if drafter == "draft_model" else {"name": "none"}
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": cfg})
    out = dec.generate(input_ids=[PROMPT] * ROWS, max_new_tokens=2, temperature=1.0, presence_penalty=-1.5,
                       frequency_penalty=-0.5, seed=321)
    rows = [t for t in out.token_ids if len(t) == 2]
    repeats = sum(t[0] == t[1] for t in rows)
    model = load_for_reference(target)
    with torch.no_grad():
        p1 = processed_probs(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].double(), SamplingParams(1.0))
        p1[list(dec.engine.eos_token_ids)] = 0
        support = p1.nonzero().squeeze(1)
        batch = torch.cat([torch.tensor([PROMPT]).expand(len(support), -1), support[:, None]], dim=1)
        logits2 = model(input_ids=batch).logits[:, -1].double()
    rows_idx = torch.arange(len(support))
    def repeat_probability(boost):
        boosted = logits2.clone()
        boosted[rows_idx, support] += boost
        p2 = boosted.softmax(-1)[rows_idx, support]
        return float((p1[support] * p2).sum() / p1[support].sum())
    exact, unpenalised = repeat_probability(1.5 + 0.5), repeat_probability(0.0)
    assert binomtest(repeats, len(rows), exact).pvalue > ALPHA, (repeats, len(rows), exact)
    assert binomtest(repeats, len(rows), unpenalised).pvalue < ALPHA, (repeats, len(rows), unpenalised)


@pytest.mark.parametrize("drafter", ["none", "draft_model", "ngram"])
def test_min_new_tokens_when_sampling(drafter, tiny_models, medium_draft):
    """min_new_tokens = max_new_tokens = 2 with EOS set to the target's likeliest first token: no
    row ends early, and both tokens follow the target's marginals with EOS masked (EOS gets
    probability 0 and the rest renormalises, as Hugging Face's MinNewTokensLengthLogitsProcessor
    does). The same samples must not fit the unmasked first-token distribution."""
    target = tiny_models["llama"][0]
    cfg = {"name": "ngram", "k": 3, "branches": 2} if drafter == "ngram" else \
          {"name": "draft_model", "path": str(medium_draft), "k": 3} if drafter == "draft_model" else {"name": "none"}
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": cfg})
    model = load_for_reference(target)
    with torch.no_grad():
        p1 = processed_probs(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].double(), SamplingParams(1.0))
    eos = int(p1.argmax())
    dec.engine.eos_token_ids = {eos}
    out = dec.generate(input_ids=[PROMPT] * ROWS, max_new_tokens=2, min_new_tokens=2, temperature=1.0, seed=7)
    assert all(len(t) == 2 and eos not in t for t in out.token_ids)
    masked1 = p1.clone()
    masked1[eos] = 0
    masked1 /= masked1.sum()
    support = masked1.nonzero().squeeze(1)
    with torch.no_grad():
        batch = torch.cat([torch.tensor([PROMPT]).expand(len(support), -1), support[:, None]], dim=1)
        p2_given = processed_probs(model(input_ids=batch).logits[:, -1].double(), SamplingParams(1.0))
    p2_given[:, eos] = 0
    p2 = (masked1[support, None] * p2_given / p2_given.sum(-1, keepdim=True)).sum(0)
    tokens = torch.tensor(out.token_ids)
    assert fit_pvalue(tokens[:, 0], masked1) > ALPHA
    assert fit_pvalue(tokens[:, 1], p2) > ALPHA
    assert p1[eos] > 0.02 and fit_pvalue(tokens[:, 0], p1) < ALPHA  # the test has power
    if drafter == "draft_model":
        assert out.stats.tau > 1.01
