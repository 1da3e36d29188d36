"""min_new_tokens per row: requests with different minimums generate as one batch (how `draftsman
serve` batches them, also when they join a running batch), each row held back from EOS until its
own minimum, as it is alone. Drafters read the minimum of each row: the trees they propose in the
batch are the ones they propose alone at the same context."""
import pytest
import torch

import draftsman
from draftsman.verifier.sampling import SamplingParams, processed_probs

from test_engine_sampling import ALPHA, fit_pvalue
from tiny_models import load_for_reference, perturbed_copy

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12], [7, 7, 7]]
MINIMUMS = [6, 0, 14, 3]  # rows 1 and 2 end at EOS early without one; row 2 is held past it
NEW = 16


@pytest.fixture(scope="module")
def close_draft(tiny_models, tmp_path_factory):
    return perturbed_copy(tiny_models["llama"][0], tmp_path_factory.mktemp("close-draft"), noise=0.05)


@pytest.fixture(scope="module")
def frequent_eos(tiny_models):
    """A token the tiny target picks often in the first tokens of PROMPTS, to be EOS: rows would
    end early without a minimum."""
    plain = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}}).generate(
        input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0).token_ids
    return max(set(sum(plain, [])), key=lambda t: sum(t in row[:12] for row in plain))


def drafters(tiny_models, close_draft, fresh_heads):
    return {
        "none": {"name": "none"},
        "ngram": {"name": "ngram", "k": 3, "min_ngram": 1, "branches": 2},
        # Without a cache: its trees depend on the row alone (tests compare them with lone runs').
        "suffix": {"name": "suffix", "min_match": 1, "max_spec_factor": 3.0, "max_cached_requests": 0},
        "recycling": {"name": "recycling", "tree_budget": 8},
        "draft_model": {"name": "draft_model", "path": str(close_draft), "k": 4},
        "draft_model_tree": {"name": "draft_model", "path": str(close_draft), "k": 3, "top_k": 2, "total_tokens": 6},
        "medusa": {"name": "medusa", "path": str(fresh_heads / "medusa")},
        "eagle3": {"name": "eagle", "path": str(fresh_heads / "eagle3"), "depth": 3, "top_k": 2, "total_tokens": 6},
        "mtp": {"name": "mtp", "path": str(fresh_heads / "mtp")},
        "cascade": {"name": "cascade", "drafters": [{"name": "ngram", "k": 3, "min_ngram": 1},
                                                   {"name": "draft_model", "path": str(close_draft), "k": 3}]},
        "draft_model_adaptive": {"name": "draft_model", "path": str(close_draft), "k": 4, "adaptive": True},
    }


def record_trees(decoder) -> dict:
    """{context: (tokens, parents)} of every tree the decoder's drafter proposes from now on."""
    seen, propose = {}, decoder.engine.drafter.propose

    def recording(contexts):
        trees = propose(contexts)
        for context, tree in zip(contexts, trees):
            seen[tuple(context)] = (tree.tokens.tolist(), tree.parents.tolist())
        return trees

    decoder.engine.drafter.propose = recording
    return seen


def check_minimums(decoder, minimum_of: dict) -> list:
    """At every propose, the drafter, and each drafter a wrapper holds, must read each row's own
    minimum (rows told apart by their prompt's first token). Returns the drafters checked."""
    top = decoder.engine.drafter
    checked = [top, *getattr(top, "children", []), *([top.inner] if hasattr(top, "inner") else [])]
    for drafter in checked:
        def checking(contexts, drafter=drafter, propose=drafter.propose):
            assert drafter.min_new_tokens_per_row(len(contexts)) == [minimum_of[c[0]] for c in contexts], drafter.name
            return propose(contexts)
        drafter.propose = checking
    return checked


def load(tiny_models, drafter, eos):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": drafter})
    decoder.engine.eos_token_ids = {eos}
    return decoder


@pytest.mark.parametrize("name", ["none", "ngram", "suffix", "recycling", "draft_model", "draft_model_tree", "medusa",
                                  "eagle3", "mtp", "cascade", "draft_model_adaptive"])
def test_each_row_is_held_to_its_own_minimum(tiny_models, close_draft, fresh_heads, frequent_eos, name):
    decoder = load(tiny_models, drafters(tiny_models, close_draft, fresh_heads)[name], frequent_eos)
    alone_trees = record_trees(decoder)
    alone = [decoder.generate(input_ids=[p], max_new_tokens=NEW, min_new_tokens=m, temperature=0.0)
             for p, m in zip(PROMPTS, MINIMUMS)]
    del decoder.engine.drafter.propose
    if name.endswith("adaptive"):  # draft every round, so the inner drafter is asked after rows end
        adaptive = decoder.engine.drafter
        adaptive.choose_depth = lambda *args, **kwargs: adaptive.inner.max_depth()
    checked = check_minimums(decoder, {p[0]: m for p, m in zip(PROMPTS, MINIMUMS)})
    together_trees = record_trees(decoder)
    together = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=MINIMUMS, temperature=0.0)
    for drafter in checked:
        del drafter.propose
    for i, out in enumerate(alone):
        assert together.token_ids[i] == out.token_ids[0], f"{name}: row {i}"
        assert together.stats.finish_reasons[i] == out.stats.finish_reasons[0], f"{name}: row {i}"
        assert len(out.token_ids[0]) >= MINIMUMS[i]
    if name not in ("draft_model_adaptive", "recycling"):  # adaptive's depths depend on the batch, and
        # recycling's matrix on what the other rows taught it (test_recycling checks its EOS cut)
        # A drafter that read another row's minimum would draft EOS where this row may not end,
        # or hold it back where it may: its tree would differ from the lone run's.
        assert together_trees and {c: alone_trees[c] for c in together_trees} == together_trees, name
    # The minimums matter here: unheld, EOS ends some row before its minimum.
    free = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=0, temperature=0.0)
    assert any(r == "eos" and len(t) < m for t, r, m in zip(free.token_ids, free.stats.finish_reasons, MINIMUMS))


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle3"])
def test_joining_rows_bring_their_own_minimum(tiny_models, close_draft, fresh_heads, frequent_eos, name):
    """stream_batch's joining takes (ids, max_new_tokens, min_new_tokens): a row that joins is
    held to its own minimum, and the rows already running to theirs."""
    decoder = load(tiny_models, drafters(tiny_models, close_draft, fresh_heads)[name], frequent_eos)
    alone = [decoder.generate(input_ids=[p], max_new_tokens=NEW, min_new_tokens=m, temperature=0.0).token_ids[0]
             for p, m in zip(PROMPTS, MINIMUMS)]
    rounds = [0]

    def joining():
        rounds[0] += 1
        return [(PROMPTS[1], NEW, MINIMUMS[1]), (PROMPTS[2], None, MINIMUMS[2])] if rounds[0] == 2 else []

    tokens: dict[int, list[int]] = {}
    order = [0, 3, 1, 2]  # the engine's rows: the starting prompts, then the joined ones
    for row, chunk in decoder.stream_batch([PROMPTS[0], PROMPTS[3]], joining=joining, max_new_tokens=NEW,
                                           min_new_tokens=[MINIMUMS[0], MINIMUMS[3]], temperature=0.0):
        tokens.setdefault(order[row], []).extend(chunk.token_ids)
    assert [tokens[i] for i in range(4)] == alone


@pytest.mark.parametrize("drafter", [{"name": "ngram", "k": 4, "min_ngram": 1},
                                     {"name": "cascade", "drafters": [{"name": "ngram", "k": 4, "min_ngram": 1},
                                                                      {"name": "ngram", "k": 2, "min_ngram": 1}]},
                                     {"name": "suffix", "min_match": 1, "max_spec_factor": 3.0,
                                      "max_cached_requests": 0}],
                         ids=["ngram", "cascade", "suffix"])
def test_ngram_continuations_stop_before_eos_at_each_rows_own_depth(tiny_models, drafter):
    """EOS inside a prompt's n-gram continuation: a row without a minimum drafts it, a row held
    for 10 tokens cuts its draft before it (the tree is deterministic: cutting it is exact), in
    one batch as alone."""
    decoder = load(tiny_models, drafter, eos=7)
    prompts, minimums = [[5, 6, 7, 8, 5, 6], [9, 5, 6, 7, 8, 5, 6]], [0, 10]
    alone_trees = record_trees(decoder)
    for p, m in zip(prompts, minimums):
        decoder.generate(input_ids=[p], max_new_tokens=12, min_new_tokens=m, temperature=0.0)
    del decoder.engine.drafter.propose
    together_trees = record_trees(decoder)
    decoder.generate(input_ids=prompts, max_new_tokens=12, min_new_tokens=minimums, temperature=0.0)
    assert {c: alone_trees[c] for c in together_trees} == together_trees
    free, held = (together_trees[tuple(p)][0] for p in prompts)  # the first round's trees' tokens
    assert free[0] == 7 and 7 not in held, (free, held)  # EOS drafted where it is allowed only


SAMPLED_PROMPT, SAMPLED_ROWS = [1, 2, 3, 4, 5, 1, 2, 3], 3000


def likeliest_first_token(target) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(the target's likeliest first token after SAMPLED_PROMPT at T=1, the first token's
    distribution, the same with that token masked), float64."""
    with torch.no_grad():
        p1 = processed_probs(load_for_reference(target)(input_ids=torch.tensor([SAMPLED_PROMPT])).logits[0, -1].double(),
                             SamplingParams(1.0))
    token = int(p1.argmax())
    masked = p1.clone()
    masked[token] = 0
    return token, p1, masked / masked.sum()


def assert_held_and_free_rows_follow(out, token: int, p1: torch.Tensor, masked: torch.Tensor) -> None:
    """Even rows held back from `token` at their first new token, odd rows free: the first tokens
    of each follow the masked and the unmasked distribution (chi-square), and the test has power."""
    held = torch.tensor([t[0] for t in out.token_ids[0::2]])
    free = torch.tensor([t[0] for t in out.token_ids[1::2]])
    assert token not in held.tolist() and (free == token).sum() > 0.5 * len(free) * float(p1[token])
    assert fit_pvalue(held, masked) > ALPHA and fit_pvalue(free, p1) > ALPHA
    assert p1[token] > 0.02 and fit_pvalue(held, p1) < ALPHA  # the test has power: masking is visible
    assert out.stats.tau > 1.01  # drafts were verified, not only plain rounds


def test_sampled_rows_each_follow_their_own_masked_distribution(tiny_models):
    """T=1, one batch: half the rows with min_new_tokens 1, half with 0, EOS the target's likeliest
    first token. The first token of the held rows follows the target's distribution with EOS
    masked; the others' follows the unmasked one (EOS included)."""
    target = tiny_models["llama"][0]
    eos, p1, masked = likeliest_first_token(target)
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(target), "k": 2}})
    decoder.engine.eos_token_ids = {eos}
    out = decoder.generate(input_ids=[SAMPLED_PROMPT] * (2 * SAMPLED_ROWS), max_new_tokens=2,
                           min_new_tokens=[1, 0] * SAMPLED_ROWS, temperature=1.0, seed=5)
    assert_held_and_free_rows_follow(out, eos, p1, masked)


@pytest.mark.parametrize("minimums, message", [
    ([3], r"min_new_tokens has 1 values for 2 prompts: give one number, or one per prompt"),
    ([3, 7], r"min_new_tokens must be in \[0, max_new_tokens = 6\], got 7 \(row 1\)"),
    ([3, -1], r"min_new_tokens must be in \[0, max_new_tokens = 6\], got -1 \(row 1\)"),
    ([3, True], r"min_new_tokens must be a whole number, got True \(row 1\)"),  # not "raise max_new_tokens"
])
def test_bad_minimums_are_named(tiny_models, minimums, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=message):
        decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=[4, 6], min_new_tokens=minimums)
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens = 4\], got 5 \(row 0\)"):
        list(decoder.stream_batch(PROMPTS[:1], max_new_tokens=4, joining=lambda: [(PROMPTS[1], 4, 5)]))


def test_samples_of_a_prompt_share_its_minimum(tiny_models):
    """num_return_sequences: a minimum given per prompt holds each of its samples."""
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    half = decoder.engine.vocab_size // 2
    decoder.engine.eos_token_ids = set(range(half))  # about every other token ends a row
    out = decoder.generate(input_ids=PROMPTS[:2], max_new_tokens=6, min_new_tokens=[0, 4], temperature=1.0,
                           num_return_sequences=2, seed=1)
    for held in out.token_ids[2:]:  # prompt 1's samples: no EOS among their first 4 tokens
        assert len(held) >= 4 and all(t >= half for t in held[:4]), held
