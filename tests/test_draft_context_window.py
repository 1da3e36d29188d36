"""A draft model whose context is shorter than the rows it drafts for (drafters/context_window.py):
`draft_model` keeps drafting past it, row by row, from a window of the row's latest tokens, and
one long row no longer stops drafting for the batch. Output stays the target's own; the window
stays within the draft model's positions; its start moves a quarter of the room at a time, so the
draft cache is fed from empty about once per quarter of new tokens, not every round."""
import json

import pytest
import torch

import draftsman
from draftsman.drafters.context_window import window_start

from tiny_models import load_for_reference, perturbed_copy

CONTEXT, K = 40, 4
ROOM, STRIDE = CONTEXT - K, (CONTEXT - K) // 4
NEW = 48


def test_the_window_keeps_three_quarters_of_the_room_and_moves_a_quarter_at_a_time():
    starts = [window_start(n, ROOM) for n in range(1, 200)]
    assert starts[:ROOM] == [0] * ROOM  # all fit
    for n, start in enumerate(starts, 1):
        assert ROOM - STRIDE < n - start <= ROOM or start == 0
        assert start % STRIDE == 0
    assert len(set(starts[ROOM:])) == len(range(ROOM + 1, 200, STRIDE))  # one move per stride


@pytest.fixture(scope="module")
def short_context_draft(tiny_models, tmp_path_factory):
    """Per arch: the target's close copy (it accepts often), its context cut to CONTEXT positions."""
    out = {}
    for arch in ("llama", "qwen2"):
        folder = perturbed_copy(tiny_models[arch][0], tmp_path_factory.mktemp(f"{arch}-short"), noise=0.05)
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = CONTEXT
        (folder / "config.json").write_text(json.dumps(config))
        out[arch] = folder
    return out


def targets_own(target, prompts):
    model = load_for_reference(target)
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                           attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_model_drafts_past_its_context(arch, tiny_models, tiny_tokenizer, short_context_draft):
    """Every round's chain is what the draft model alone generates greedily from the row's window
    (the cache kept across rounds holds exactly the window), within its positions."""
    target = tiny_models[arch][0]
    long = tiny_tokenizer("def parse(text):\n    return [line.split() for line in text.splitlines()]\n" * 2)
    long = long["input_ids"]
    short = tiny_tokenizer("import os\n")["input_ids"]
    assert len(long) > ROOM and len(short) + NEW > ROOM  # the long row overflows at once, the short one later
    expected = targets_own(target, [long, short])
    dec = draftsman.load({"target": {"path": str(target)},
                          "drafter": {"name": "draft_model", "path": str(short_context_draft[arch]), "k": K}})
    drafter = dec.engine.drafter
    drafts, emptied, propose, rollback = [], [0], drafter.propose, drafter.lm.rollback

    previous = []  # the last round's contexts

    def recording_propose(contexts):
        for row, context in enumerate(contexts):  # each row's window start followed it (keep_rows, add_rows)
            before = [p for p in previous if context[:len(p)] == p]
            last = window_start(len(max(before, key=len)), ROOM) if before else 0
            assert drafter.window_starts[row] == last, (row, drafter.window_starts)
        previous[:] = [list(c) for c in contexts]
        trees = propose(contexts)
        assert int(drafter.lm.lengths.max()) <= CONTEXT, drafter.lm.lengths  # within its positions
        drafts.extend((list(c), t.tokens.tolist()) for c, t in zip(contexts, trees))
        return trees

    def recording_rollback(lengths):
        emptied[0] += int((lengths == 0).sum())
        return rollback(lengths)

    drafter.propose, drafter.lm.rollback = recording_propose, recording_rollback
    assert dec.generate(input_ids=[long], max_new_tokens=NEW).token_ids == expected[:1]
    # The cache is fed from empty when the window moves: once per stride of new tokens, not every round.
    assert emptied[0] <= NEW / STRIDE + 2 and emptied[0] < len(drafts) / 2, (emptied, len(drafts))
    # Rows that end apart: the finished row leaves the batch (keep_rows), the other keeps its window.
    both = dec.generate(input_ids=[short, long, short], max_new_tokens=[NEW // 3, NEW, NEW]).token_ids
    assert both == [expected[1][: NEW // 3], expected[0], expected[1]]
    draft_model = load_for_reference(short_context_draft[arch])
    for context, chain in drafts:
        window = context[window_start(len(context), ROOM):]
        alone = draft_model.generate(torch.tensor([window]), max_new_tokens=len(chain), do_sample=False,
                                     attention_mask=torch.ones(1, len(window), dtype=torch.long))
        assert chain == alone[0, len(window):].tolist(), (len(context), len(window))
    assert sum(len(chain) for _, chain in drafts) >= K * (len(drafts) - 4)  # nearly every round drafts k


def test_k_that_fills_the_draft_models_context_is_refused(tiny_models, short_context_draft):
    with pytest.raises(ValueError, match=f"k={CONTEXT} leaves no room in the draft model's context of {CONTEXT}"):
        draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                        "drafter": {"name": "draft_model", "path": str(short_context_draft["llama"]), "k": CONTEXT}})
