"""Penalties per row: rows with their own repetition, presence and frequency penalties share one
batch (generate's lists, stream_batch's joining rows, serve's requests). A penalty changes a row's
logits from its own context only, so each row's logits are penalised as they are alone
(verifier/block_penalties.py takes a value per row) and each row generates what it generates alone."""
import threading

import pytest
import torch

import draftsman
from draftsman.verifier.block_penalties import penalize_block_counts_, penalize_block_repeats_
from draftsman.verifier.sampling import SamplingParams

from row_settings import (DRAFTERS, assert_joining_rows_bring_their_own, assert_logprobs_are_each_rows_own,
                          lone_and_batched)
from test_row_min_new_tokens import close_draft, drafters  # noqa: F401 (a fixture)
from test_row_sampling import PROMPTS

NEW = 16
PENALTIES = [dict(repetition_penalty=1.5), dict(), dict(presence_penalty=1.5, frequency_penalty=0.8),
             dict(repetition_penalty=1.2, frequency_penalty=1.0)]


def per_prompt(rows: list[dict]) -> dict:
    """generate's per-prompt lists (None: the config's, no penalty) from one dict per row."""
    names = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    return {name: [row.get(name) for row in rows] for name in names}


def test_block_penalties_per_row_equal_each_row_alone():
    """A (B,) tensor of penalties gives each row exactly the logits its own number gives it, and a
    row's neutral value leaves its logits bit-identical."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 4, 30
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    ancestors = torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T).clone()
    seen = torch.rand(B, V, generator=g) < 0.3
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    repetition, presence, frequency = [1.3, 1.0, 0.7], [0.5, 0.0, 1.1], [0.2, 0.0, 0.9]
    per_row = penalize_block_repeats_(logits.clone(), tokens, ancestors, seen, torch.tensor(repetition))
    counted = penalize_block_counts_(logits.clone(), tokens, ancestors, counts, torch.tensor(presence),
                                     torch.tensor(frequency))
    for b in range(B):
        alone = penalize_block_repeats_(logits[b:b + 1].clone(), tokens[b:b + 1], ancestors[b:b + 1], seen[b:b + 1],
                                        repetition[b])
        assert torch.equal(per_row[b], alone[0]), b
        alone = penalize_block_counts_(logits[b:b + 1].clone(), tokens[b:b + 1], ancestors[b:b + 1], counts[b:b + 1],
                                       presence[b], frequency[b])
        assert torch.equal(counted[b], alone[0]), b
    assert torch.equal(per_row[1], logits[1]) and torch.equal(counted[1], logits[1])


@pytest.mark.parametrize("name", DRAFTERS)
def test_rows_with_their_own_penalties_each_generate_as_alone(tiny_models, fresh_heads, name,
                                                             close_draft):  # noqa: F811
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": drafters(tiny_models, close_draft, fresh_heads)[name]})
    lone, batched = lone_and_batched(decoder, PENALTIES, per_prompt(PENALTIES), NEW)
    assert batched == lone, name
    plain = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0).token_ids
    assert sum(a != b for a, b in zip(plain, lone)) >= 2  # the penalties mattered
    assert batched[1] == plain[1]  # the row without one is plain decoding


def test_processed_logprobs_are_each_rows_own_penalised_distribution(tiny_models):
    assert_logprobs_are_each_rows_own(tiny_models["llama"][0], PENALTIES, per_prompt(PENALTIES))


def test_joining_rows_bring_their_own_penalties(tiny_models):
    """A penalised row joins an unpenalised batch (its tables made then), an unpenalised one a
    penalised batch; each is what it is alone, the rows already running too. 1 is no repetition
    penalty, beside a batch that has one."""
    alone = assert_joining_rows_bring_their_own(
        tiny_models["llama"][0], [(dict(), PENALTIES[2]), (PENALTIES[0], dict(repetition_penalty=1.0))], NEW)
    assert alone(PROMPTS[2], **PENALTIES[0]) != alone(PROMPTS[2])  # the batch's penalty would have mattered


def test_requests_with_their_own_penalties_share_a_serve_batch(chat_target):
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, slowed, start_long_stream
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    args = {"max_new_tokens": 12, "presence_penalty": 1.5, "repetition_penalty": 1.3}
    penalised, rows = batcher.generate(decoder.encode(SERVE_PROMPTS[1:2]), args)
    assert rows == 2 and long_job.stats is None  # it ran beside the long row
    got += [chunk for _, chunk in chunks]  # (the batch ends before the decoder runs alone)
    assert penalised.token_ids == decoder.generate(SERVE_PROMPTS[1:2], **args).token_ids
    assert penalised.token_ids != decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=12).token_ids
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]


def test_engine_rows_may_differ_in_penalties_but_not_in_typical_acceptance(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    rows = [SamplingParams(0.0, repetition_penalty=1.3), SamplingParams(0.0, presence_penalty=0.4)]
    out, _ = decoder.engine.generate(PROMPTS[:2], 6, rows)
    assert out == [decoder.engine.generate([p], 6, params)[0][0] for p, params in zip(PROMPTS, rows)]
    with pytest.raises(ValueError, match=r"differ in \['lossy_typical_acceptance'\]"):
        decoder.engine.generate(PROMPTS[:2], 6, [SamplingParams(1.0),
                                                 SamplingParams(1.0, lossy_typical_acceptance=True)])


def test_raw_logprobs_are_each_rows_own_before_its_penalties(tiny_models):
    """logprobs=True reads the target's own distribution: a penalised row's, beside an unpenalised
    first row, is taken before its penalties, as alone."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    rows = [dict(), dict(repetition_penalty=1.5, presence_penalty=1.0)]
    out = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=8, temperature=0.0, logprobs=True,
                           **per_prompt(rows))
    for r, row in enumerate(rows):
        alone = decoder.generate(input_ids=[PROMPTS[r]], max_new_tokens=8, temperature=0.0, logprobs=True, **row)
        assert out.token_ids[r] == alone.token_ids[0]
        assert out.logprobs[r] == pytest.approx(alone.logprobs[0], abs=1e-5), r


def test_penalty_tables_follow_rows_that_come_and_go(tiny_models):
    """The penalised row leaves first; rows without penalties join and leave while no row needs
    the tables (a table kept then would no longer match the rows); then a penalised row joins.
    Every row is what it is alone."""
    from draftsman.verifier.joining import JoiningRow

    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                              "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    engine, plain, penalised = decoder.engine, SamplingParams(0.0), SamplingParams(0.0, repetition_penalty=1.5)
    rows = [(PROMPTS[0], 2, penalised), (PROMPTS[1], 24, plain), (PROMPTS[2], 5, plain)]
    later = {3: [JoiningRow(PROMPTS[3], 24, sampling=plain), JoiningRow(PROMPTS[0], 24, sampling=plain)],
             9: [JoiningRow(PROMPTS[2], 12, sampling=penalised)]}
    rounds = [0]

    def joining():
        rounds[0] += 1
        return later.get(rounds[0], [])

    tokens: dict[int, list[int]] = {}
    for row, new in engine.stream([p for p, _, _ in rows], [n for _, n, _ in rows], [s for _, _, s in rows],
                                  joining=joining):
        tokens.setdefault(row, []).extend(new)
    wanted = rows + [(j.prompt, j.max_new_tokens, j.sampling) for r in sorted(later) for j in later[r]]
    for r, (prompt, limit, params) in enumerate(wanted):
        assert tokens[r] == engine.generate([prompt], limit, params)[0][0], r


def test_drafts_are_penalised_as_each_rows_target_will_be():
    """DraftContext.round under each row's own settings (a RowSampling): each row's draft logits,
    at the root and at a deeper node of a tree, are penalised exactly as that row's alone."""
    from draftsman.drafters.repeats import DraftContext, DraftRepeats
    from draftsman.verifier.sampling import RowSampling

    prompts, rows = [[4, 5], [7], [1, 2]], [[4, 5, 9, 9], [7, 7, 0], [1, 2, 2]]
    settings = [SamplingParams(0.0, repetition_penalty=1.5), SamplingParams(0.7, presence_penalty=0.5,
                                                                             frequency_penalty=0.25),
                SamplingParams(0.0)]
    logits = torch.randn(3, 2, 10, generator=torch.Generator().manual_seed(1))  # (B, K, width): a tree level
    together = DraftContext(prompts, 10, "cpu").round(RowSampling(settings), rows, 10, None)
    state = DraftRepeats.plus(together.root_state[:, None].expand(3, 2, -1), torch.tensor([[2, 3]] * 3))
    mixed = together.penalise(logits, state)
    for b, params in enumerate(settings):
        alone = DraftContext(prompts[b:b + 1], 10, "cpu").round(params, rows[b:b + 1], 10, None)
        want = logits[b] if alone is None else alone.penalise(logits[b:b + 1], state[b:b + 1])[0]
        assert torch.allclose(mixed[b], want, atol=1e-6), b
    assert not torch.allclose(mixed[0], logits[0]) and torch.equal(mixed[2], logits[2])
    some = torch.tensor([2, 0])  # rows a drafter drafts for (medusa: the rows with a hidden state)
    assert torch.equal(together.rows(some).penalise(logits[some], state[some]), mixed[some])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_with_their_own_penalties_accept_their_self_drafts(tiny_models, temperature):
    """The target as its own draft model, penalising its drafts: rows with other penalties than
    the first row's each accept (almost) every draft, so each row's drafts were penalised as its
    own target logits are."""
    target = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(target), "k": 4,
                                          "penalise_drafts": True}})
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=20, temperature=temperature, seed=2, ignore_eos=True,
                           **per_prompt([dict(repetition_penalty=1.8), dict(), dict(presence_penalty=1.5,
                                                                                    frequency_penalty=1.0),
                                         dict(repetition_penalty=1.3, presence_penalty=0.8)]))
    rates = out.stats.per_position_acceptance
    assert out.stats.proposed_at_depth[0] >= 8 and min(rates) > 0.95, rates


@pytest.mark.parametrize("name", ["eagle3", "mtp", "draft_model", "medusa"])
def test_drafters_penalise_drafts_under_each_rows_settings(tiny_models, close_draft, fresh_heads, name):  # noqa: F811
    """The drafters that penalise their drafts are given the rows' own settings each round."""
    spec = {**drafters(tiny_models, close_draft, fresh_heads)[name], "penalise_drafts": True} \
        if name == "draft_model" else drafters(tiny_models, close_draft, fresh_heads)[name]
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": spec})
    context_rounds = []
    begin = decoder.engine.drafter.begin

    def beginning(*args):
        begin(*args)
        round_of = decoder.engine.drafter.draft_context.round
        decoder.engine.drafter.draft_context.round = lambda sampling, *rest: (context_rounds.append(sampling),
                                                                              round_of(sampling, *rest))[1]

    decoder.engine.drafter.begin = beginning
    decoder.generate(input_ids=PROMPTS, max_new_tokens=6, temperature=0.0, ignore_eos=True, **per_prompt(PENALTIES))
    mixed = [s for s in context_rounds if hasattr(s, "rows") and len(s.rows) == len(PROMPTS)]
    assert mixed, context_rounds
    assert [p.repetition_penalty for p in mixed[0].rows] == [row.get("repetition_penalty")
                                                                         for row in PENALTIES]
