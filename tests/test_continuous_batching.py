"""Continuous batching: rows that join a running batch between rounds (stream_batch's `joining`,
how `draftsman serve` adds waiting requests) generate what they generate alone, for every drafter:
the same tokens at temperature 0, the same trees proposed at the same contexts (the drafter's
state for a joined row is what it would be alone), and the target's distribution when sampling."""
import pytest
import torch

import draftsman
from draftsman.verifier.cached_model import CachedLM
from draftsman.verifier.sampling import SamplingParams
from draftsman.verifier.tree import TreeBlock

from tiny_models import load_for_reference, permuted_vocab_copy, perturbed_copy

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 12, 13, 12, 13, 12, 13, 12], [7], [40, 41, 42, 43, 44, 45]]
LIMITS = [14, 9, 12, 10, 8]
# Before round r (0 = the first), these prompts join the batch; the rest start it.
JOINS = {2: [2], 3: [3, 4]}
STARTING = [0, 1]


@pytest.fixture(scope="module")
def close_draft(tiny_models, tmp_path_factory):
    return perturbed_copy(tiny_models["llama"][0], tmp_path_factory.mktemp("close-draft"), noise=0.05)


@pytest.fixture(scope="module")
def medium_draft(tiny_models, tmp_path_factory):
    return perturbed_copy(tiny_models["llama"][0], tmp_path_factory.mktemp("medium-draft"), noise=0.3)


@pytest.fixture(scope="module")
def shuffled_close_draft(close_draft, tmp_path_factory):
    """The close draft under a tokenizer with other ids: only text links it to the target."""
    return permuted_vocab_copy(close_draft, tmp_path_factory.mktemp("shuffled-close-draft"))


def drafters(tiny_models, close_draft, fresh_heads, shuffled_draft=None):
    return {
        "none": {"name": "none"},
        "ngram": {"name": "ngram", "k": 3, "min_ngram": 1},
        # Without a cache: its trees depend on the row alone (compared with lone runs' below).
        "suffix": {"name": "suffix", "min_match": 1, "max_spec_factor": 3.0, "max_cached_requests": 0},
        "recycling": {"name": "recycling", "tree_budget": 8},
        "draft_model": {"name": "draft_model", "path": str(close_draft), "k": 4},
        "draft_model_tree": {"name": "draft_model", "path": str(close_draft), "k": 3, "top_k": 2, "total_tokens": 6},
        "medusa": {"name": "medusa", "path": str(fresh_heads / "medusa")},
        "eagle": {"name": "eagle", "path": str(fresh_heads / "eagle"), "depth": 3, "top_k": 2, "total_tokens": 6},
        "eagle3": {"name": "eagle", "path": str(fresh_heads / "eagle3"), "depth": 3, "top_k": 2, "total_tokens": 6},
        "mtp": {"name": "mtp", "path": str(fresh_heads / "mtp")},
        "mlp_speculator": {"name": "mlp_speculator", "path": str(fresh_heads / "mlp_speculator"), "top_k": 2,
                           "total_tokens": 6},
        "cascade": {"name": "cascade", "drafters": [{"name": "ngram", "k": 3},
                                                   {"name": "draft_model", "path": str(close_draft), "k": 3}]},
        "draft_model_adaptive": {"name": "draft_model", "path": str(close_draft), "k": 4, "adaptive": True},
        # Joined rows' caches hold their context only: each round feeds what was emitted, then masks.
        "draft_model_parallel": {"name": "draft_model", "path": str(close_draft), "k": 4, "parallel_drafting": True,
                                 "mask_token_id": 5},
        "cross_tokenizer": {"name": "cross_tokenizer", "path": str(shuffled_draft), "k": 4},
        # The target's first layer as the draft model: a view sharing the target's modules.
        "layer_skip": {"name": "layer_skip", "exit_layer": 1, "k": 3},
    }


PROMPT_LENGTH = {p[0]: len(p) for p in PROMPTS}  # a row's prompt, told by its first token


def record_trees(decoder) -> dict:
    """{context as a tuple: the tree proposed there} for every propose() of the decoder's drafter
    (a context names its row and round: rows do not share one here). Also checks, each round,
    that the drafter's per-row prompt lengths (which the min_new_tokens EOS ban counts from)
    are its rows' own: a wrong one would show in the trees only when a draft holds EOS."""
    seen = {}
    drafter = decoder.engine.drafter
    propose = drafter.propose

    def recording(contexts):
        counted_from = getattr(drafter, "prompt_lengths", None)  # ngram, retrieval, suffix
        if hasattr(drafter, "draft_context"):  # model drafters
            counted_from = drafter.draft_context.generated_from
        if counted_from is not None:
            assert counted_from == [PROMPT_LENGTH[c[0]] for c in contexts], drafter.name
        trees = propose(contexts)
        for context, tree in zip(contexts, trees):
            seen[tuple(context)] = (tree.tokens.tolist(), tree.parents.tolist())
        return trees

    drafter.propose = recording
    return seen


def joined_run(decoder, joins=JOINS, starting=STARTING, **settings):
    """stream_batch over the starting prompts, the others joining before the rounds JOINS names;
    returns each prompt's tokens and finish reason, by prompt index."""
    rounds, order = [0], list(starting)

    def joining():
        rounds[0] += 1
        joined = joins.get(rounds[0] - 1, [])
        order.extend(joined)
        return [(PROMPTS[i], LIMITS[i]) for i in joined]

    stats = draftsman.GenerationStats()
    tokens: dict[int, list[int]] = {}
    reasons = {}
    for row, chunk in decoder.stream_batch([PROMPTS[i] for i in starting], stats=stats, joining=joining,
                                           max_new_tokens=[LIMITS[i] for i in starting], **settings):
        tokens.setdefault(order[row], []).extend(chunk.token_ids)
        if chunk.finish_reason:
            reasons[order[row]] = chunk.finish_reason
    return tokens, reasons, stats


@pytest.mark.parametrize("name", ["none", "ngram", "suffix", "recycling", "draft_model", "draft_model_tree", "medusa", "eagle",
                                  "eagle3", "mtp", "mlp_speculator", "cascade", "draft_model_adaptive",
                                  "draft_model_parallel", "cross_tokenizer", "layer_skip"])
@pytest.mark.parametrize("chunk", [None, 2], ids=["whole-prefill", "chunked-prefill"])
def test_joined_rows_generate_what_they_generate_alone(tiny_models, close_draft, fresh_heads, shuffled_close_draft,
                                                       name, chunk):
    """Also with joining prompts prefilled 2 tokens a round (the running rows go on meanwhile)."""
    drafter = drafters(tiny_models, close_draft, fresh_heads, shuffled_close_draft)[name]
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": drafter})
    decoder.engine.join_prefill_chunk = chunk
    assert decoder.can_join
    alone_trees = record_trees(decoder)
    alone = [decoder.generate(input_ids=[p], max_new_tokens=m, temperature=0.0) for p, m in zip(PROMPTS, LIMITS)]
    del decoder.engine.drafter.propose  # the class's own again, not the recording one
    together_trees = record_trees(decoder)
    tokens, reasons, stats = joined_run(decoder, temperature=0.0)
    for i, out in enumerate(alone):
        assert tokens[i] == out.token_ids[0], f"{name}: prompt {i}"
        assert reasons[i] == out.stats.finish_reasons[0], f"{name}: prompt {i}"
    assert stats.finish_reasons == [reasons[i] for i in STARTING + [i for r in sorted(JOINS) for i in JOINS[r]]]
    if name not in ("draft_model_adaptive", "recycling"):  # adaptive's depths depend on the batch it drafts
        # for, and recycling's matrix on what the other rows taught it. Every context the joined
        # run drafted at, it drafted the tree the lone run drafted there.
        assert together_trees and set(together_trees) <= set(alone_trees)
        assert {c: alone_trees[c] for c in together_trees} == together_trees, name
        if name.startswith("draft_model"):
            assert stats.tau > 1.5, stats.tau  # drafts were accepted: joined rows' caches did move
    elif name == "draft_model_adaptive":  # its per-row budgets follow the engine's rows: tokens counted where emitted
        engine_order = STARTING + [i for r in sorted(JOINS) for i in JOINS[r]]
        assert decoder.engine.drafter.row_tokens == [len(tokens[i]) for i in engine_order]


@pytest.mark.parametrize("name", ["ngram", "draft_model", "medusa", "eagle3", "mtp"])
def test_rows_join_as_the_last_row_ends(tiny_models, close_draft, fresh_heads, name):
    """A batch whose rows have all ended goes on while joining() returns prompts, and ends when
    it returns none. Its caches then hold no row but still their slots (the target's, and a
    model drafter's, which grows empty rows), which the joined rows must line up with."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": drafters(tiny_models, close_draft, fresh_heads)[name]})
    stats = draftsman.GenerationStats()
    waves = [[1], [2, 3], [4]]
    order, calls = [0], []

    def joining():
        calls.append(all(stats.finish_reasons))
        if not all(stats.finish_reasons) or not waves:
            return []
        wave = waves.pop(0)
        order.extend(wave)
        return [(PROMPTS[i], LIMITS[i]) for i in wave]

    tokens: dict[int, list[int]] = {}
    for row, chunk in decoder.stream_batch([PROMPTS[0]], stats=stats, joining=joining, max_new_tokens=LIMITS[0],
                                           temperature=0.0):
        tokens.setdefault(order[row], []).extend(chunk.token_ids)
    assert not waves and calls[-1]  # every wave joined; the last call found no row left
    for i, (p, m) in enumerate(zip(PROMPTS, LIMITS)):
        assert tokens[i] == decoder.generate(input_ids=[p], max_new_tokens=m, temperature=0.0).token_ids[0]


@pytest.mark.parametrize("chunk, rounds_before", [(None, 2), (2, 5), (3, 4)])
def test_a_joining_prompt_is_prefilled_a_chunk_per_round(tiny_models, chunk, rounds_before):
    """Chunked prefill: a 9-token prompt joins before round 1. Whole, it is prefilled before that
    round, so the running row's 2 tokens of rounds 0 and 1 come before its first; 2 (3) tokens a
    round, its 8 prefix tokens take rounds 1-4 (1-3), in which the running row goes on making
    tokens. Either way every row makes what it makes alone."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})  # plain: a token a round
    decoder.engine.join_prefill_chunk = chunk
    rounds, order, seen = [0], [0], []

    def joining():  # a 3-token prompt joins a round after the 9-token one: it enters after it, in its order
        rounds[0] += 1
        joins = {2: 2, 3: 1}
        if rounds[0] in joins:
            order.append(joins[rounds[0]])
            return [(PROMPTS[joins[rounds[0]]], LIMITS[joins[rounds[0]]])]
        return []

    tokens: dict[int, list[int]] = {}
    for row, chunk_out in decoder.stream_batch([PROMPTS[0]], joining=joining, max_new_tokens=LIMITS[0],
                                               temperature=0.0):
        tokens.setdefault(order[row], []).extend(chunk_out.token_ids)
        if chunk_out.token_ids:
            seen.append(order[row])
    assert seen.index(2) == rounds_before  # the running row's tokens before the joined row's first
    for i in (0, 1, 2):
        assert tokens[i] == decoder.generate(input_ids=[PROMPTS[i]], max_new_tokens=LIMITS[i],
                                             temperature=0.0).token_ids[0]


def test_rows_join_a_batch_of_one_token_prompts_before_its_first_round(tiny_models, close_draft):
    """Joining before the first round, when the target's cache holds nothing yet (a one-token
    prompt has no prefill), and a draft model's cache neither."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": {"name": "draft_model", "path": str(close_draft), "k": 3}})
    tokens, _, _ = joined_run(decoder, joins={0: [0, 2]}, starting=[3], temperature=0.0)
    for i in (0, 2, 3):
        assert tokens[i] == decoder.generate(input_ids=[PROMPTS[i]], max_new_tokens=LIMITS[i],
                                             temperature=0.0).token_ids[0]


def test_joined_rows_keep_logprobs_and_stop_strings(tiny_models):
    """A joined row's chunks carry its tokens' logprobs and top logprobs, and a stop string ends
    it where it ends the row alone."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": {"name": "ngram", "k": 3}})
    text = decoder.generate(input_ids=[PROMPTS[2]], max_new_tokens=12, temperature=0.0).texts[0]
    settings = dict(temperature=0.0, logprobs=True, top_logprobs=2, stop=[text[6:9]])
    rows = []

    def joining():
        rows.append(None)
        return [(PROMPTS[2], 12)] if len(rows) == 2 else []

    chunks: dict[int, list] = {}
    for row, chunk in decoder.stream_batch([PROMPTS[0]], joining=joining, max_new_tokens=8, **settings):
        chunks.setdefault(row, []).append(chunk)
    for row, prompt, limit in ((0, PROMPTS[0], 8), (1, PROMPTS[2], 12)):
        alone = decoder.generate(input_ids=[prompt], max_new_tokens=limit, **settings)
        assert [t for c in chunks[row] for t in c.token_ids] == alone.token_ids[0]
        assert [v for c in chunks[row] for v in c.logprobs] == pytest.approx(alone.logprobs[0], abs=1e-5)
        assert [[i for i, _ in t] for c in chunks[row] for t in c.top_logprobs] == [
            [i for i, _ in t] for t in alone.top_logprobs[0]]
        assert "".join(c.text for c in chunks[row]) == alone.texts[0]
        assert chunks[row][-1].finish_reason == alone.stats.finish_reasons[0]
    assert chunks[1][-1].finish_reason == "stop"


def sampled_run(tiny_models, medium_draft, drafter, prompts, limit, joining, seed, join_prefill_chunk=None):
    """engine.stream at temperature 1 with `joining`: each row's tokens by row number, and stats."""
    cfg = {"name": "draft_model", "path": str(medium_draft), "k": 3} if drafter == "draft_model" else {"name": "none"}
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": cfg})
    decoder.engine.join_prefill_chunk = join_prefill_chunk
    stats = draftsman.GenerationStats()
    out: dict[int, list[int]] = {}
    for row, tokens in decoder.engine.stream(prompts, limit, SamplingParams(1.0), seed=seed, stats=stats,
                                             joining=joining):
        out.setdefault(row, []).extend(tokens)
    return decoder, out, stats


def assert_first_two_tokens_follow_the_target(tiny_models, decoder, rows, prompt, stats):
    """The rows' first two tokens fit the target's exact marginals after `prompt` (chi-square)."""
    from test_engine_sampling import ALPHA, exact_marginals, fit_pvalue

    p1, p2 = exact_marginals(load_for_reference(tiny_models["llama"][0]), prompt, SamplingParams(1.0),
                             decoder.engine.eos_token_ids)
    assert fit_pvalue(torch.tensor([t[0] for t in rows]), p1) > ALPHA
    assert fit_pvalue(torch.tensor([t[1] for t in rows if len(t) == 2]), p2) > ALPHA
    if decoder.engine.drafter.name == "draft_model":
        assert stats.tau > 1.01  # drafts were accepted and rejected


@pytest.mark.parametrize("drafter", ["none", "draft_model"])
def test_sampled_joined_rows_draw_from_the_target(tiny_models, medium_draft, drafter):
    """At temperature 1 the first two tokens of rows that joined a running batch after two
    rounds follow the target's exact marginals (chi-square, alpha = 1e-6, 4000 rows)."""
    from test_engine_sampling import PROMPT

    rounds = []

    def joining():
        rounds.append(None)
        return [(PROMPT, 2)] * 4000 if len(rounds) == 3 else []

    decoder, out, stats = sampled_run(tiny_models, medium_draft, drafter, [[9, 10, 11]] * 500, 12, joining, seed=7,
                                      join_prefill_chunk=3)  # the joined prompt's 7 prefix tokens over 3 rounds
    joined = [out[row] for row in range(500, 4500)]
    assert_first_two_tokens_follow_the_target(tiny_models, decoder, joined, PROMPT, stats)


@pytest.mark.parametrize("drafter", ["none", "draft_model"])
def test_sampled_rows_already_running_stay_exact_after_a_join(tiny_models, medium_draft, drafter):
    """The other side of a join: rows that were in the batch when longer prompts joined it (their
    caches then padded with holes to the joined rows' slots, and the draft model's too) draw
    their first two tokens from the target's exact marginals at temperature 1 (chi-square,
    alpha = 1e-6, 3000 rows)."""
    from test_engine_sampling import PROMPT

    longer = list(range(20, 44))  # 24 tokens against PROMPT's 8

    def joining():  # before the first round: every token of the running rows comes after the join
        joining.calls += 1
        return [(longer, 6)] * 500 if joining.calls == 1 else []
    joining.calls = 0

    decoder, out, stats = sampled_run(tiny_models, medium_draft, drafter, [PROMPT] * 3000, 2, joining, seed=3)
    assert len(out) == 3500 and stats.rounds > 1
    assert_first_two_tokens_follow_the_target(tiny_models, decoder, [out[row] for row in range(3000)], PROMPT, stats)


def test_a_drafter_without_add_rows_is_refused(tiny_models):
    from draftsman.drafters.base import Drafter, DraftTree
    from draftsman.drafters.registry import register

    @register
    class Plain(Drafter):
        name = "test_plain_rows"

        def __init__(self, options=None, target=None):
            pass

        def propose(self, contexts):
            return [DraftTree.empty() for _ in contexts]

    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": {"name": "test_plain_rows"}})
    assert not decoder.can_join
    with pytest.raises(ValueError, match="drafter 'test_plain_rows' cannot take rows into a running batch"):
        list(decoder.stream_batch([PROMPTS[0]], joining=lambda: []))


def test_a_bad_joining_prompt_is_named(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        list(decoder.stream_batch([PROMPTS[0]], joining=lambda: [([], 4)]))
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens = 2\]"):
        list(decoder.stream_batch([PROMPTS[0]], joining=lambda: [(PROMPTS[1], 2)], min_new_tokens=3,
                                  max_new_tokens=5))


def once(prompts):
    """A joining() that gives `prompts` when first asked, then nothing."""
    asked = []

    def joining():
        asked.append(None)
        return prompts if len(asked) == 1 else []
    return joining


def test_a_joining_prompts_ids_are_checked_as_generates_are(tiny_models):
    """Float and bool ids were cut to other tokens (5.7 -> 5, True -> 1) and text failed as "invalid
    literal for int()": a joining prompt's ids pass generate's check; ids as a tensor still join."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    for ids, message in [([5.7, 6.2, True], r"joining\(\)'s input_ids: prompt 0 has \[5.7, 6.2, True\], not token ids"),
                         ("abc", r"prompt 0 has 'abc', not token ids: encode it first, decoder.encode"),
                         (7, r"prompt 0 has 7, not token ids: give a list of whole numbers")]:
        with pytest.raises(ValueError, match=message):
            list(decoder.stream_batch([PROMPTS[0]], max_new_tokens=3, joining=once([(ids, 3)])))
    out: dict[int, list[int]] = {}
    joining = once([draftsman.JoiningPrompt(torch.tensor(PROMPTS[1]), 4)])
    for row, chunk in decoder.stream_batch([PROMPTS[0]], max_new_tokens=3, joining=joining):
        out.setdefault(row, []).extend(chunk.token_ids)
    assert out[1] == decoder.generate(input_ids=[PROMPTS[1]], max_new_tokens=4).token_ids[0]


def test_joining_that_returns_one_prompt_is_told_to_return_a_list(tiny_models):
    """A bare JoiningPrompt was read as a list of prompts, its ids as one prompt's fields, and failed
    as "stop must be a list of strings ... got 88"; the message now names the missing list."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    for one in (draftsman.JoiningPrompt(PROMPTS[1], 3), (PROMPTS[1], 3)):
        with pytest.raises(ValueError, match=r"joining\(\) returns a list of prompts .*, got one prompt .*in a list"):
            list(decoder.stream_batch([PROMPTS[0]], max_new_tokens=3, joining=once(one)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_cache_rows_added_equal_rows_prefilled_together(tiny_models, arch):
    """A cache built as batch [a] + rows [b, c] prefilled apart holds, row by row, the committed
    keys and values of [a, b, c] prefilled together, and gives the same next-token logits; so does
    a cache that grows empty rows and feeds them afterwards."""
    model = load_for_reference(tiny_models[arch][0])
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
    together = CachedLM(model)
    together.reset(3)
    together.forward(TreeBlock.chains(prompts, together.device))
    together.accept([list(range(len(p))) for p in prompts])

    joined = CachedLM(model)
    joined.reset(1)
    joined.forward(TreeBlock.chains(prompts[:1], joined.device))
    joined.accept([list(range(len(prompts[0])))])
    apart = CachedLM(model)
    apart.reset(2)
    apart.forward(TreeBlock.chains(prompts[1:], apart.device))
    apart.accept([list(range(len(p))) for p in prompts[1:]])
    joined.add_rows(apart)

    grown = CachedLM(model)  # a drafter's way: empty rows, fed by its next forward
    grown.reset(1)
    grown.forward(TreeBlock.chains(prompts[:1], grown.device))
    grown.accept([list(range(len(prompts[0])))])
    grown.add_rows(2)
    grown.forward(TreeBlock.chains([[], *prompts[1:]], grown.device))
    grown.accept([[]] + [list(range(len(p))) for p in prompts[1:]])

    for cache in (joined, grown):
        assert cache.lengths.tolist() == [7, 2, 4]
        for row in range(3):
            for layer in range(len(together.cache.layers)):
                for mine, theirs in zip(cache.committed_kv(row, layer), together.committed_kv(row, layer)):
                    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        step = TreeBlock.column(torch.tensor([20, 21, 22]))
        logits, _ = cache.forward(step)
        expected, _ = together.forward(step)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        cache.accept([[0]] * 3)
        together.accept([[0]] * 3)
        together.rollback(together.lengths - 1)  # as before the step: `together` serves the next cache


# -- draftsman serve: waiting requests join the running batch --------------------------------

SERVE_PROMPTS = ["def parse(text):\n", "x = [", "class Foo:\n", "import os\n"]


@pytest.fixture
def slow_server_decoder(chat_target):
    """An n-gram decoder whose rounds each sleep 20 ms: a long request stays running while the
    test queues others."""
    from serving import ngram_decoder

    return slowed(ngram_decoder(chat_target[0]))


def slowed(decoder):
    import time

    propose = decoder.engine.drafter.propose

    def slowed(contexts):
        time.sleep(0.02)
        return propose(contexts)

    decoder.engine.drafter.propose = slowed
    return decoder


def start_long_stream(batcher, decoder, min_new_tokens=60, joins=1):
    """A 60-token stream, read until its first chunk (it runs): (job, chunk iterator, chunks).
    Its row waits for the test's requests to be queued (hold_until_joined)."""
    job, chunks = batcher.stream(decoder.encode(SERVE_PROMPTS[:1]), {"max_new_tokens": 60,
                                                                     "min_new_tokens": min_new_tokens})
    first = [next(chunks)[1]]
    hold_until_joined(batcher, decoder, job, joins)
    return job, chunks, first


def hold_until_joined(batcher, decoder, job, joins=1, queued=1):
    """Until `joins` requests have joined `job`'s batch, a round that runs its row alone with fewer
    than `queued` requests queued waits for them (30 s at most): the test's next requests then find
    the row running however slow the test's thread, where the 20 ms rounds alone left it about a
    second. A join is a request entering the batch (Batcher._enter), so two that join in the same
    round count as two."""
    import time

    propose, enter = decoder.engine.drafter.propose, batcher._enter
    seen = {"joins": 0}

    def entering(*args):
        seen["joins"] += 1
        return enter(*args)

    def held(contexts):
        deadline = time.monotonic() + 30
        while (job.stats is None and len(contexts) == 1 and seen["joins"] < joins
               and len(batcher.waiting) < queued and time.monotonic() < deadline):
            time.sleep(0.002)
        return propose(contexts)

    batcher._enter = entering
    decoder.engine.drafter.propose = held


def test_a_request_joins_the_running_batch_and_is_answered_before_it_ends(chat_target):
    """... and the metrics count the generation as its requests end (the target as its own draft
    model: every draft accepted, so the accepted counts are not all 0)."""
    import threading

    from draftsman.serve_batch import Batcher
    from draftsman.serve_metrics import ServeMetrics

    decoder = slowed(draftsman.load({"target": {"path": str(chat_target[0])},
                                     "drafter": {"name": "draft_model", "path": str(chat_target[0]), "k": 3}}))
    metrics = ServeMetrics("tiny", "draft_model")

    def counter(name, **labels):
        return metrics.registry.get_sample_value(f"draftsman:{name}_total", labels) or 0
    batcher = Batcher(decoder, threading.Lock(), max_rows=4, record=metrics.record)
    long_job, chunks, got = start_long_stream(batcher, decoder, min_new_tokens=8)  # the short one's settings
    short, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:3]), {"max_new_tokens": 8, "min_new_tokens": 8})
    assert rows == 3  # it ran beside the long row
    assert long_job.stats is None, "the short request waited for the long one to end"
    # The metrics count the generation as its requests end, not only when it ends.
    assert counter("request_success", finished_reason="length") == 2 and counter("batches") == 1
    assert 16 < counter("generation_tokens") < 16 + 60
    assert counter("spec_decode_num_accepted_tokens") == sum(map(sum, short.stats.accepted_per_round)) > 0
    got += [chunk for _, chunk in chunks]  # (the decoder is the batch's until it ends)
    want = decoder.generate(SERVE_PROMPTS[1:3], max_new_tokens=8, min_new_tokens=8)
    assert short.texts == want.texts and short.token_ids == want.token_ids
    assert short.stats.finish_reasons == ["length", "length"]
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=8)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]
    assert long_job.stats.finish_reasons == ["length"]
    stats = long_job.stats  # the whole generation's, recorded in parts
    assert counter("request_success", finished_reason="length") == 3 and counter("batches") == 1
    assert counter("batch_rows") == 3 and counter("generation_tokens") == stats.new_tokens == 60 + 16
    assert counter("prompt_tokens") == sum(map(len, decoder.encode(SERVE_PROMPTS[:3])))
    assert counter("target_passes") == stats.rounds and counter("target_pass_rows") == stats.row_rounds
    assert counter("spec_decode_num_draft_tokens") == stats.proposed_tokens
    assert counter("spec_decode_num_accepted_tokens") == sum(map(sum, stats.accepted_per_round))
    for depth, (proposed, accepted) in enumerate(zip(stats.proposed_at_depth, stats.accepted_at_depth)):
        assert counter("spec_decode_num_drafts_per_pos", position=str(depth)) == proposed
        assert counter("spec_decode_num_accepted_tokens_per_pos", position=str(depth)) == accepted
    assert counter("generation_seconds", phase="total") == pytest.approx(stats.total_seconds)


def test_requests_that_cannot_join_wait_for_the_batch_to_end(slow_server_decoder):
    """Other settings, or more rows than max_rows leaves room for: the request runs after the
    running batch, in a batch of its own; a request with a bad prompt fails alone."""
    import threading
    import time

    from draftsman.serve_batch import Batcher

    decoder = slow_server_decoder
    batcher = Batcher(decoder, threading.Lock(), max_rows=2)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    too_long = [5] * decoder.engine.max_context
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens but the target's context"):
        batcher.generate([too_long], {"max_new_tokens": 60, "min_new_tokens": 60})
    assert long_job.stats is None  # the running batch went on
    hold_until_joined(batcher, decoder, long_job, queued=3)  # none of the three can join: they wait
    answers = {}

    def ask(name, ids, args):
        answers[name] = batcher.generate(ids, args)
    # The wide one first: at the head of the queue, only its size keeps it from joining; the
    # small one would fit, but joins no sooner than the wide one before it (the queue's order).
    same = {"max_new_tokens": 60, "min_new_tokens": 60}
    for count, (name, prompts, args) in enumerate([("wide", SERVE_PROMPTS[1:3], same),
                                                   ("small", SERVE_PROMPTS[3:4], same),
                                                   ("other", SERVE_PROMPTS[1:2], {"max_new_tokens": 8,
                                                                                  "lossy_typical_acceptance": True})],
                                                  start=1):
        threading.Thread(target=ask, args=(name, decoder.encode(prompts), args), daemon=True).start()
        deadline = time.time() + 10
        while len(batcher.waiting) < count:  # queued...
            assert time.time() < deadline and long_job.stats is None, "a request did not wait"
            time.sleep(0.005)
    assert long_job.stats is None  # ...while the long row runs
    got += [chunk for _, chunk in chunks]  # the long row ends...
    assert long_job.stats.finish_reasons == ["length"]
    deadline = time.time() + 30
    while len(answers) < 3:
        assert time.time() < deadline, "the waiting requests were not answered"
        time.sleep(0.01)
    # ...and none had run beside it: the wide one joined once the long row had ended, the small
    # one after it (beside one of its rows at most), the other one in a batch of its own.
    assert answers["other"][1] == 1 and answers["wide"][1] == 2 and answers["small"][1] <= 2
    assert answers["small"][0].token_ids == decoder.generate(SERVE_PROMPTS[3:4], **same).token_ids
    assert answers["wide"][0].token_ids == decoder.generate(SERVE_PROMPTS[1:3], **same).token_ids


def test_requests_with_their_own_min_tokens_share_a_batch(slow_server_decoder):
    """min_tokens is a row's own, as max_tokens: a request with another minimum joins the running
    batch, and each request's rows are what they are alone."""
    import threading

    from draftsman.serve_batch import Batcher

    decoder = slow_server_decoder
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder, min_new_tokens=60)
    short, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:3]), {"max_new_tokens": 8, "min_new_tokens": 3})
    assert rows == 3 and long_job.stats is None  # it ran beside the long row
    got += [chunk for _, chunk in chunks]  # (the decoder is the batch's until it ends)
    assert short.token_ids == decoder.generate(SERVE_PROMPTS[1:3], max_new_tokens=8, min_new_tokens=3).token_ids
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]


def test_settings_sent_with_their_default_values_keep_no_request_apart(slow_server_decoder):
    """vLLM's benchmark sends "temperature": 0, "ignore_eos": false and "best_of" / "n" 1 with
    every request; another client leaves them out. Both are the config's values: the requests
    share the running batch."""
    import threading

    from draftsman.serve_batch import Batcher

    decoder = slow_server_decoder
    assert decoder.config["sampling"]["temperature"] == 0 and decoder.config["generation"]["ignore_eos"] is False
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    explicit = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": False, "num_return_sequences": 1}
    out, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), explicit)
    assert rows == 2 and long_job.stats is None  # it ran beside the long row
    got += [chunk for _, chunk in chunks]
    assert out.token_ids == decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=8).token_ids
    other = {"max_new_tokens": 8, "lossy_typical_acceptance": True}  # a value of its own still keeps it apart
    assert batcher_key(other, batcher) != batcher_key({"max_new_tokens": 60, "min_new_tokens": 60}, batcher)


def test_neutral_settings_keep_no_request_apart(slow_server_decoder):
    """Clients send "logit_bias": {}, "presence_penalty": 0, ... with every request: values that
    change nothing, where the config has none, so such a request shares the running batch and
    generates what it would alone. Where the config sets a ban, 0 turns it off: apart."""
    import threading

    from draftsman.serve_batch import Batcher

    decoder = slow_server_decoder
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    neutral = {"max_new_tokens": 8, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
               "no_repeat_ngram_size": 0, "logit_bias": {}, "bad_words_ids": [], "lossy_typical_acceptance": False}
    out, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), neutral)
    assert rows == 2 and long_job.stats is None  # it ran beside the long row
    got += [chunk for _, chunk in chunks]
    assert out.token_ids == decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=8).token_ids
    assert [t for c in got for t in c.token_ids] == decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60,
                                                                     min_new_tokens=60).token_ids[0]
    plain = batcher_key({"max_new_tokens": 8}, batcher)
    assert batcher_key({"max_new_tokens": 8, "lossy_typical_acceptance": True}, batcher) != plain
    batcher.defaults = {**batcher.defaults, "lossy_typical_acceptance": True}  # the config's is on: false turns it off
    assert batcher_key({"lossy_typical_acceptance": False}, batcher) != batcher_key({}, batcher)


def batcher_key(args: dict, batcher) -> str | None:
    from draftsman.serve_batch import _Job

    return _Job([[1]], args, defaults=batcher.defaults).key


def test_a_generation_stops_taking_rows_at_its_limit(slow_server_decoder):
    """Past max_generation_rows rows in all, a generation takes no more: the request waits for
    it to end and runs in the next one."""
    import threading

    from draftsman.serve_batch import Batcher

    decoder = slow_server_decoder
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    batcher.max_generation_rows = 1
    long_job, chunks, got = start_long_stream(batcher, decoder)
    short, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:3]), {"max_new_tokens": 60, "min_new_tokens": 60})
    assert long_job.stats is not None and rows == 2  # it ran after the long row, on its own
    assert short.token_ids == decoder.generate(SERVE_PROMPTS[1:3], max_new_tokens=60, min_new_tokens=60).token_ids


def test_a_joined_request_whose_client_leaves_ends_its_rows(slow_server_decoder):
    import threading

    from draftsman.serve_batch import Batcher

    decoder = slow_server_decoder
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    job, joined = batcher.stream(decoder.encode(SERVE_PROMPTS[1:2]), {"max_new_tokens": 60, "min_new_tokens": 60})
    first = next(joined)  # it joined and runs
    batcher.drop(job)
    rest = [chunk for _, chunk in joined]
    assert rest[-1].finish_reason == "abort" and len(first[1].token_ids) + sum(len(c.token_ids) for c in rest) < 60
    got += [chunk for _, chunk in chunks]
    assert long_job.stats.finish_reasons == ["length"]


@pytest.mark.parametrize("running", [{"presence_penalty": 1.5}, {"top_k": 2, "temperature": 0.8},
                                     {"logit_bias": "first"}, {"no_repeat_ngram_size": 1}],
                         ids=["penalty", "top_k", "logit_bias", "ban"])
def test_a_request_that_leaves_a_setting_out_joins_with_the_configs_not_the_batchs(chat_target, running):
    """The running batch's requests all sent a per-row setting; a request that leaves it out
    joins with the config's value (none), not the batch's one value: its row's settings are the
    config's, it generates what it does alone, and so does the running request (greedy cases)."""
    import threading

    from draftsman.serve_batch import Batcher

    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    want = decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=12).token_ids
    if running.get("logit_bias") == "first":  # ban the joining request's own first token: it would matter
        running = {"logit_bias": {want[0][0]: -100.0}}
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    job, chunks = batcher.stream(decoder.encode(SERVE_PROMPTS[:1]), {"max_new_tokens": 60, "min_new_tokens": 60,
                                                                     **running})
    got = [next(chunks)[1]]
    hold_until_joined(batcher, decoder, job)
    plain, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), {"max_new_tokens": 12})
    assert rows == 2 and job.stats is None  # it ran beside the long row
    got += [chunk for _, chunk in chunks]
    assert decoder.engine._row_sampling[1] == decoder._sampling({})  # the config's settings
    if running.get("temperature", 0.0) == 0.0:
        assert plain.token_ids == want
        alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60, **running)
        assert [t for c in got for t in c.token_ids] == alone.token_ids[0]


def test_typical_acceptance_requests_with_other_sampling_settings_run_apart(chat_target):
    """Typical acceptance takes one sampling setting for the whole batch: a typical-acceptance
    request with another temperature (or bias, penalty, ...) waits for the running batch to end,
    where joining it would stop that batch with an error."""
    import threading

    from draftsman.serve_batch import Batcher

    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    typical = {"lossy_typical_acceptance": True}
    job, chunks = batcher.stream(decoder.encode(SERVE_PROMPTS[:1]), {"max_new_tokens": 60, "min_new_tokens": 60,
                                                                     "temperature": 0.8, **typical})
    got = [next(chunks)[1]]
    hold_until_joined(batcher, decoder, job)  # the other one is queued while this row runs
    other, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), {"max_new_tokens": 8, "temperature": 0.5,
                                                                        **typical})
    assert rows == 1 and len(other.token_ids[0]) <= 8  # in a batch of its own
    got += [chunk for _, chunk in chunks]
    assert job.stats.finish_reasons == ["length"] and sum(len(c.token_ids) for c in got) == 60
    same = {"max_new_tokens": 8, "temperature": 0.8, **typical}
    assert batcher_key(same, batcher) == batcher_key({**same, "max_new_tokens": 12}, batcher)  # limits: per row
    assert batcher_key(same, batcher) != batcher_key({**same, "logit_bias": {5: 1.0}}, batcher)
    assert batcher_key({"temperature": 0.8}, batcher) == batcher_key({"temperature": 0.5}, batcher)  # exact: per row
