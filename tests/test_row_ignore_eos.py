"""ignore_eos per row: rows that ignore EOS and rows that end at it share one batch (generate's
list, stream_batch's joining rows, serve's requests), each generating what it would alone, and a
sampled row that ignores EOS draws it from the target's own distribution beside rows that hold it
back."""
import threading

import pytest
import torch

import draftsman
from draftsman import JoiningPrompt
from draftsman.verifier.joining import BATCH, JoiningRow
from draftsman.verifier.sampling import SamplingParams

from test_engine_sampling import ALPHA, fit_pvalue
from test_ignore_eos import PROMPTS, NEW, load
from test_row_min_new_tokens import (SAMPLED_PROMPT, SAMPLED_ROWS, assert_held_and_free_rows_follow,  # noqa: F401
                                     close_draft, drafters, frequent_eos, likeliest_first_token)

FLAGS = [True, False, True, False]


def alone(decoder, prompt, flag, **kwargs):
    return decoder.generate(input_ids=[prompt], max_new_tokens=NEW, temperature=0.0, ignore_eos=flag, **kwargs)


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "draft_model_tree", "eagle3", "mtp", "cascade"])
def test_rows_with_their_own_ignore_eos_each_generate_as_alone(tiny_models, close_draft, fresh_heads,  # noqa: F811
                                                               frequent_eos, name):  # noqa: F811
    decoder = load(tiny_models, drafters(tiny_models, close_draft, fresh_heads)[name], {frequent_eos})
    lone = [alone(decoder, p, flag) for p, flag in zip(PROMPTS, FLAGS)]
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=FLAGS)
    assert out.token_ids == [o.token_ids[0] for o in lone], name
    assert out.stats.finish_reasons == [o.stats.finish_reasons[0] for o in lone]
    # The flags mattered: a row that keeps EOS ends at it, one that ignores it runs on past it.
    assert "eos" in out.stats.finish_reasons[1::2]
    assert any(frequent_eos in row for row in out.token_ids[0::2]), out.token_ids


def test_joining_rows_bring_their_own_ignore_eos(tiny_models, frequent_eos):  # noqa: F811
    """A row that ignores EOS joins a batch that keeps it, and the other way round; a joining row
    that leaves ignore_eos out takes the batch's. Each row is what it is alone."""
    decoder = load(tiny_models, {"name": "ngram", "k": 3, "min_ngram": 1}, {frequent_eos})
    decoder.engine.join_prefill_chunk = 2  # the joining rows' prompts prefilled over rounds
    lone = {flag: [alone(decoder, p, flag).token_ids[0] for p in PROMPTS] for flag in (True, False)}
    for batch_flag in (False, True):
        rounds = [0]

        def joining():
            rounds[0] += 1
            if rounds[0] != 2:
                return []
            return [JoiningPrompt(PROMPTS[1], NEW, ignore_eos=not batch_flag),
                    (PROMPTS[2], NEW, None, None, None, None, batch_flag),  # a plain tuple, given
                    JoiningPrompt(PROMPTS[3], NEW)]  # left out: the batch's

        tokens: dict[int, list[int]] = {}
        for row, chunk in decoder.stream_batch([PROMPTS[0]], joining=joining, max_new_tokens=NEW,
                                               temperature=0.0, ignore_eos=batch_flag):
            tokens.setdefault(row, []).extend(chunk.token_ids)
        want = [lone[batch_flag][0], lone[not batch_flag][1], lone[batch_flag][2], lone[batch_flag][3]]
        assert [tokens.get(r, []) for r in range(4)] == want, batch_flag
    assert lone[True] != lone[False]  # EOS ends some row early when it is kept


def test_engine_joining_rows_as_named_and_plain_tuples(tiny_models, frequent_eos):  # noqa: F811
    """The engine's JoiningRow: an ignore_eos it gives is its own; stop and stop_token_ids left
    out are the batch's."""
    decoder = load(tiny_models, {"name": "ngram", "k": 3, "min_ngram": 1}, {frequent_eos})
    engine, greedy = decoder.engine, SamplingParams(0.0)
    lone = alone(decoder, PROMPTS[1], True).token_ids[0]
    stop_id = next(t for t in lone[lone.index(frequent_eos) + 1:] if t not in lone[:lone.index(frequent_eos)])
    joined = [[JoiningRow(PROMPTS[1], NEW, ignore_eos=True), (PROMPTS[1], NEW, None, BATCH, BATCH, None, True),
               JoiningRow(PROMPTS[1], NEW)]]
    out, stats = engine.generate(PROMPTS[:1], NEW, greedy, ignore_eos=True, stop_token_ids=[stop_id])
    assert out[0] == alone(decoder, PROMPTS[0], True, stop_token_ids=[stop_id]).token_ids[0]
    tokens: dict[int, list[int]] = {}
    for row, new in engine.stream(PROMPTS[:1], NEW, greedy, stop_token_ids=[stop_id],
                                  joining=lambda: joined.pop() if joined else []):
        tokens.setdefault(row, []).extend(new)
    kept = alone(decoder, PROMPTS[1], False, stop_token_ids=[stop_id]).token_ids[0]
    assert tokens[1] == tokens[2] == lone[: lone.index(stop_id) + 1]  # own ignore_eos, the batch's stop id
    assert frequent_eos in tokens[1][:-1]  # it ran past EOS
    assert tokens[3] == kept and kept[-1] == frequent_eos  # the batch's ignore_eos (False): EOS ends it
    joined = [[JoiningRow(PROMPTS[1], NEW), JoiningRow(PROMPTS[1], NEW, ignore_eos=False)]]
    tokens = {}
    for row, new in engine.stream(PROMPTS[:1], NEW, greedy, stop_token_ids=[stop_id], ignore_eos=True,
                                  joining=lambda: joined.pop() if joined else []):
        tokens.setdefault(row, []).extend(new)
    assert tokens[1] == lone[: lone.index(stop_id) + 1] and tokens[2] == kept  # the batch's (True), its own
    # A stop check left out is the batch's too; None is none.
    joined = [[JoiningRow(PROMPTS[1], NEW), JoiningRow(PROMPTS[1], NEW, stop=None)]]
    tokens = {}
    for row, new in engine.stream(PROMPTS[:1], NEW, greedy, ignore_eos=True,
                                  joining=lambda: joined.pop() if joined else [],
                                  stop=lambda so_far, new: new.index(stop_id) + 1 if stop_id in new else None):
        tokens.setdefault(row, []).extend(new)
    assert tokens[1] == lone[: lone.index(stop_id) + 1] and tokens[2] == lone


def test_sampled_rows_that_ignore_eos_draw_it_beside_rows_that_hold_it(tiny_models):
    """T=1, one batch, every row held for 1 token, EOS the target's likeliest first token: the rows
    that ignore EOS draw their first token from the target's distribution (EOS included), the
    others from it with EOS masked. A mask shared by the whole batch would fail one half."""
    target = tiny_models["llama"][0]
    eos, p1, masked = likeliest_first_token(target)
    decoder = load(tiny_models, {"name": "draft_model", "path": str(target), "k": 2}, {eos})
    out = decoder.generate(input_ids=[SAMPLED_PROMPT] * (2 * SAMPLED_ROWS), max_new_tokens=2, min_new_tokens=1,
                           temperature=1.0, seed=7, ignore_eos=[False, True] * SAMPLED_ROWS)
    assert_held_and_free_rows_follow(out, eos, p1, masked)
    first_free = torch.tensor([row[0] for row in out.token_ids[1::2]])
    assert fit_pvalue(first_free, p1) > ALPHA


def test_requests_with_their_own_ignore_eos_share_a_serve_batch(chat_target):
    """A request that ignores EOS joins a running batch that keeps it: it runs to max_tokens, and
    the long request still ends as it would alone."""
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, slowed, start_long_stream
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    free = decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=12, temperature=0.0, ignore_eos=True).token_ids[0]
    decoder.engine.eos_token_ids = frozenset({free[2]})  # EOS early in the joining request's own output
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    joined, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), {"max_new_tokens": 12, "ignore_eos": True})
    assert rows == 2 and long_job.stats is None  # it ran beside the long row
    assert joined.token_ids[0] == free and joined.stats.finish_reasons[-1] == "length"
    ended, _ = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), {"max_new_tokens": 12})
    assert ended.token_ids[0] == free[:3]  # EOS kept: it ends there
    got += [chunk for _, chunk in chunks]
    lone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == lone.token_ids[0]


@pytest.mark.parametrize("flags, message", [
    ([True], r"ignore_eos has 1 values for 2 prompts: give one flag, or one per prompt"),
    ([True, "yes"], r"ignore_eos must be true or false, got 'yes'"),
])
def test_bad_ignore_eos_per_prompt_is_named(tiny_models, flags, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=message):
        decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=4, ignore_eos=flags)
    with pytest.raises(ValueError, match=r"ignore_eos must be true or false, got 1"):
        decoder.check_join(PROMPTS[:1], ignore_eos=1)
    with pytest.raises(ValueError, match=r"ignore_eos must be true or false, got 'no'"):
        list(decoder.stream_batch(PROMPTS[:1], max_new_tokens=4,
                                  joining=lambda: [JoiningPrompt(PROMPTS[1], 4, ignore_eos="no")]))
    with pytest.raises(ValueError, match=r"a joining row is a JoiningRow or a tuple \(prompt, max_new_tokens"):
        list(decoder.engine.stream(PROMPTS[:1], 4, SamplingParams(0.0), joining=lambda: [(PROMPTS[1],)]))
    with pytest.raises(ValueError, match=r"a joining prompt is a JoiningPrompt or a tuple \(input_ids, "):
        too_many = (PROMPTS[1],) * (len(JoiningPrompt._fields) + 1)
        list(decoder.stream_batch(PROMPTS[:1], max_new_tokens=4, joining=lambda: [too_many]))


def test_samples_of_a_prompt_share_its_ignore_eos(tiny_models):
    """num_return_sequences: a flag given per prompt holds for each of its samples."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    decoder.engine.eos_token_ids = frozenset(range(decoder.engine.vocab_size))  # every token an EOS
    out = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=5, ignore_eos=[None, True], temperature=1.0,
                           num_return_sequences=2, seed=1)  # None: the config's (False)
    assert out.stats.finish_reasons == ["eos", "eos", "length", "length"]
    assert [len(row) for row in out.token_ids] == [1, 1, 5, 5]
