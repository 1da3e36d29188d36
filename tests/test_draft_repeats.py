"""Drafting under a repetition penalty (drafters/repeats.py): drafters penalise their own logits as
the engine penalises the target's (the heads always, draft_model under penalise_drafts), so a
draft model that is the target itself is always accepted."""
import pytest
import torch

import draftsman
from draftsman.drafters.repeats import DraftContext, DraftRepeats
from draftsman.verifier.sampling import SamplingParams, processed_probs

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7, 9], [5, 1, 2, 3, 4]]


PENALTIES = {"repetition": {"repetition_penalty": 1.5}, "presence+frequency": {"presence_penalty": 1.0, "frequency_penalty": 0.8},
             "all three": {"repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.6}}


@pytest.mark.parametrize("penalties", PENALTIES.values(), ids=PENALTIES.keys())
@pytest.mark.parametrize("options", [{"k": 4}, {"k": 4, "top_k": 3, "total_tokens": 30}], ids=["chain", "tree"])
def test_the_target_drafting_for_itself_is_accepted(tiny_models, options, penalties):
    """The target as its own draft model, under penalties: output equals plain decoding's;
    drafting that ignores the penalties (penalise_drafts off) is accepted less."""
    target = str(tiny_models["llama"][0])
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "draft_model", "path": target, "penalise_drafts": True,
                                                                     **options},
                          "sampling": penalties})
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=20)
    assert out.token_ids == dec.with_drafter({"name": "none"}).generate(input_ids=PROMPTS, max_new_tokens=20).token_ids
    if "top_k" not in options:  # a chain of the target's own penalised argmax: every draft accepted
        assert out.stats.tau == 5.0, out.stats.accepted_per_round  # 20 tokens in 4 rounds per row
    unaware = dec.with_drafter({**dec.config["drafter"], "penalise_drafts": False}).generate(input_ids=PROMPTS,
                                                                                            max_new_tokens=20)
    assert unaware.token_ids == out.token_ids
    assert out.stats.tau > unaware.stats.tau + 0.5, (out.stats.accepted_per_round, unaware.stats.accepted_per_round)


def test_states_follow_a_draft_vocabulary_and_count_generated_tokens():
    """One int32 per token: 2 x generated + 1 when held; the prompt is held, never counted."""
    vocab_map = torch.tensor([9, 4, 2, 7])  # draft row -> token id
    context = DraftContext([[4, 5], [7]], vocab_size=10, device="cpu")  # the prompts
    rows = [[4, 5, 9, 9], [7, 7, 0]]  # generated so far: [9, 9] and [7, 0]
    params = SamplingParams(0.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    repeats = context.round(params, rows, 4, vocab_map)
    assert repeats.root_state.tolist() == [[5, 1, 0, 0], [0, 0, 0, 3]]
    after = DraftRepeats.plus(repeats.root_state, torch.tensor([2, 3]))  # a draft token each
    assert after.tolist() == [[5, 1, 2, 0], [0, 0, 0, 5]]
    logits = torch.tensor([[2.0, 2.0, -1.0, -1.0]] * 2)
    want = torch.tensor([[2 / 1.5 - 0.25 * 2 - 0.5, 2 / 1.5, -1.5 - 0.25 - 0.5, -1.0],
                         [2.0, 2.0, -1.0, -1.5 - 0.25 * 2 - 0.5]])
    assert torch.allclose(repeats.penalise(logits, after), want)
    only_counts = context.round(SamplingParams(0.0, frequency_penalty=0.25), rows, 4, vocab_map)
    assert torch.allclose(only_counts.penalise(logits, only_counts.root_state),
                          torch.tensor([[1.5, 2.0, -1.0, -1.0], [2.0, 2.0, -1.0, -1.25]]))


def test_no_penalty_no_states():
    context = DraftContext([[1]], 4, "cpu")
    assert context.round(SamplingParams(1.0), [[1]], 4, None) is None
    assert context.round(SamplingParams(1.0, repetition_penalty=1.0), [[1]], 4, None) is None
    assert context.held.table is None and context.generated.table is None  # nothing was built


def test_a_penalised_sampled_drafts_q_is_what_it_was_drawn_from(tiny_models):
    """At T > 0 under penalise_drafts, each draft token is drawn from the penalised draft
    distribution, and that distribution must be its q (the verifier divides by it). The reference
    is Hugging Face's own processor on the draft model's logits; unpenalised they differ."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from tiny_models import load_for_reference

    target = str(tiny_models["llama"][0])
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "draft_model", "path": target, "k": 3,
                                                                   "penalise_drafts": True}})
    drafter, context = dec.drafter, PROMPTS[0]
    params = SamplingParams(0.8, repetition_penalty=1.5)
    drafter.begin([context], params, torch.Generator(dec.engine.device).manual_seed(0))  # CUDA too
    q = drafter.propose([context])[0].draft_probs[0].double().cpu()  # the first draft token's q
    ids = torch.tensor([context])
    with torch.no_grad():
        logits = load_for_reference(tiny_models["llama"][0])(input_ids=ids).logits[:, -1].double()
    penalised = processed_probs(RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())[0], params)
    assert (q - penalised).abs().max() < 1e-5
    assert (q - processed_probs(logits[0], params)).abs().max() > 1e-3
