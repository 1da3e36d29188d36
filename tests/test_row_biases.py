"""logit_bias per row: rows with their own logit_bias share one batch (generate's lists,
stream_batch's joining rows, serve's requests). A bias depends on no context, so each row's is
added to its own logits only (verifier/sampling.py's RowBiases) and each row generates what it
generates alone; drafters bias each row's drafts by its own (drafters/draft_bias.py)."""
import threading
from types import SimpleNamespace

import pytest
import torch

import draftsman
from draftsman import JoiningPrompt
from draftsman.drafters.draft_bias import DraftBias, RowDraftBias
from draftsman.drafters.path_bans import PathBans
from draftsman.drafters.repeats import DraftContext
from draftsman.verifier.sampling import RowSampling, SamplingParams, processed_probs, row_biases
from row_settings import (DRAFTERS, NEW, assert_joining_rows_bring_their_own, assert_logprobs_are_each_rows_own,
                          lone_and_batched)
from test_engine_sampling import ALPHA, fit_pvalue
from test_row_drafts import assert_all_accepted, self_drafting
from test_row_min_new_tokens import SAMPLED_PROMPT, close_draft, drafters  # noqa: F401 (a fixture)
from test_row_sampling import PROMPTS
from tiny_models import load_for_reference



def biases_of(plain: list[list[int]]) -> list[dict | None]:
    """One bias per row, each one that changes its row: a ban on its first greedy token; none (the
    row is plain decoding); a ban and a favoured token; a strong favour of another row's token."""
    return [{plain[0][0]: -100.0}, None, {plain[2][1]: -100.0, plain[0][3]: 2.0}, {plain[1][0]: 6.0, 3: -1.5}]


def test_row_biases_add_each_rows_own_as_alone():
    """RowBiases gives each row exactly the logits its own bias gives it alone, in float32, bfloat16
    and float64, and leaves a row without one bit-identical."""
    g = torch.Generator().manual_seed(0)
    rows = [SamplingParams(0.0, logit_bias={3: 2.5, 7: -100.0}), SamplingParams(0.0),
            SamplingParams(1.0, logit_bias={3: -0.75, 9: 1.25}), SamplingParams(0.0, logit_bias={3: 2.5, 7: -100.0})]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        logits = torch.randn(4, 5, 12, generator=g).to(dtype)
        together = row_biases(RowSampling(rows), logits.device).add_(logits.clone())
        for b, params in enumerate(rows):
            alone = logits[b:b + 1].clone()
            bias = row_biases(params, logits.device)
            alone = alone if bias is None else bias.add_(alone)
            assert torch.equal(together[b], alone[0]), (dtype, b)
        assert torch.equal(together[1], logits[1])
    same = RowSampling([SamplingParams(0.0, logit_bias={3: 1.0}), SamplingParams(0.5, logit_bias={3: 1.0})])
    assert row_biases(same, "cpu").rows is None  # one bias for all: added as one
    assert row_biases(RowSampling([SamplingParams(0.0), SamplingParams(0.5)]), "cpu") is None


@pytest.mark.parametrize("name", DRAFTERS)
def test_rows_with_their_own_biases_each_generate_as_alone(tiny_models, fresh_heads, plain, name,
                                                          close_draft):  # noqa: F811
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": drafters(tiny_models, close_draft, fresh_heads)[name]})
    biases = biases_of(plain)
    lone, batched = lone_and_batched(decoder, [dict(logit_bias=bias) for bias in biases], dict(logit_bias=biases), NEW)
    assert batched == lone, name
    assert all(a != b for r, (a, b) in enumerate(zip(plain, lone)) if r != 1)  # each bias mattered
    assert batched[1] == plain[1]  # the row without one is plain decoding


def test_logprobs_are_each_rows_own(tiny_models, plain):
    """processed logprobs read each row's biased distribution (a banned token at -inf in its row
    only); raw ones the target's own, before any row's bias, as alone."""
    biases = biases_of(plain)
    assert_logprobs_are_each_rows_own(tiny_models["llama"][0], [dict(logit_bias=bias) for bias in biases],
                                      dict(logit_bias=biases))


def biased_first_token_distribution(target, params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        logits = load_for_reference(target)(input_ids=torch.tensor([SAMPLED_PROMPT])).logits[0, -1].double()
    for token, bias in params.logit_bias or ():
        logits[token] = -torch.inf if bias <= -100 else logits[token] + bias
    return processed_probs(logits, params)


def test_sampled_rows_each_follow_their_own_biased_distribution(tiny_models, close_draft):  # noqa: F811
    """T=1, one batch, rows without a bias beside rows that ban the target's likeliest first token
    and favour another; a draft model close to the target drafts (q != p). Each half's first
    tokens follow its own distribution, and the test tells them apart."""
    target = tiny_models["llama"][0]
    p = biased_first_token_distribution(target, SamplingParams(1.0))
    top = p.topk(3).indices.tolist()
    rows = [SamplingParams(1.0), SamplingParams(1.0, logit_bias={top[0]: -100.0, top[2]: 1.5})] * 1500
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(close_draft), "k": 3}})
    out, stats = decoder.engine.generate([SAMPLED_PROMPT] * len(rows), 2, rows, seed=7)
    assert stats.tau > 1.01
    for own, other in ((rows[0], rows[1]), (rows[1], rows[0])):
        sample = torch.tensor([t[0] for t, params in zip(out, rows) if params == own])
        assert fit_pvalue(sample, biased_first_token_distribution(target, own)) > ALPHA
        wrong = biased_first_token_distribution(target, other)
        assert (wrong[sample] == 0).any() or fit_pvalue(sample, wrong) < ALPHA


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_row_drafts_under_its_own_bias(tiny_models, plain, temperature):
    """The target drafting for itself, each row's drafts biased by its own: every row accepts
    (almost) every draft. Drafts biased by one row's bias for all would be rejected where the
    biases differ. Rows leave at different times, so the drafts' biases follow the rows."""
    target = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(target)}, "drafter": self_drafting(target)})
    limits = [NEW, 8, NEW, 12]
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=limits, temperature=temperature, seed=3, ignore_eos=True,
                           logit_bias=biases_of(plain))
    assert [len(t) for t in out.token_ids] == limits
    assert_all_accepted(out.stats)


def test_draft_biases_per_row_equal_each_row_alone():
    """RowDraftBias over (B, K, width) logits, with and without a draft vocabulary, equals each
    row's DraftBias alone; DraftContext.biased takes a RowSampling's rows in order."""
    g = torch.Generator().manual_seed(1)
    biases = [((2, 1.5), (5, -100.0)), (), ((2, -0.5), (9, 3.0)), ((2, 1.5), (5, -100.0))]
    for vocab_map in (None, torch.tensor([9, 2, 4, 5, 0, 1])):
        width = 12 if vocab_map is None else 6
        logits = torch.randn(4, 3, width, generator=g)
        together = RowDraftBias(biases, width, vocab_map, "cpu").apply(logits)
        for b, row in enumerate(biases):
            alone = DraftBias(row, width, vocab_map, "cpu").apply(logits[b]) if row else logits[b]
            assert torch.equal(together[b], alone), (vocab_map, b)
    rows = RowSampling([SamplingParams(0.0, logit_bias=dict(row)) if row else SamplingParams(0.0) for row in biases])
    context = DraftContext([[1], [1], [1], [1]], 12, "cpu")
    logits = torch.randn(4, 12, generator=g)
    assert torch.equal(context.biased(rows, logits, None), RowDraftBias(biases, 12, None, "cpu").apply(logits))
    some = torch.tensor([2, 0])  # rows a drafter drafts for (medusa: the rows with a hidden state)
    assert torch.equal(context.biased(rows, logits[some], None, rows=some), context.biased(rows, logits, None)[some])
    shared = RowSampling([SamplingParams(0.0, logit_bias={2: 1.0}), SamplingParams(0.5, logit_bias={2: 1.0})])
    two = logits[:2]
    assert torch.equal(context.biased(shared, two, None), DraftBias(((2, 1.0),), 12, None, "cpu").apply(two))


@pytest.mark.parametrize("name", ["ngram", "retrieval", "suffix", "recycling"])
def test_copying_drafters_end_each_rows_continuations_before_its_own_bans(name):
    """PathBans(everywhere=True): each row's banned tokens (bias -100, not a milder one); `ngram` and `retrieval`
    drafts never hold a row's own banned token, and still draft it for the row that does not ban it."""
    rows = RowSampling([SamplingParams(0.0, logit_bias={7: -100.0, 8: -3.0}), SamplingParams(0.0)])
    own = PathBans(everywhere=True).round(rows, [[1], [1]])
    assert [own.banned(b, []) for b in range(2)] == [{7}, set()]
    shared = PathBans(everywhere=True).round(SamplingParams(0.0, logit_bias={4: -100.0}), [[1]] * 3)
    assert [shared.banned(b, []) for b in range(3)] == [{4}] * 3
    banned, free = copying_drafts(name, rows)
    assert 7 not in banned.tokens.tolist() and 7 in free.tokens.tolist()


COPIED_PROMPT = [5, 6, 7, 8, 5, 6]  # after "5 6" the prompt continues "7 8"


def copying_drafts(name: str, rows: RowSampling) -> list:
    """The first trees `ngram`, `suffix`, `recycling` or `retrieval` (its datastore holding the
    prompt's text) drafts for COPIED_PROMPT in each row of `rows`."""
    from draftsman.drafters.ngram import NgramDrafter
    from draftsman.drafters.recycling import RecyclingDrafter
    from draftsman.drafters.retrieval import RetrievalDrafter
    from draftsman.drafters.suffix import SuffixDrafter
    from test_retrieval import store

    if name == "ngram":
        drafter = NgramDrafter(NgramDrafter.Options(k=3, min_ngram=1))
    elif name == "suffix":
        drafter = SuffixDrafter(SuffixDrafter.Options(min_match=1, max_spec_factor=3.0))
    elif name == "recycling":  # its first tree is the prompt's seed: each token's follower in it
        drafter = RecyclingDrafter(RecyclingDrafter.Options(), SimpleNamespace(device="cpu", vocab_size=16))
    else:
        drafter = object.__new__(RetrievalDrafter)
        drafter.options = RetrievalDrafter.Options(path="datastore", k=3, min_ngram=1, max_ngram=3)
        drafter.datastore, drafter.device = store(COPIED_PROMPT), "cpu"
    drafter.begin([COPIED_PROMPT] * len(rows.rows), SamplingParams(0.0), torch.Generator())
    drafter.row_sampling = rows
    return drafter.propose([COPIED_PROMPT] * len(rows.rows))


def test_joining_rows_bring_their_own_bias(tiny_models, plain):
    """A biased row joins an unbiased batch, an unbiased one a biased batch; each is what it is
    alone, the rows already running too."""
    biases = biases_of(plain)
    cases = [(dict(), dict(logit_bias=biases[2])), (dict(logit_bias=biases[0]), dict(logit_bias={}))]
    alone = assert_joining_rows_bring_their_own(tiny_models["llama"][0], cases, NEW)
    assert alone(PROMPTS[2], logit_bias=biases[2]) != alone(PROMPTS[2])  # the joining row's bias mattered


def test_requests_with_their_own_bias_share_a_serve_batch(chat_target):
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, slowed, start_long_stream
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    first = decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=12).token_ids[0][0]
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    args = {"max_new_tokens": 12, "logit_bias": {first: -100.0}}
    biased, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), args)
    assert rows == 2 and long_job.stats is None  # it ran beside the long row
    got += [chunk for _, chunk in chunks]  # (the batch ends before the decoder runs alone)
    assert biased.token_ids == decoder.generate(SERVE_PROMPTS[1:2], **args).token_ids
    assert biased.token_ids[0][0] != first
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]


def test_one_bias_as_pairs_and_one_per_prompt(tiny_models, plain):
    """A list of (id, bias) pairs is one bias for every prompt; a list of dicts, pair lists or
    None is one per prompt."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    ban = plain[0][0]
    as_dict = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=6, logit_bias={ban: -100.0}).token_ids
    assert decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=6, logit_bias=[(ban, -100.0)]).token_ids == as_dict
    per_prompt = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=6, logit_bias=[[(ban, -100.0)], None])
    assert per_prompt.token_ids == [as_dict[0], plain[1][:6]]


@pytest.mark.parametrize("call, message", [
    (lambda d: d.generate(input_ids=PROMPTS[:2], max_new_tokens=4, logit_bias=[{5: -100.0}]),
     r"per-prompt sampling settings \(temperature, top_p, ...\) has 1 values for 2 prompts"),
    (lambda d: d.generate(input_ids=PROMPTS[:2], max_new_tokens=4, logit_bias=[None, {10 ** 6: 1.0}]),
     r"logit_bias has token ids \[1000000\] outside the target's vocabulary \[0, \d+\): drop them"),
    (lambda d: d.check_join(PROMPTS[:1], logit_bias={10 ** 6: 1.0}),
     r"logit_bias has token ids \[1000000\] outside the target's vocabulary"),
    (lambda d: list(d.stream_batch(PROMPTS[:1], max_new_tokens=4, joining=lambda: [
        JoiningPrompt(PROMPTS[1], 4, warpers={"logit_bias": {10 ** 6: 1.0}})])),
     r"logit_bias has token ids \[1000000\] outside the target's vocabulary"),
    (lambda d: d.generate(input_ids=PROMPTS[:2], max_new_tokens=4, logit_bias=[None, {5: 300.0}]),
     r"logit_bias values must be in \[-100, 100\]"),
], ids=["count", "outside", "check_join", "joining", "range"])
def test_bad_biases_per_row_are_named(tiny_models, call, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    with pytest.raises(ValueError, match=message):
        call(decoder)


@pytest.mark.parametrize("name", ["draft_model", "draft_model_tree", "eagle3", "mtp", "medusa"])
def test_model_drafters_keep_a_rows_banned_token_out_of_its_drafts_only(tiny_models, fresh_heads, name,
                                                                       close_draft):  # noqa: F811
    """Two rows of one prompt, the first banning a token the drafter drafts for it unbiased: that
    row's drafts never hold it, at the root and deeper (grow, chains); the other row's still do."""
    from test_row_drafts import recorded_trees

    spec = drafters(tiny_models, close_draft, fresh_heads)[name]
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": spec})
    rounds = recorded_trees(decoder)
    decoder.generate(input_ids=[PROMPTS[0]] * 2, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    first = next(trees[0].tokens.tolist() for _, trees in rounds if trees[0].size)
    rounds.clear()
    for banned in (first[0], first[-1]):  # the root's first child and a deeper (or later) node
        decoder.generate(input_ids=[PROMPTS[0]] * 2, max_new_tokens=6, temperature=0.0, ignore_eos=True,
                         logit_bias=[{banned: -100.0}, None])
        drafted = [trees for _, trees in rounds if len(trees) == 2]
        assert drafted and all(banned not in trees[0].tokens.tolist() for trees in drafted), (name, banned)
        assert banned in drafted[0][1].tokens.tolist(), (name, banned)
        rounds.clear()
