"""max_new_tokens per row: requests with different limits generate as one batch (how `draftsman
serve` batches them), and each row is what its request gives on its own."""
import pytest

import draftsman

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12], [7, 7, 7]]
LIMITS = [2, 11, 5, 8]


@pytest.mark.parametrize("drafter", [{"name": "none"}, {"name": "ngram", "k": 3, "min_ngram": 1},
                                     {"name": "ngram", "k": 3, "min_ngram": 1, "adaptive": True}],
                         ids=["none", "ngram", "ngram_adaptive"])
def test_each_row_stops_at_its_own_limit(tiny_models, drafter):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": drafter})
    together = decoder.generate(input_ids=PROMPTS, max_new_tokens=LIMITS, min_new_tokens=2)
    proposed = 0
    for prompt, limit, tokens, reason in zip(PROMPTS, LIMITS, together.token_ids, together.stats.finish_reasons):
        alone = decoder.generate(input_ids=[prompt], max_new_tokens=limit, min_new_tokens=2)
        assert tokens == alone.token_ids[0]
        assert reason == alone.stats.finish_reasons[0]
        proposed += alone.stats.proposed_tokens
    assert together.stats.finish_reasons.count("length") >= 3  # the limits, not EOS, ended most rows
    if not drafter.get("adaptive"):  # trees cut to each row's own room, as alone (adaptive's depend on the batch)
        assert together.stats.proposed_tokens == proposed
    assert [len(t) for t, r in zip(together.token_ids, together.stats.finish_reasons) if r == "length"] == [
        m for m, r in zip(LIMITS, together.stats.finish_reasons) if r == "length"]


def test_limits_per_prompt_cover_its_samples(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    out = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=[3, 6], min_new_tokens=3, temperature=1.0,
                           num_return_sequences=2, seed=1)
    assert [len(t) for t in out.token_ids[:2]] == [3, 3]  # min_new_tokens = its limit: no early EOS
    assert all(len(t) == 6 or r == "eos" for t, r in zip(out.token_ids[2:], out.stats.finish_reasons[2:]))
    rows = [(row, chunk) for row, chunk in decoder.stream_batch(PROMPTS[:2], max_new_tokens=[3, 6], min_new_tokens=3,
                                                                temperature=1.0, num_return_sequences=2, seed=1)]
    assert [[t for r, c in rows if r == row for t in c.token_ids] for row in range(4)] == out.token_ids


@pytest.mark.parametrize("limits, message", [
    ([3], r"max_new_tokens has 1 values for 2 prompts: give one number, or one per prompt"),
    ([3, 0], r"max_new_tokens must be >= 1 \(a whole number\), got 0"),
    ([3, 2.5], r"max_new_tokens must be >= 1 \(a whole number\), got 2.5"),
])
def test_bad_limits_are_named(tiny_models, limits, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=message):
        decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=limits)
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens = 2\]"):
        decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=[2, 9], min_new_tokens=5)
