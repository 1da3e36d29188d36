"""Longrope targets (the long-context Phi-3, Phi-3.5 and Phi-4-mini) rotate every position with
other frequencies once a sequence passes original_max_position_embeddings, and their generate
computes the cache again when it does. A verify pass straddling that position rotated all of its
positions the long way, and plain decoding crossed it with the short cache: output differed from
the target's own from there. Generation is now kept within the original positions, where it is
exact, and says so."""
import pytest
from transformers import Phi3Config

import draftsman

from tiny_models import build_model_folder, greedy_targets

SWITCH, HEAD_DIM = 16, 16
PROMPTS = [[5, 9, 12, 40, 7], list(range(20, 32)), [3]]  # cross the switch after 11, 4 and 15 tokens
NEW = 30


@pytest.fixture(scope="module")
def longrope(tmp_path_factory, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    config = Phi3Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        original_max_position_embeddings=SWITCH, bos_token_id=eos, eos_token_id=eos,
                        pad_token_id=eos, rope_parameters={
                            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": SWITCH,
                            "short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [4.0] * (HEAD_DIM // 2)})
    folder, expected = greedy_targets(tmp_path_factory, tiny_tokenizer, {"phi3": config}, 5, PROMPTS, NEW)["phi3"]
    draft = build_model_folder(tmp_path_factory.mktemp("draft"), "llama", seed=3, size="draft",
                               tokenizer=tiny_tokenizer)
    return folder, draft, expected


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model"])
def test_generation_stays_within_the_original_positions_and_equals_the_targets_own(longrope, drafter):
    folder, draft, expected = longrope
    options = {"none": {}, "ngram": {"k": 4}, "draft_model": {"k": 4, "path": str(draft)}}[drafter]
    with pytest.warns(UserWarning, match=f"longrope target switches .* original_max_position_embeddings = {SWITCH}"):
        decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": drafter, **options}})
    assert decoder.engine.max_context == SWITCH
    for batch in ([[p] for p in PROMPTS], [PROMPTS]):
        outputs = [decoder.generate(input_ids=prompts, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0)
                   for prompts in batch]
        got = [row for out in outputs for row in out.token_ids]
        assert got == [want[:SWITCH - len(p)] for p, want in zip(PROMPTS, expected)]
        assert [reason for out in outputs for reason in out.stats.finish_reasons] == ["context"] * len(PROMPTS)


def test_a_prompt_past_the_switch_is_refused_with_the_reason(longrope):
    folder, _, _ = longrope
    with pytest.warns(UserWarning, match="longrope"):
        decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram"}})
    with pytest.raises(ValueError, match=r"prompt 0 has 16 tokens but the target's context is 16 positions.*"
                                         r"switches its RoPE frequencies past original_max_position_embeddings"):
        decoder.generate(input_ids=[list(range(3, 3 + SWITCH))], max_new_tokens=4)
