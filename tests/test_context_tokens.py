"""The per-row token tables the penalties read (verifier/context_tokens.py), kept up to date round
by round, equal the tables rebuilt from the whole rows at every step, as rows grow and leave."""
import random

import pytest
import torch

from draftsman.verifier.context_tokens import ContextTokens
from draftsman.verifier.sampling import token_mask

V = 50


def rebuilt(rows: list[list[int]], counts: bool) -> torch.Tensor:
    if counts:
        return torch.stack([torch.bincount(torch.tensor(row, dtype=torch.long), minlength=V) for row in rows]).int()
    return token_mask(rows, V, "cpu")


@pytest.mark.parametrize("counts", [False, True], ids=["seen", "counts"])
def test_tables_follow_growing_rows_that_leave(counts):
    rng = random.Random(0)
    for trial in range(20):
        rows = [[rng.randrange(V) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(1, 7))]
        table = ContextTokens(V, "cpu", counts=counts)
        steps = 0
        while rows:
            assert torch.equal(table.update(rows), rebuilt(rows, counts)), (trial, steps)
            for row in rows:  # a round: each row gains 0-5 tokens, repeats likely
                row += [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
            keep = [i for i in range(len(rows)) if rng.random() < 0.8]
            if len(keep) < len(rows):
                rows = [rows[i] for i in keep]
                table.select_rows(keep)
            steps += 1


def test_a_new_batch_or_a_shorter_row_is_rebuilt_not_read_stale():
    table = ContextTokens(V, "cpu")
    table.update([[1, 2, 3], [4]])
    assert torch.equal(table.update([[5], [6]]), token_mask([[5], [6]], V, "cpu"))  # rows shrank: a new request
    assert torch.equal(table.update([[7, 8]]), token_mask([[7, 8]], V, "cpu"))  # another batch size


def test_penalised_batch_whose_rows_end_apart_equals_each_row_alone(tiny_models):
    """T=0 under all three penalties, the target drafting for itself (penalise_drafts): rows that
    end early (EOS) leave the batch, and the rows that stay keep their own tables."""
    import draftsman

    target = str(tiny_models["llama"][0])
    dec = draftsman.load({"target": {"path": target},
                          "drafter": {"name": "draft_model", "path": target, "k": 3, "penalise_drafts": True},
                          "sampling": {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.3}})
    prompts = [[1, 2, 3, 4, 5, 1, 2], [7, 7, 9], [5, 1, 2, 3, 4, 8, 8, 8], [11, 12]]
    unstopped = dec.generate(input_ids=prompts, max_new_tokens=24).token_ids
    dec.engine.eos_token_ids = {unstopped[0][2], unstopped[2][9]}  # rows 0 and 2 end early
    batch = dec.generate(input_ids=prompts, max_new_tokens=24)
    alone = [dec.generate(input_ids=[p], max_new_tokens=24).token_ids[0] for p in prompts]
    assert batch.token_ids == alone
    lengths = sorted(len(row) for row in batch.token_ids)
    assert lengths[0] < lengths[-1] == 24, lengths  # rows did leave while others went on
