"""Bans per row: rows with their own no_repeat_ngram_size and bad_words_ids share one batch
(generate's lists, stream_batch's joining rows, serve's requests). A ban depends on a position's
own sequence only, so each row is banned as it is alone (verifier/ngram_ban.py's BlockBans) and
generates what it generates alone."""
import random
import threading

import pytest
import torch

import draftsman
from draftsman import JoiningPrompt
from draftsman.verifier.ngram_ban import BadWords, BlockBans, RepeatedNgrams
from draftsman.verifier.sampling import RowSampling, SamplingParams, processed_probs, row_bans
from draftsman.verifier.tree import TreeBlock
from row_settings import (DRAFTERS, NEW, assert_joining_rows_bring_their_own, assert_logprobs_are_each_rows_own,
                          lone_and_batched)
from test_engine_sampling import ALPHA, fit_pvalue
from test_ngram_ban import VOCAB, random_block
from test_row_drafts import assert_all_accepted, self_drafting
from test_row_min_new_tokens import SAMPLED_PROMPT, close_draft, drafters  # noqa: F401 (a fixture)
from test_row_sampling import PROMPTS
from tiny_models import load_for_reference



def bans_of(plain: list[list[int]]) -> list[dict]:
    """One ban setting per row, each one that changes its row: no 3-gram twice and a two-token
    word from its own output; none (the row is plain decoding); a one-token word and a two-token
    word; no token twice (the tiny target repeats one in that row) and another row's word."""
    return [dict(no_repeat_ngram_size=3, bad_words_ids=[plain[0][4:6]]), dict(),
            dict(bad_words_ids=[[plain[2][0]], plain[2][3:5]]),
            dict(no_repeat_ngram_size=1, bad_words_ids=[[plain[0][1], plain[0][2]]])]


def per_prompt(rows: list[dict]) -> dict:
    """generate's per-prompt lists (None: the config's, no ban) from one dict per row."""
    return {name: [row.get(name) for row in rows] for name in ("no_repeat_ngram_size", "bad_words_ids")}


def test_block_bans_ban_each_row_as_alone():
    """BlockBans over a random block, rows with their own n, words, both or neither, rounds
    extending the rows: each row's logits equal its own RepeatedNgrams / BadWords alone; a row
    without a ban is untouched."""
    rng = random.Random(3)
    settings = [SamplingParams(0.0, no_repeat_ngram_size=2), SamplingParams(0.0),
                SamplingParams(0.0, bad_words_ids=[[4], [1, 2]]), SamplingParams(0.0, no_repeat_ngram_size=2),
                SamplingParams(0.0, no_repeat_ngram_size=3, bad_words_ids=[[0, 5]])]
    rows = RowSampling(settings)
    bans = BlockBans(eos_token_ids=())
    alone = {b: [RepeatedNgrams(p.no_repeat_ngram_size) if p.no_repeat_ngram_size else None,
                 BadWords(p.bad_words_ids) if p.bad_words_ids else None] for b, p in enumerate(settings)}
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))] for _ in settings]
    banned = 0
    for _ in range(6):  # rounds
        block = random_block(rng, len(settings), nodes=6)
        block.tokens[:, 0] = torch.tensor([c[-1] for c in contexts])
        logits = torch.randn(len(settings), block.tokens.shape[1], VOCAB, generator=torch.Generator().manual_seed(1))
        together = bans.ban_(logits.clone(), block, list(range(len(settings))), contexts, row_bans(rows))
        for b in range(len(settings)):
            own = logits[b:b + 1].clone()
            for ban in alone[b]:
                if ban is not None:
                    own = ban.ban_(own, _block_row(block, b), [b], [contexts[b]])
            assert torch.equal(together[b], own[0]), b
        assert torch.equal(together[1], logits[1])
        banned += int(torch.isinf(together).sum())
        for context in contexts:
            context += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3))]
    assert banned > 50
    assert row_bans(rows) == ({2: [0, 3], 3: [4]}, {((4,), (1, 2)): [2], ((0, 5),): [4]})
    shared = SamplingParams(0.0, no_repeat_ngram_size=2)
    assert row_bans(shared) == ({2: None}, {})  # one setting: every row, no index


def _block_row(block: TreeBlock, b: int) -> TreeBlock:
    return TreeBlock(block.tokens[b:b + 1], block.parents[b:b + 1], block.valid[b:b + 1])


@pytest.mark.parametrize("name", DRAFTERS)
def test_rows_with_their_own_bans_each_generate_as_alone(tiny_models, fresh_heads, plain, name,
                                                        close_draft):  # noqa: F811
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": drafters(tiny_models, close_draft, fresh_heads)[name]})
    lone, batched = lone_and_batched(decoder, bans_of(plain), per_prompt(bans_of(plain)), NEW)
    assert batched == lone, name
    assert all(a != b for r, (a, b) in enumerate(zip(plain, lone)) if r != 1)  # each ban mattered
    assert batched[1] == plain[1]  # the row without one is plain decoding


def test_logprobs_are_each_rows_own(tiny_models, plain):
    """processed logprobs read each row's banned distribution; raw ones the target's own."""
    bans = bans_of(plain)
    assert_logprobs_are_each_rows_own(tiny_models["llama"][0], bans, per_prompt(bans))


def test_sampled_rows_each_follow_their_own_banned_distribution(tiny_models, close_draft):  # noqa: F811
    """T=1, one batch, rows without a ban beside rows whose bad words are the target's two
    likeliest first tokens; a draft model close to the target drafts (q != p). Each half's
    first tokens follow its own distribution, and the test tells them apart."""
    target = tiny_models["llama"][0]
    with torch.no_grad():
        logits = load_for_reference(target)(input_ids=torch.tensor([SAMPLED_PROMPT])).logits[0, -1].double()
    p = processed_probs(logits, SamplingParams(1.0))
    top = p.topk(2).indices.tolist()
    banned = logits.clone()
    banned[top] = -torch.inf
    want = {None: p, True: processed_probs(banned, SamplingParams(1.0))}
    rows = [SamplingParams(1.0), SamplingParams(1.0, bad_words_ids=[[top[0]], [top[1]]])] * 1500
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(close_draft), "k": 3}})
    out, stats = decoder.engine.generate([SAMPLED_PROMPT] * len(rows), 2, rows, seed=7)
    assert stats.tau > 1.01
    for own, other in ((None, True), (True, None)):
        sample = torch.tensor([t[0] for t, params in zip(out, rows) if (params.bans_words or None) == own])
        assert fit_pvalue(sample, want[own]) > ALPHA
        assert (want[other][sample] == 0).any() or fit_pvalue(sample, want[other]) < ALPHA


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_row_drafts_without_its_own_one_token_bad_words(tiny_models, plain, temperature):
    """The target drafting for itself, each row's drafts banning its own one-token bad words (as
    a -100 bias): every row accepts (almost) every draft. Rows leave at different times."""
    target = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(target)}, "drafter": self_drafting(target)})
    limits = [NEW, 8, NEW, 12]
    words = [[[plain[0][0]]], None, [[plain[2][0]], [plain[1][0]]], [[plain[3][1]]]]
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=limits, temperature=temperature, seed=3, ignore_eos=True,
                           bad_words_ids=words)
    assert [len(t) for t in out.token_ids] == limits
    assert_all_accepted(out.stats)


def test_joining_rows_bring_their_own_bans(tiny_models, plain):
    """A banning row joins a batch without bans, a row without one a banning batch; each is what
    it is alone, the rows already running too."""
    bans = bans_of(plain)
    alone = assert_joining_rows_bring_their_own(tiny_models["llama"][0], [(dict(), bans[2]),
                                                                          (bans[3], dict(no_repeat_ngram_size=0))], NEW)
    assert alone(PROMPTS[2], **bans[3]) != alone(PROMPTS[2])  # the batch's ban would have mattered


def test_requests_with_their_own_bans_share_a_serve_batch(chat_target):
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, slowed, start_long_stream
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    first = decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=12).token_ids[0][0]
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    args = {"max_new_tokens": 12, "no_repeat_ngram_size": 1, "bad_words_ids": [[first]]}
    banned, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), args)
    assert rows == 2 and long_job.stats is None  # it ran beside the long row
    got += [chunk for _, chunk in chunks]  # (the batch ends before the decoder runs alone)
    assert banned.token_ids == decoder.generate(SERVE_PROMPTS[1:2], **args).token_ids
    assert banned.token_ids[0][0] != first and len(set(banned.token_ids[0])) == len(banned.token_ids[0])
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]


def test_one_word_list_and_one_per_prompt(tiny_models, plain):
    """A list of words is one setting for every prompt; a list of word lists (or None) is one per
    prompt; [[]] is still a malformed word, not "none"."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    words = [[plain[0][0]], plain[1][1:3]]
    both = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=6, bad_words_ids=words).token_ids
    assert both[0] != plain[0][:6]
    per_prompt = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=6, bad_words_ids=[words, None])
    assert per_prompt.token_ids == [both[0], plain[1][:6]]
    grams = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=6, no_repeat_ngram_size=[None, 1]).token_ids
    assert grams[0] == plain[0][:6] and len(set(grams[1])) == 6
    with pytest.raises(ValueError, match="bad_words_ids must be a list of token-id lists"):
        decoder.generate(input_ids=PROMPTS[:1], max_new_tokens=4, bad_words_ids=[[]])


@pytest.mark.parametrize("call, message", [
    (lambda d: d.generate(input_ids=PROMPTS[:2], max_new_tokens=4, no_repeat_ngram_size=[2]),
     r"per-prompt sampling settings \(temperature, top_p, ...\) has 1 values for 2 prompts"),
    (lambda d: d.generate(input_ids=PROMPTS[:2], max_new_tokens=4, bad_words_ids=[None, [[1, 10 ** 6]]]),
     r"bad_words_ids has token ids \[1000000\] outside the target's vocabulary \[0, \d+\): drop them"),
    (lambda d: d.check_join(PROMPTS[:1], bad_words_ids=[[10 ** 6]]),
     r"bad_words_ids has token ids \[1000000\] outside the target's vocabulary"),
    (lambda d: list(d.stream_batch(PROMPTS[:1], max_new_tokens=4, joining=lambda: [
        JoiningPrompt(PROMPTS[1], 4, warpers={"bad_words_ids": [[10 ** 6]]})])),
     r"bad_words_ids has token ids \[1000000\] outside the target's vocabulary"),
    (lambda d: d.generate(input_ids=PROMPTS[:2], max_new_tokens=4, no_repeat_ngram_size=[None, -1]),
     r"no_repeat_ngram_size must be a whole number >= 0"),
], ids=["count", "outside", "check_join", "joining", "negative"])
def test_bad_bans_per_row_are_named(tiny_models, call, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    with pytest.raises(ValueError, match=message):
        call(decoder)
