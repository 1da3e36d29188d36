"""Checks the per-row settings' tests share (test_row_penalties.py, test_row_biases.py,
test_row_bans.py): a batch whose rows have their own settings gives each row what it gives alone,
in its logprobs and when rows join a running batch."""
import pytest
import torch

import draftsman
from draftsman import JoiningPrompt

from test_row_sampling import PROMPTS
from tiny_models import load_for_reference


NEW = 16  # new tokens per row in the lone-output checks (conftest's `plain` made as many)


def ngram_decoder(target):
    return draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})


def assert_logprobs_are_each_rows_own(target, rows: list[dict], per_prompt: dict, new: int = 8) -> None:
    """Greedy, PROMPTS with one settings dict each (rows; per_prompt: the same as generate's
    lists): processed and raw logprobs and top tokens are each row's alone, and the raw ones the
    reference model's own distribution (before any row's settings)."""
    decoder = ngram_decoder(target)
    for mode in ("processed", "raw"):
        out = decoder.generate(input_ids=PROMPTS, max_new_tokens=new, temperature=0.0, logprobs=mode, top_logprobs=3,
                               **per_prompt)
        for r, (prompt, row) in enumerate(zip(PROMPTS, rows)):
            alone = decoder.generate(input_ids=[prompt], max_new_tokens=new, temperature=0.0, logprobs=mode,
                                     top_logprobs=3, **row)
            assert out.token_ids[r] == alone.token_ids[0], (mode, r)
            assert out.logprobs[r] == pytest.approx(alone.logprobs[0], abs=1e-5), (mode, r)
            assert [[t for t, _ in top] for top in out.top_logprobs[r]] == \
                [[t for t, _ in top] for top in alone.top_logprobs[0]], (mode, r)
    reference = load_for_reference(target)
    for prompt, tokens, values in zip(PROMPTS, out.token_ids, out.logprobs):  # raw: the target's own
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
        own = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert values == pytest.approx(own.tolist(), abs=1e-4)


def assert_joining_rows_bring_their_own(target, cases: list[tuple[dict, dict]], new: int):
    """For each (batch's settings, joining row's warpers): PROMPTS[2] joins a batch of PROMPTS[0]
    and PROMPTS[3] at the third round, its prefill two tokens a round; every row gives what it
    gives alone. Returns alone(prompt, **settings), the greedy lone output, for further checks."""
    decoder = ngram_decoder(target)
    decoder.engine.join_prefill_chunk = 2

    def alone(prompt, **row):
        return decoder.generate(input_ids=[prompt], max_new_tokens=new, temperature=0.0, **row).token_ids[0]

    for batch, joining in cases:
        rounds = [0]

        def joins():
            rounds[0] += 1
            return [JoiningPrompt(PROMPTS[2], new, warpers=joining)] if rounds[0] == 3 else []

        tokens: dict[int, list[int]] = {}
        for row, chunk in decoder.stream_batch([PROMPTS[0], PROMPTS[3]], joining=joins, max_new_tokens=new,
                                               temperature=0.0, **batch):
            tokens.setdefault(row, []).extend(chunk.token_ids)
        assert tokens[0] == alone(PROMPTS[0], **batch) and tokens[1] == alone(PROMPTS[3], **batch), batch
        assert tokens[2] == alone(PROMPTS[2], **joining), (batch, joining)
    return alone


# The drafters every per-row setting is checked through (test_row_min_new_tokens.drafters' names).
DRAFTERS = ["none", "ngram", "draft_model", "draft_model_tree", "medusa", "eagle3", "mtp", "cascade"]


def lone_and_batched(decoder, rows: list[dict], per_prompt: dict, new: int) -> tuple[list, list]:
    """Greedy, PROMPTS with one settings dict each: (each row's lone output, the batch's rows)."""
    lone = [decoder.generate(input_ids=[p], max_new_tokens=new, temperature=0.0, **row).token_ids[0]
            for p, row in zip(PROMPTS, rows)]
    return lone, decoder.generate(input_ids=PROMPTS, max_new_tokens=new, temperature=0.0, **per_prompt).token_ids
