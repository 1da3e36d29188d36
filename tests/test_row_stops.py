"""Stops per row: requests with their own stop strings and stop_token_ids generate as one batch
(how `draftsman serve` batches them, also when they join a running batch), each row ended by its
own stops only, and held back from its own end tokens only before its minimum, as it is alone."""
import threading

import pytest

import draftsman
from toy_drafters import watching_proposals
from test_row_min_new_tokens import (SAMPLED_PROMPT, SAMPLED_ROWS, assert_held_and_free_rows_follow,
                                     close_draft, drafters, likeliest_first_token)  # noqa: F401 (a fixture)

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12], [7, 7, 7]]
NEW = 16
MINIMUMS = [0, 4, 0, 2]  # row 1 is held for 4 tokens, past another row's stop token


@pytest.fixture(scope="module")
def plain(tiny_models):
    """Each prompt's greedy output without stops."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    return decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0).token_ids


def stop_ids_of(plain) -> list[list[int]]:
    """Row 0 stops at row 1's second token, which row 1 (held for 4 tokens, and without that stop)
    must still make; row 1 has none; rows 2 and 3 stop at tokens they make."""
    other = plain[1][1]
    return [[other], [], [plain[2][5]], [plain[3][3], other]]


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "draft_model_tree", "eagle3", "cascade"])
def test_each_row_ends_at_its_own_stop_token_ids(tiny_models, close_draft, fresh_heads, plain, name):  # noqa: F811
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": drafters(tiny_models, close_draft, fresh_heads)[name]})
    stop_ids = stop_ids_of(plain)
    alone = [decoder.generate(input_ids=[p], max_new_tokens=NEW, min_new_tokens=m, stop_token_ids=ids,
                              temperature=0.0) for p, m, ids in zip(PROMPTS, MINIMUMS, stop_ids)]
    together = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=MINIMUMS,
                                stop_token_ids=stop_ids, temperature=0.0)
    for i, out in enumerate(alone):
        assert together.token_ids[i] == out.token_ids[0], f"{name}: row {i}"
        assert together.stats.finish_reasons[i] == out.stats.finish_reasons[0], f"{name}: row {i}"
    # The stops matter: rows end at their own, and row 1 makes row 0's stop token before its minimum.
    assert together.stats.finish_reasons.count("stop") >= 2, together.stats.finish_reasons
    assert stop_ids[0][0] in together.token_ids[1][:MINIMUMS[1]] and together.stats.finish_reasons[1] != "stop"


def stop_strings(decoder, plain) -> list[list[str]]:
    """Per row: a piece of text the row spells after a few tokens (none for row 1)."""
    texts = [decoder.decode(row) for row in plain]
    return [[texts[0][8:10]], [], [texts[2][5:8], "never spelt"], [texts[3][12:13]]]


def test_each_row_ends_at_its_own_stop_strings(tiny_models, plain):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    stops = stop_strings(decoder, plain)
    assert all(s for row in stops for s in row), stops
    alone = [decoder.generate(input_ids=[p], max_new_tokens=NEW, stop=s, temperature=0.0)
             for p, s in zip(PROMPTS, stops)]
    together = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, stop=stops, temperature=0.0)
    streamed = [""] * len(PROMPTS)
    for row, chunk in decoder.stream_batch(PROMPTS, max_new_tokens=NEW, stop=stops, temperature=0.0):
        streamed[row] += chunk.text
    for i, out in enumerate(alone):
        assert together.token_ids[i] == out.token_ids[0] and together.texts[i] == out.texts[0], i
        assert together.stats.finish_reasons[i] == out.stats.finish_reasons[0] and streamed[i] == out.texts[0], i
    assert together.stats.finish_reasons.count("stop") >= 2, together.stats.finish_reasons


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle3"])
def test_joining_rows_bring_their_own_stops(tiny_models, close_draft, fresh_heads, plain, name):  # noqa: F811
    """stream_batch's joining takes (ids, max_new_tokens, min_new_tokens, stop, stop_token_ids):
    a row that joins ends at its own stops, the rows already running at theirs."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": drafters(tiny_models, close_draft, fresh_heads)[name]})
    strings = stop_strings(decoder, plain)
    ids = [[], [plain[1][6]], [], [plain[3][2]]]
    alone = [decoder.generate(input_ids=[p], max_new_tokens=NEW, stop=s, stop_token_ids=i, temperature=0.0)
             for p, s, i in zip(PROMPTS, strings, ids)]
    rounds = [0]

    def joining():
        rounds[0] += 1
        return [(PROMPTS[1], NEW, None, strings[1], ids[1]), (PROMPTS[2], None, 0, strings[2])] if rounds[0] == 2 else []

    texts, tokens, reasons = {}, {}, {}
    order = [0, 3, 1, 2]  # the engine's rows: the starting prompts, then the joined ones
    for row, chunk in decoder.stream_batch([PROMPTS[0], PROMPTS[3]], joining=joining, max_new_tokens=NEW,
                                           stop=[strings[0], strings[3]], stop_token_ids=[ids[0], ids[3]],
                                           temperature=0.0):
        texts[order[row]] = texts.get(order[row], "") + chunk.text
        tokens.setdefault(order[row], []).extend(chunk.token_ids)
        reasons[order[row]] = chunk.finish_reason
    assert [tokens[i] for i in range(4)] == [out.token_ids[0] for out in alone]
    assert [texts[i] for i in range(4)] == [out.texts[0] for out in alone]
    assert [reasons[i] for i in range(4)] == [out.stats.finish_reasons[0] for out in alone]
    assert list(reasons.values()).count("stop") >= 2, reasons


@pytest.mark.parametrize("name", ["draft_model", "cascade", "draft_model_adaptive"])
def test_a_joining_rows_own_stop_token_is_held_back_in_drafts_too(tiny_models, plain, name):
    """A row joins with a stop token of its own and a minimum over its whole length: the drafter
    (the target drafting for itself, which would draft that token where the target picks it)
    never drafts it for that row, also inside a cascade or adaptive drafting. A ban made when the
    batch began would not hold it; drafting it would only cost drafts, never exactness."""
    target = str(tiny_models["llama"][0])
    itself = {"name": "draft_model", "path": target, "k": 3}
    spec = {"draft_model": itself, "draft_model_adaptive": {**itself, "adaptive": True},
            "cascade": {"name": "cascade", "drafters": [{"name": "ngram", "k": 3, "min_ngram": 1}, itself]}}[name]
    decoder = draftsman.load({"target": {"path": target}, "drafter": spec})
    if name.endswith("adaptive"):  # draft every round
        adaptive = decoder.engine.drafter
        adaptive.choose_depth = lambda *args, **kwargs: adaptive.inner.max_depth()
    stop = plain[1][2]  # the joining row's third greedy token, unheld
    drafted, rounds, tokens = [], [0], {}

    def watch(contexts, trees):
        drafted.extend(t for c, tree in zip(contexts, trees) if c[:3] == PROMPTS[1] for t in tree.tokens.tolist())

    def joining():
        rounds[0] += 1
        return [(PROMPTS[1], NEW, NEW, None, [stop])] if rounds[0] == 2 else []

    with watching_proposals(decoder, watch):
        # The first row is held too: the drafter's ban is made before the second row joins.
        for row, chunk in decoder.stream_batch([PROMPTS[0]], joining=joining, max_new_tokens=NEW, min_new_tokens=4,
                                               temperature=0.0):
            tokens.setdefault(row, []).extend(chunk.token_ids)
    alone = decoder.generate(input_ids=[PROMPTS[1]], max_new_tokens=NEW, min_new_tokens=NEW, stop_token_ids=[stop],
                             temperature=0.0)
    assert tokens[1] == alone.token_ids[0] and stop not in tokens[1]
    assert drafted and stop not in drafted, name


def test_sampled_rows_hold_back_only_their_own_stop_tokens(tiny_models):
    """T=1, one batch, every row held for 1 token: half the rows have the target's likeliest
    first token as a stop token, half do not. The first token of the former follows the
    target's distribution with that token masked; the latter's the unmasked one."""
    target = tiny_models["llama"][0]
    stop, p1, masked = likeliest_first_token(target)
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(target), "k": 2}})
    decoder.engine.eos_token_ids = frozenset()  # the stop token is the only end token
    out = decoder.generate(input_ids=[SAMPLED_PROMPT] * (2 * SAMPLED_ROWS), max_new_tokens=2, min_new_tokens=1,
                           stop_token_ids=[[stop], []] * SAMPLED_ROWS, temperature=1.0, seed=5)
    assert_held_and_free_rows_follow(out, stop, p1, masked)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stop_token_ids=[[3]]), "stop_token_ids has 1 values for 2 prompts: give one list, or one per prompt"),
    (dict(stop_token_ids=[[3], [400]]), "stop_token_ids [400] are not token ids of the target's vocabulary"),
    (dict(stop_token_ids=[[3], 4]), "stop_token_ids [[3]] are not token ids"),
    (dict(stop=[["a"], ["b"], ["c"]]), "stop has 3 values for 2 prompts: give one list, or one per prompt"),
    (dict(stop=[["a"], [""]]), "stop strings must not be empty"),
])
def test_bad_stops_per_prompt_are_named(tiny_models, kwargs, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError) as error:
        decoder.generate(input_ids=[[5, 6], [7]], max_new_tokens=4, **kwargs)
    assert message in str(error.value)


def test_samples_of_a_prompt_share_its_stops(tiny_models):
    """num_return_sequences: stop_token_ids given per prompt end each of its samples."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    half = list(range(decoder.engine.vocab_size // 2))  # about every other token ends a row
    out = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=12, stop_token_ids=[[], half], temperature=1.0,
                           num_return_sequences=3, seed=1)
    assert all(reason != "stop" for reason in out.stats.finish_reasons[:3])
    for row, reason in zip(out.token_ids[3:], out.stats.finish_reasons[3:]):  # prompt 1's samples
        assert all(t not in half for t in row[:-1]) and (reason == "stop") == (row[-1] in half), row


def test_requests_with_their_own_stops_share_a_serve_batch(chat_target):
    """stop and stop_token_ids are a row's own, as max_tokens: requests with other stops join the
    running batch, and each request's rows are what they are alone."""
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, slowed, start_long_stream
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    free = decoder.generate(SERVE_PROMPTS[1:3], max_new_tokens=8, temperature=0.0)
    stop, stop_ids = [free.texts[0][3:5]], [free.token_ids[1][4]]
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    answers = {}

    def ask(name, ids, args):
        answers[name] = batcher.generate(ids, args)

    asking = [threading.Thread(target=ask, args=("strings", decoder.encode(SERVE_PROMPTS[1:2]),
                                                 {"max_new_tokens": 8, "stop": stop})),
              threading.Thread(target=ask, args=("ids", decoder.encode(SERVE_PROMPTS[2:3]),
                                                 {"max_new_tokens": 8, "stop_token_ids": stop_ids}))]
    for thread in asking:
        thread.start()
    for thread in asking:
        thread.join()
    assert long_job.stats is None  # both ran beside the long row
    assert answers["strings"][1] >= 2 and answers["ids"][1] >= 2
    got += [chunk for _, chunk in chunks]  # (the decoder is the batch's until it ends)
    want = decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=8, stop=stop)
    assert answers["strings"][0].token_ids == want.token_ids and answers["strings"][0].texts == want.texts
    want = decoder.generate(SERVE_PROMPTS[2:3], max_new_tokens=8, stop_token_ids=stop_ids)
    assert answers["ids"][0].token_ids == want.token_ids
    assert {answers[k][0].stats.finish_reasons[0] for k in answers} == {"stop"}
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]
