"""Sampling settings per row: requests with their own temperature, top_p, top_k, ... (the warpers,
verifier/sampling.py's WARPER_FIELDS) generate as one batch (how `draftsman serve` batches them,
also when they join a running batch). Each row is verified against its own distribution, so it is
exact as it is alone, whatever the drafter drafted under (the settings most rows have)."""
import threading

import pytest
import torch

import draftsman
from draftsman.drafters.base import DETERMINISTIC as DET, IID, WITHOUT_REPLACEMENT as WOR
from draftsman.verifier.sampling import RowSampling, SamplingParams, processed_logprobs, processed_probs
from exact_enumeration import ToyWorld, emitted_distribution, total_variation_from_target
from test_engine_sampling import ALPHA, fit_pvalue
from test_row_min_new_tokens import SAMPLED_PROMPT, close_draft, drafters  # noqa: F401 (a fixture)
from tiny_models import load_for_reference

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12], [7, 7, 7]]
NEW = 12
MIX = [SamplingParams(0.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8),
       SamplingParams(1.0, min_p=0.2), SamplingParams(0.0), SamplingParams(1.1, typical_p=0.7, epsilon_cutoff=0.01),
       SamplingParams(0.9, top_h=0.5), SamplingParams(0.7, top_k=3)]


def test_each_row_is_warped_by_its_own_settings():
    logits = torch.randn(len(MIX), 3, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    rows = RowSampling(MIX)
    probs, logprobs = processed_probs(logits, rows), processed_logprobs(logits, rows)
    for i, params in enumerate(MIX):
        assert torch.equal(probs[i], processed_probs(logits[i], params)), i
        assert torch.equal(logprobs[i], processed_logprobs(logits[i], params)), i
    assert not rows.greedy and RowSampling([SamplingParams(0.0)] * 3).greedy
    assert len(rows.groups) == len(set(MIX)) == 6  # one warp per distinct setting
    # Rows that differ in a penalty or a bias alone (already in their logits) share one warp call.
    alike = RowSampling([SamplingParams(0.7, top_k=3, presence_penalty=0.5), SamplingParams(0.7, top_k=3),
                         SamplingParams(0.7, top_k=3, logit_bias={4: -100.0}), SamplingParams(0.0)])
    assert list(alike.groups.values()) == [[0, 1, 2], [3]]
    assert torch.equal(processed_probs(logits[:4], alike), torch.stack([processed_probs(logits[i], params)
                                                                        for i, params in enumerate(alike.rows)]))


@pytest.mark.parametrize("row, drafted, kind", [
    (SamplingParams(0.7, top_k=2), SamplingParams(1.0), IID),  # the drafter samples hotter, wider
    (SamplingParams(1.3, top_p=0.8), SamplingParams(0.5), WOR),
    (SamplingParams(1.0), SamplingParams(0.0), DET),  # a sampled row beside greedy rows
    (SamplingParams(0.0), SamplingParams(1.0), IID),  # a greedy row beside sampled rows
], ids=["topk-row-T1-drafts", "topp-row-cold-drafts", "T1-row-greedy-drafts", "greedy-row-T1-drafts"])
def test_a_row_is_exact_under_its_own_settings_whatever_the_drafts_were_drawn_under(row, drafted, kind):
    """Float64 enumeration of every outcome of the real verifier: the draft tree drawn under the
    drafter's settings, the row verified under its own; the emitted tokens, completed by the
    row's own sampling, are distributed exactly as the row's own decoding."""
    parents = [-1, -1, 0, 0]
    world = ToyWorld(4, row, seed=5, draft_params=drafted)
    emitted = emitted_distribution(world, parents, [kind] * len(parents))
    assert abs(sum(emitted.values()) - 1.0) < 1e-12
    assert total_variation_from_target(world, emitted, 3) < 1e-12


@pytest.fixture(scope="module")
def greedy_alone(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    return decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0).token_ids


@pytest.mark.parametrize("temperatures", [[0.0, 1.0, 0.0, 0.8], [1.0, 0.0, 1.0, 1.0]],
                         ids=["greedy-drafter", "sampling-drafter"])
@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "draft_model_tree", "medusa", "eagle3", "mtp",
                                  "cascade"])
def test_greedy_rows_beside_sampled_rows_make_their_own_greedy_output(tiny_models, close_draft, fresh_heads,  # noqa: F811
                                                                      greedy_alone, name, temperatures):
    """Greedy rows in a batch with sampled rows (top_p on one of them) make exactly what they make
    alone, whether the drafter drafts greedily (most rows greedy; ties go to the first row) or
    samples; the sampled rows sample."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": drafters(tiny_models, close_draft, fresh_heads)[name]})
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=temperatures,
                           top_p=[None, None, None, 0.9], seed=3)
    for i, t in enumerate(temperatures):
        if t == 0.0:
            assert out.token_ids[i] == greedy_alone[i], f"{name}: row {i}"
    assert any(out.token_ids[i] != greedy_alone[i] for i, t in enumerate(temperatures) if t > 0), name


def first_token_distribution(target, params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        logits = load_for_reference(target)(input_ids=torch.tensor([SAMPLED_PROMPT])).logits[0, -1].double()
    return processed_probs(logits, params)


ROWS_EACH = 1500
COLD = SamplingParams(0.6, top_k=4)


def assert_follow(target, first_tokens: list[int], params: SamplingParams, other: SamplingParams) -> None:
    """The first tokens follow params' distribution (chi-square), and the test could tell it
    from other's."""
    sample = torch.tensor(first_tokens)
    assert fit_pvalue(sample, first_token_distribution(target, params)) > ALPHA
    wrong = first_token_distribution(target, other)
    assert (wrong[sample] == 0).any() or fit_pvalue(sample, wrong) < ALPHA


@pytest.mark.parametrize("pattern", [[SamplingParams(1.0), COLD, SamplingParams(0.0)],
                                     [SamplingParams(0.0), COLD, SamplingParams(1.0), SamplingParams(0.0)]],
                         ids=["T1-drafter", "greedy-drafter"])
def test_sampled_rows_each_follow_their_own_distribution(tiny_models, close_draft, pattern):  # noqa: F811
    """One batch, rows at T=1, at T=0.6 with top_k 4 and greedy, interleaved; a draft model close
    to the target drafts (q != p) under the first pattern's settings. Each group's first tokens
    follow its own distribution, greedy rows take the argmax, and drafts were verified."""
    target = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(close_draft), "k": 3}})
    rows = pattern * ROWS_EACH
    out, stats = decoder.engine.generate([SAMPLED_PROMPT] * len(rows), 2, rows, seed=7)
    assert stats.tau > 1.01 and decoder.engine.drafter.sampling == pattern[0]  # the most rows' (ties: the first)
    by_setting = {params: [t[0] for t, p in zip(out, rows) if p == params] for params in pattern}
    assert_follow(target, by_setting[SamplingParams(1.0)], SamplingParams(1.0), COLD)
    assert_follow(target, by_setting[COLD], COLD, SamplingParams(1.0))
    argmax = int(first_token_distribution(target, SamplingParams(1.0)).argmax())
    assert set(by_setting[SamplingParams(0.0)]) == {argmax}


def test_logprobs_are_each_rows_own_processed_distribution(tiny_models):
    """logprobs="processed" reads each row's own warped distribution: top_k 2 leaves two tokens
    to list in that row only (a ruled-out one is left out)."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    out = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=8, temperature=1.0, top_k=[None, 2],
                           logprobs="processed", top_logprobs=3, seed=1)
    wide, narrow = out.top_logprobs
    assert all(top[2][1] > float("-inf") for top in wide)
    assert all(len(top) == 2 and top[1][1] > float("-inf") for top in narrow)


def test_joining_rows_bring_their_own_warpers(tiny_models, close_draft):  # noqa: F811
    """stream_batch's joining takes a sixth element, the row's warpers: a greedy row that joins a
    sampled batch makes its greedy output; sampled rows that join a greedy batch follow their own
    distribution."""
    target = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(close_draft), "k": 3}})
    greedy = decoder.generate(input_ids=[PROMPTS[1]], max_new_tokens=NEW, temperature=0.0).token_ids[0]
    rounds, tokens = [0], {}

    def joining():
        rounds[0] += 1
        return [(PROMPTS[1], NEW, None, None, None, {"temperature": 0.0})] if rounds[0] == 2 else []

    for row, chunk in decoder.stream_batch([PROMPTS[0]], joining=joining, max_new_tokens=NEW, temperature=1.0,
                                           seed=2):
        tokens.setdefault(row, []).extend(chunk.token_ids)
    assert tokens[1] == greedy

    rounds[0], tokens = 0, {}

    def sampled_joining():
        rounds[0] += 1
        return [(SAMPLED_PROMPT, 2, None, None, None, {"temperature": 0.6, "top_k": 4})] * ROWS_EACH \
            if rounds[0] == 2 else []

    stats = draftsman.GenerationStats()
    for row, chunk in decoder.stream_batch([PROMPTS[0]], joining=sampled_joining, max_new_tokens=NEW,
                                           temperature=0.0, seed=2, stats=stats):
        tokens.setdefault(row, []).extend(chunk.token_ids)
    assert sum(sum(stats.accepted_per_round[r]) for r in range(1, ROWS_EACH + 1)) > 0  # joined rows took drafts
    assert tokens[0] == decoder.generate(input_ids=[PROMPTS[0]], max_new_tokens=NEW, temperature=0.0).token_ids[0]
    assert_follow(target, [tokens[r][0] for r in range(1, ROWS_EACH + 1)], COLD, SamplingParams(1.0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=[0.5]), "per-prompt sampling settings (temperature, top_p, ...) has 1 values for 2 prompts"),
    (dict(temperature=[0.5, 1.0], top_p=[0.9]), "per-prompt settings ['temperature', 'top_p'] have [1, 2] values"),
    (dict(lossy_typical_acceptance=[True, False]),
     "lossy_typical_acceptance takes one value for all prompts; only ['temperature'"),
    (dict(temperature=[0.5, 1.0], lossy_typical_acceptance=True),
     "lossy_typical_acceptance takes one sampling setting for the whole batch"),
    (dict(temperature=[1.0, 0.0], num_return_sequences=2), "num_return_sequences=2 at temperature 0 (prompt 1)"),
    (dict(temperature=[1.0, -1.0]), "temperature must be >= 0"),
])
def test_bad_settings_per_prompt_are_named(tiny_models, kwargs, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError) as error:
        decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=4, **kwargs)
    assert message in str(error.value)


def test_check_join_names_bad_warpers(tiny_models):
    """What serve asks before a request joins a running batch: its warpers are checked too."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    decoder.check_join(PROMPTS[:1], temperature=0.7, top_p=0.9, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences=2 at temperature 0 would give identical rows"):
        decoder.check_join(PROMPTS[:1], temperature=0.0, num_return_sequences=2)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        decoder.check_join(PROMPTS[:1], top_p=1.5)
    with pytest.raises(TypeError, match=r"unknown settings \['lossy_typical_acceptance'\]"):
        decoder.check_join(PROMPTS[:1], lossy_typical_acceptance=True)


def test_rows_that_differ_beyond_the_warpers_are_refused(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    rows = [SamplingParams(1.0), SamplingParams(0.5, lossy_typical_acceptance=True, logit_bias={5: 1.0})]
    with pytest.raises(ValueError, match=r"rows of one batch differ in \['lossy_typical_acceptance'\]"):
        decoder.engine.generate(PROMPTS[:2], 4, rows)
    with pytest.raises(ValueError, match="sampling has 2 settings for 3 rows"):
        decoder.engine.generate(PROMPTS[:3], 4, rows[:1] * 2)
    with pytest.raises(ValueError, match=r"differ in \['lossy_typical_acceptance'\]"):  # a joining row too
        list(decoder.engine.stream(PROMPTS[:1], 4, SamplingParams(1.0),
                                   joining=lambda: [(PROMPTS[1], 4, None, None, None,
                                                     SamplingParams(1.0, lossy_typical_acceptance=True))]))


def test_requests_with_their_own_temperature_share_a_serve_batch(chat_target):
    """temperature, top_p, ... are a row's own: a sampled request joins a running greedy batch, a
    greedy one with n 2 is refused alone (its rows would be identical), and each request's rows
    are what they are alone."""
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, slowed, start_long_stream
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    sampled, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]),
                                     {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "min_new_tokens": 8})
    assert rows == 2 and long_job.stats is None  # it ran beside the long greedy row
    assert len(sampled.token_ids[0]) == 8
    with pytest.raises(ValueError, match="num_return_sequences=2 at temperature 0"):
        batcher.generate(decoder.encode(SERVE_PROMPTS[2:3]), {"max_new_tokens": 8, "temperature": 0.0,
                                                              "num_return_sequences": 2})
    got += [chunk for _, chunk in chunks]
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]


def test_a_mixed_request_after_another_on_the_same_rows_uses_its_own_settings(tiny_models, greedy_alone):
    """The engine keeps a mixed batch's settings while its rows stay: a second request whose rows
    are numbered as the first's last round (plain decoding, rows ending together) must not take
    them. Its greedy row is the lone greedy output."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=NEW, temperature=[0.0, 1.3], ignore_eos=True, seed=1)
    out = decoder.generate(input_ids=[PROMPTS[0], PROMPTS[1]], max_new_tokens=NEW, temperature=[1.3, 0.0],
                           ignore_eos=True, seed=1)
    assert out.token_ids[1] == greedy_alone[1]
