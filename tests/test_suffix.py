"""The `suffix` drafter (SuffixDecoding): the longest earlier occurrence of the context's suffix,
in the row's own tokens, the other running rows' outputs or the cache of finished rows, gives a
frequency-scored tree as deep as the match earns; the cache outlives a generate call and evicts
its oldest rows first. Greedy equality with the target's own generate is in
test_greedy_equality.py (where the batched run drafts from the cache); sampling stays the
target's (chi-square below)."""
import pytest
import torch

import draftsman
from draftsman.drafters import DETERMINISTIC, RoundFeedback
from draftsman.drafters.suffix import SuffixDrafter
from draftsman.drafters.suffix_index import SuffixIndex
from draftsman.verifier.sampling import SamplingParams

from test_engine_sampling import ALPHA, exact_marginals, fit_pvalue
from tiny_models import load_for_reference


def suffix(**opts) -> SuffixDrafter:
    return SuffixDrafter(SuffixDrafter.Options(**opts))


def finish(d: SuffixDrafter, rows_outputs: list[list[int]], keep: list[int] = ()) -> None:
    """One round as the engine runs it: each row emits its output, then only `keep` rows stay."""
    d.observe(RoundFeedback([[] for _ in rows_outputs], rows_outputs))
    d.keep_rows(list(keep))


def test_a_match_is_extended_backwards_past_the_table_sizes():
    index = SuffixIndex((2,))
    index.extend(0, [9, 1, 2, 3, 4, 5, 7, 3, 4, 5, 8])
    # [4, 5] ends twice; going back, [1, 2, 3, 4, 5] matches 5 tokens at the first place, 3 at the second.
    assert index.longest_matches([0, 1, 2, 3, 4, 5], max_match=24, max_reads=8) == (5, [(0, 6)])
    assert index.longest_matches([0, 1, 2, 3, 4, 5], max_match=4, max_reads=8) == (4, [(0, 6)])
    # Equal matches come latest first; max_reads reads only the latest places.
    assert index.longest_matches([3, 4, 5], max_match=24, max_reads=8) == (3, [(0, 10), (0, 6)])
    assert index.longest_matches([3, 4, 5], max_match=24, max_reads=1) == (3, [(0, 10)])
    assert index.longest_matches([6, 6], max_match=24, max_reads=8) == (0, [])
    at_start = SuffixIndex((2,))
    at_start.extend(0, [4, 5, 6, 3])
    assert at_start.longest_matches([3, 4, 5], max_match=24, max_reads=8) == (2, [(0, 2)])  # nothing before it


def test_an_evicted_sequence_leaves_the_tables_as_if_never_added():
    # [8, 6] twice in the first and once in the last: its places shrink to the last's alone.
    sequences = [[1, 2, 3, 1, 2, 4, 8, 6, 8, 6, 1], [2, 3, 1, 2, 5], [7, 1, 2, 3, 1], [8, 6, 0]]
    index = SuffixIndex((1, 2, 4))
    for i, s in enumerate(sequences):
        index.extend(i, s)
    index.remove_oldest()
    fresh = SuffixIndex((1, 2, 4))
    for i, s in list(enumerate(sequences))[1:]:
        fresh.extend(i, s)
    assert index.places == fresh.places and index.tokens == fresh.tokens == 13
    assert index.longest_matches([1, 2], 24, 8) == fresh.longest_matches([1, 2], 24, 8)


def test_n_grams_sharing_a_hash_are_told_apart_by_their_tokens(monkeypatch):
    import draftsman.drafters.suffix_index as S

    monkeypatch.setattr(S, "hash", lambda key: 0, raising=False)  # every n-gram collides
    index = S.SuffixIndex((2,))
    index.extend(0, [1, 2, 3, 9, 9, 4, 5, 6])
    index.extend(1, [7, 7, 8, 8])
    assert index.longest_matches([0, 1, 2], max_match=24, max_reads=64) == (2, [(0, 2)])
    assert index.longest_matches([4, 5], max_match=24, max_reads=64) == (2, [(0, 7)])
    assert index.longest_matches([5, 4], max_match=24, max_reads=64) == (0, [])
    index.remove_oldest()
    assert index.longest_matches([0, 1, 2], max_match=24, max_reads=64) == (0, [])
    assert index.longest_matches([7, 8], max_match=24, max_reads=64) == (2, [(1, 3)])
    two_sizes = S.SuffixIndex((1, 2))
    two_sizes.extend(0, [1, 2, 3, 9, 9, 4, 5, 6])
    # No place of the 2-gram [0, 5] holds it: the 1-gram [5] is looked up next.
    assert two_sizes.longest_matches([0, 5], max_match=24, max_reads=64) == (1, [(0, 7)])


def brute_force_matches(sequences: dict[int, list[int]], context: list[int], smallest: int, max_match: int):
    """Every place (a token follows) whose tokens before it match the context's end by at least
    `smallest`, longest first: (m, places latest first) as SuffixIndex.longest_matches gives them."""
    found = []
    for sequence_id, tokens in sequences.items():
        for end in range(1, len(tokens)):
            m = 0
            while m < min(max_match, end, len(context)) and tokens[end - m - 1] == context[-m - 1]:
                m += 1
            if m >= smallest:
                found.append((m, sequence_id, end))
    if not found:
        return 0, []
    best = max(m for m, _, _ in found)
    order = list(sequences)  # latest first: later sequences, then later ends
    places = sorted(((i, e) for m, i, e in found if m == best), key=lambda p: (order.index(p[0]), p[1]), reverse=True)
    return best, places


def test_matches_equal_a_brute_force_search_through_evictions_and_removals():
    import random

    rng = random.Random(0)
    for trial in range(60):
        sizes = (2, 4, 8) if trial % 2 else (1, 3)
        index, held = SuffixIndex(sizes), {}
        for sequence_id in range(8):
            tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 30))]
            index.extend(sequence_id, tokens)
            held[sequence_id] = tokens
            if rng.random() < 0.3:  # the cache's eviction, or a running row's lazy removal
                gone = next(iter(held)) if rng.random() < 0.5 else rng.choice(list(held))
                index.remove_oldest() if gone == next(iter(held)) else index.remove(gone)
                del held[gone]
            context = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            want = brute_force_matches(held, context, sizes[0], max_match=10)
            assert index.longest_matches(context, max_match=10, max_reads=10_000) == want, (trial, sequence_id)


def test_a_growing_sequence_indexes_only_what_it_gained():
    grown, whole = SuffixIndex((1, 2)), SuffixIndex((1, 2))
    tokens = [5, 6, 5]
    grown.extend(0, tokens)
    tokens += [6, 7, 5, 6]
    grown.extend(0, tokens)
    whole.extend(0, list(tokens))
    assert grown.places == whole.places


def test_the_tree_scores_nodes_by_the_share_of_occurrences_through_them():
    # [0, 1, 2] occurred four times before the context's end, followed by 3 4 ... (twice), 3 6 ... and 5.
    ctx = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 6, 0, 1, 2, 5, 0, 1, 2]
    d = suffix(min_match=1, min_token_prob=0.3, max_spec_factor=2.0)
    d.begin([ctx], SamplingParams(), torch.Generator())
    (tree,) = d.propose([ctx])
    # A match of 3 tokens earns depth 6. 3 is on 3 of the 4 paths, the 3 4 0 1 2 3 path on 2;
    # 6 and 5 (1 in 4) are below 0.3.
    assert tree.tokens.tolist() == [3, 4, 0, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    assert bool((tree.kinds == DETERMINISTIC).all())
    assert d.report()["from_own_tokens"] == 1
    d = suffix(min_match=1, min_token_prob=0.0, max_spec_factor=2.0, max_spec_tokens=3)
    d.begin([ctx], SamplingParams(), torch.Generator())
    assert d.propose([ctx])[0].tokens.tolist() == [3, 4, 0]  # the best 3 nodes
    d = suffix(min_match=1, min_token_prob=0.0, max_spec_factor=2.0, max_spec_tokens=8)
    d.begin([ctx], SamplingParams(), torch.Generator())
    (tree,) = d.propose([ctx])
    # Then two of the once-seen nodes, the first made first (the 5 0 ... path, read latest first):
    # a node is never kept without its parent.
    assert tree.tokens.tolist() == [5, 0, 3, 4, 0, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, -1, 2, 3, 4, 5, 6]


def test_the_draft_is_as_deep_as_the_match_earns():
    ctx = [9, 8, 7, 1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 8, 7]
    for factor, offset, depth in [(1.0, 0.0, 3), (2.0, 0.0, 6), (1.0, 2.0, 5), (0.5, 0.0, 1)]:
        d = suffix(max_spec_factor=factor, max_spec_offset=offset)
        d.begin([ctx], SamplingParams(), torch.Generator())
        assert d.propose([ctx])[0].tokens.tolist() == [1, 2, 3, 4, 5, 6][:depth], (factor, offset)
    d = suffix(max_spec_factor=4.0)
    d.begin([ctx], SamplingParams(), torch.Generator())
    d.depth_limit = 2  # adaptive speculation asks for less
    assert d.propose([ctx])[0].tokens.tolist() == [1, 2]
    d.depth_limit = 0
    assert d.propose([ctx])[0].size == 0


def test_finished_rows_are_cached_across_generate_calls_oldest_evicted_first():
    d = suffix(max_cached_requests=2, max_spec_factor=4.0)
    prompts = [[1, 2, 3], [4, 5, 6]]
    d.begin(prompts, SamplingParams(), torch.Generator())
    finish(d, [[7, 8, 9], [10, 11]], keep=[1])  # row 0 finishes, row 1 goes on
    assert list(d.cache.sequences.values()) == [[1, 2, 3, 7, 8, 9]]  # the prompt's tail, then the output
    finish(d, [[12]])
    assert list(d.cache.sequences.values()) == [[1, 2, 3, 7, 8, 9], [4, 5, 6, 10, 11, 12]]
    # The next call drafts from the cache: [2, 3] was followed by 7 8 9.
    d.begin([[0, 2, 3]], SamplingParams(), torch.Generator())
    assert d.propose([[0, 2, 3]])[0].tokens.tolist() == [7, 8, 9]
    assert d.report()["from_cache"] == 1
    finish(d, [[5]])
    assert len(d.cache.sequences) == 2 and d.cache.sequences[0 + 2] == [0, 2, 3, 5]  # the first one left
    d.begin([[0, 2, 3]], SamplingParams(), torch.Generator())
    assert d.propose([[0, 2, 3]])[0].tokens.tolist() == [5]
    assert d.report()["cache"] == {"requests": 2, "tokens": 10}


def test_the_longer_match_wins_between_own_tokens_and_cache_and_a_tie_pools_them():
    d = suffix(max_spec_factor=4.0)
    d.begin([[7, 1, 2, 3, 9]], SamplingParams(), torch.Generator())
    finish(d, [[4]])
    # Own tokens: [2, 3] then 8 (a match of 2); the cache: [1, 2, 3] then 9 4 (a match of 3).
    ctx = [5, 2, 3, 8, 1, 2, 3]
    d.begin([ctx], SamplingParams(), torch.Generator())
    assert d.propose([ctx])[0].tokens.tolist() == [9, 4] and d.report()["from_cache"] == 1
    ctx = [1, 2, 3, 8, 1, 2, 3]  # own tokens now match 3 too: both continuations, own first
    d.begin([ctx], SamplingParams(), torch.Generator())
    assert d.propose([ctx])[0].tokens.tolist() == [8, 1, 2, 3, 9, 4]


def test_the_cache_holds_at_most_max_cached_tokens():
    d = suffix(max_cached_tokens=10)
    for prompt, output in [([1, 2, 3], [4, 5]), ([6, 7], [8, 9]), ([11], [12])]:  # 5 + 4 + 2 = 11 tokens
        d.begin([prompt], SamplingParams(), torch.Generator())
        finish(d, [output])
    assert list(d.cache.sequences.values()) == [[6, 7, 8, 9], [11, 12]] and d.cache.tokens == 6
    d.begin([[1]], SamplingParams(), torch.Generator())
    finish(d, [list(range(20, 31))])  # longer than the cache: it empties it and leaves too
    assert not d.cache.sequences and d.cache.tokens == 0 and not d.cache.places


def test_a_row_is_cached_after_its_prompts_last_max_tree_depth_tokens():
    d = suffix(max_tree_depth=4)
    d.begin([[1, 2, 3, 4, 5, 6]], SamplingParams(), torch.Generator())
    finish(d, [[7, 8]])
    assert list(d.cache.sequences.values()) == [[3, 4, 5, 6, 7, 8]]


def test_without_a_cache_only_the_rows_own_tokens_draft():
    d = suffix(max_cached_requests=0)
    d.begin([[1, 2, 3]], SamplingParams(), torch.Generator())
    finish(d, [[4, 5]])
    assert not d.cache.sequences
    d.begin([[0, 2, 3]], SamplingParams(), torch.Generator())
    assert d.propose([[0, 2, 3]])[0].size == 0 and d.report()["no_match"] == 1


def test_rows_a_stopped_stream_left_are_cached_at_the_next_call():
    d = suffix()
    d.begin([[1, 2, 3]], SamplingParams(), torch.Generator())
    d.observe(RoundFeedback([[]], [[4, 5]]))  # the consumer stopped: no keep_rows
    d.begin([[1, 2, 3]], SamplingParams(), torch.Generator())
    assert list(d.cache.sequences.values()) == [[1, 2, 3, 4, 5]]


def test_a_prompt_with_no_output_is_not_cached():
    d = suffix()
    d.begin([[1, 2, 3]], SamplingParams(), torch.Generator())
    d.keep_rows([])
    assert not d.cache.sequences


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="min_match"):
        SuffixDrafter.Options(min_match=30)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixDrafter.Options(min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_cached_requests"):
        SuffixDrafter.Options(max_cached_requests=-1)
    with pytest.raises(ValueError, match="max_cached_tokens"):
        SuffixDrafter.Options(max_cached_tokens=-1)
    with pytest.raises(ValueError, match="max_spec_factor"):
        SuffixDrafter.Options(max_spec_factor=0)
    with pytest.raises(ValueError, match="valid options"):
        draftsman.drafters.build_drafter({"name": "suffix", "k": 4}, None)


def test_sampling_from_the_cache_follows_the_target(tiny_models):
    """T=1: a first call fills the cache with 6000 sampled continuations of one prompt; the second
    call's rows draft the most frequent of them, and its first two tokens still follow the
    target's exact marginals."""
    target = tiny_models["llama"][0]
    prompt, rows = [1, 2, 3, 4, 5, 1, 2, 3], 6000
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "suffix", "max_cached_requests": rows,
                                                                       "min_token_prob": 0.0, "max_spec_factor": 4}})
    dec.generate(input_ids=[prompt] * rows, max_new_tokens=2, temperature=1.0, seed=1)
    out = dec.generate(input_ids=[prompt] * rows, max_new_tokens=2, temperature=1.0, seed=2)
    assert out.stats.drafter_report["from_cache"] > 0.9 * rows
    assert out.stats.tau > 1.1, "drafts must be accepted and rejected"
    p1, p2 = exact_marginals(load_for_reference(target), prompt, SamplingParams(1.0), dec.engine.eos_token_ids)
    tokens = torch.tensor([t[:2] for t in out.token_ids if len(t) >= 2])
    assert fit_pvalue(torch.tensor([t[0] for t in out.token_ids]), p1) > ALPHA
    assert fit_pvalue(tokens[:, 1], p2) > ALPHA


def test_benchmarks_time_each_call_with_the_cache_forgotten(tiny_models):
    """compare and demo run a prompt again (warm-up, repeats): each timed call starts with the
    drafter's memory of earlier outputs dropped, through cascade and adaptive too."""
    from draftsman.bench.runner import Ours

    plain = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": {"name": "none"}})
    prompt = [1, 2, 3, 4, 5, 6, 7]
    for spec in ({"name": "suffix"}, {"name": "suffix", "adaptive": True},
                 {"name": "cascade", "drafters": [{"name": "ngram", "min_ngram": 3}, {"name": "suffix"}]}):
        decoder = plain.with_drafter(spec)
        decoder.generate(input_ids=[prompt], max_new_tokens=16, temperature=0.0)
        again = decoder.generate(input_ids=[prompt], max_new_tokens=16, temperature=0.0)
        assert again.stats.tau > 3, spec  # remembered: the answer is drafted from the first one
        timed = Ours("suffix", decoder).run([prompt], 16, 0.0, 0)
        assert timed.stats.tau < 2 and timed.tokens == again.token_ids, spec


def test_a_server_drafts_a_request_from_an_earlier_clients_answer(chat_target):
    """`draftsman serve` keeps one drafter: a request another client sent before is drafted from
    that answer (tau up), and both answers are what plain decoding writes."""
    from serving import call, running

    decoder = draftsman.load({"target": {"path": str(chat_target[0])}, "drafter": {"name": "suffix"}})
    body = {"prompt": "def parse(text):\n", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = decoder.with_drafter({"name": "none"}).generate([body["prompt"]], max_new_tokens=24, temperature=0.0,
                                                          ignore_eos=True)
    with running(decoder) as (_, base):
        first = call(base, "/v1/completions", body)[1]
        second = call(base, "/v1/completions", body)[1]
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == plain.texts[0]
    assert second["draftsman"]["tau"] > 3 > first["draftsman"]["tau"], (first["draftsman"], second["draftsman"])


def test_running_rows_draft_from_each_others_outputs_never_their_own():
    d = suffix(min_token_prob=0.5)
    a, b = [5, 1, 2], [9, 1, 2]
    d.begin([a, b], SamplingParams(), torch.Generator())
    d.propose([a, b])
    d.observe(RoundFeedback([[], []], [[3, 1, 2], [4, 4]]))
    a, b = a + [3, 1, 2], b + [4, 4]
    tree_a, tree_b = d.propose([a, b])
    # [1, 2] ends a's own tokens (then 3 1) and b's output so far (then 4 4), a match of 2 each:
    # pooled, each branch half the occurrences. Were a's own output also read among the running
    # rows, 3 1 would be 2 of 3 and 4 4 below min_token_prob.
    assert tree_a.tokens.tolist() == [3, 1, 4, 4] and tree_a.parents.tolist() == [-1, 0, -1, 2]
    assert tree_b.size == 0
    c = [7, 2, 3]  # a row that joins: a's output after [2, 3]
    d.add_rows([c], [])
    (_, _, tree_c) = d.propose([a, b, c])
    assert tree_c.tokens.tolist() == [1, 2] and d.report()["from_other_rows"] == 1
    d.keep_rows([1, 2])  # a ends: it leaves the running rows for the cache
    assert list(d.cache.sequences.values()) == [[5, 1, 2, 3, 1, 2]]
    assert list(d.running.sequences) == d.row_ids[:1] and d.running.stale_tokens == 6
    assert d.running.longest_matches([2, 3], 24, 64) == (0, [])  # a's places are skipped until compacted
    fresh = SuffixIndex(d.sizes)
    fresh.extend(d.row_ids[0], [9, 1, 2, 4, 4])
    assert d.running.compacted().places == fresh.places


def test_the_running_rows_are_indexed_again_once_as_much_is_stale_as_live():
    d = suffix()
    d.begin([[1, 2], [3, 4]], SamplingParams(), torch.Generator())
    d.observe(RoundFeedback([[], []], [list(range(10, 5010)), list(range(6000, 6100))]))
    d.keep_rows([0, 1])
    assert d.running.stale_tokens == 0 and d.running.tokens == 5002 + 102
    d.keep_rows([1])  # 5002 stale against 102 live: built again
    assert d.running.stale_tokens == 0 and list(d.running.sequences) == [d.row_ids[0]]
    assert d.running.places == d.running.compacted().places


def test_a_row_that_joins_drafts_from_a_running_row_with_the_same_prompt(tiny_models):
    """Continuous batching: the same prompt joins three rounds after the first started; it drafts
    the first row's output so far and writes what it writes alone."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": {"name": "suffix"}})
    prompt = [1, 2, 3, 4, 5, 6, 7]
    alone = decoder.with_drafter({"name": "none"}).generate(input_ids=[prompt], max_new_tokens=32,
                                                            temperature=0.0, ignore_eos=True).token_ids[0]
    rounds = [0]

    def joining():
        rounds[0] += 1
        return [(prompt, 32)] if rounds[0] == 4 else []

    stats, tokens = draftsman.GenerationStats(), {}
    for row, chunk in decoder.stream_batch([prompt], stats=stats, joining=joining, max_new_tokens=32,
                                           temperature=0.0, ignore_eos=True):
        tokens.setdefault(row, []).extend(chunk.token_ids)
    assert tokens == {0: alone, 1: alone}
    assert stats.drafter_report["from_other_rows"] > 0
