"""Hugging Face's typical-p, epsilon and eta warpers: the distribution is made exactly as
Hugging Face makes it, and every way in (Python, config, CLI, server) reaches the engine.
Exactness of the verifier under them: tests/test_exactness_enumeration.py (float64 enumeration)
and tests/test_engine_sampling.py (chi-square on the whole engine)."""
import json

import pytest
import torch
from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

import draftsman
from draftsman import cli
from draftsman.verifier.sampling import SORT_CANDIDATES, SamplingParams, processed_logprobs, processed_probs

from serving import call
from test_sampling import assert_same_up_to_ties

SETTINGS = [dict(typical_p=0.5), dict(typical_p=0.95), dict(typical_p=1e-3), dict(epsilon_cutoff=0.02),
            dict(epsilon_cutoff=0.9), dict(eta_cutoff=0.05), dict(eta_cutoff=9e-4),
            dict(top_k=10, top_p=0.9, typical_p=0.7, epsilon_cutoff=0.01, eta_cutoff=0.02)]


def hf_probs(logits: torch.Tensor, temperature: float, s: dict) -> torch.Tensor:
    """Hugging Face's warpers in generate's order (utils.py, _get_logits_processor)."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    for key, warper in (("top_k", TopKLogitsWarper), ("top_p", TopPLogitsWarper), ("typical_p", TypicalLogitsWarper),
                        ("epsilon_cutoff", EpsilonLogitsWarper), ("eta_cutoff", EtaLogitsWarper)):
        if key in s:
            scores = warper(s[key])(None, scores)
    return scores.softmax(-1)


def random_logits(rows: int = 64, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, 10] = logits[:, 11]  # ties: a tie with the last kept token is kept, as in HF
    logits[:8, :] = 0.0  # flat rows: every token equally typical
    return logits


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_probabilities_equal_hugging_faces(settings):
    logits = random_logits()
    ours = processed_probs(logits, SamplingParams(1.3, **settings))
    theirs = hf_probs(logits, 1.3, settings)
    if "top_p" in settings:  # the 8 flat rows tie every token at top-p's boundary
        assert_same_up_to_ties(ours, theirs, logits, most_rows_tied=8)
    else:
        assert torch.equal(ours > 0, theirs > 0), "a different set of tokens kept"
        assert torch.allclose(ours, theirs, atol=1e-6)
    kept = (ours > 0).sum(-1)
    assert (kept < logits.shape[-1]).any() and (kept >= 1).all()  # it drops tokens, and never all of them


@pytest.mark.parametrize("typical_p", [0.5, 0.9, 0.95])
def test_typical_p_over_a_large_vocabulary_keeps_what_hf_keeps(typical_p):
    """Over more tokens than the 1024 candidates, rows whose nearest tokens hold typical_p of the
    mass sort only those, the others the whole vocabulary: both keep what Hugging Face keeps."""
    g = torch.Generator().manual_seed(4)
    vocab = 4 * SORT_CANDIDATES
    logits = torch.cat([torch.randn(24, vocab, generator=g) * 4, torch.randn(24, vocab, generator=g) * 0.3])
    log_probs = logits.log_softmax(-1)
    distance = (-log_probs + (log_probs * log_probs.exp()).sum(-1, keepdim=True)).abs()
    nearest_mass = log_probs.exp().gather(-1, distance.topk(SORT_CANDIDATES, largest=False).indices).sum(-1)
    assert (nearest_mass >= typical_p + 0.01).sum() >= 10 and (nearest_mass < typical_p).sum() >= 10  # both ways
    ours, theirs = processed_probs(logits, SamplingParams(1.0, typical_p=typical_p)), hf_probs(logits, 1.0,
                                                                                               {"typical_p": typical_p})
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.equal(processed_probs(logits[5:6], SamplingParams(1.0, typical_p=typical_p))[0], ours[5])


def test_a_block_of_positions_is_warped_position_by_position():
    """The verifier warps (rows, block, vocab) at once: each position as on its own."""
    logits = random_logits(24).reshape(4, 6, 50).double()
    params = SamplingParams(0.9, typical_p=0.6, eta_cutoff=0.03)
    block = processed_probs(logits, params)
    for r in range(4):
        assert torch.equal(block[r], processed_probs(logits[r], params))
    assert torch.equal(processed_logprobs(logits, params).isfinite(), block > 0)


@pytest.mark.parametrize("settings, message", [
    (dict(typical_p=0.0), r"typical_p must be in \(0, 1\]"), (dict(typical_p=1.5), r"typical_p must be in \(0, 1\]"),
    (dict(epsilon_cutoff=1.0), r"epsilon_cutoff must be in \[0, 1\)"),
    (dict(eta_cutoff=-0.1), r"eta_cutoff must be in \[0, 1\)"),
    (dict(top_h=0.0), r"top_h must be in \(0, 1\]"),
])
def test_bad_values_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(1.0, **settings)


def test_off_values_change_nothing():
    logits = random_logits()
    plain = processed_probs(logits, SamplingParams(1.0))
    for off in (dict(typical_p=1.0), dict(epsilon_cutoff=0.0), dict(eta_cutoff=0.0)):
        assert torch.equal(processed_probs(logits, SamplingParams(1.0, **off)), plain)


@pytest.mark.parametrize("top_h, more", [(0.05, {}), (0.4, {}), (0.9, {}), (1.0, {}),
                                         (0.3, dict(top_k=20, typical_p=0.9))])
def test_top_h_equals_hugging_faces(top_h, more):
    """Top-H (transformers 5): before top-k, on at most the 100 likeliest tokens."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    if not hasattr(warpers, "TopHLogitsWarper"):
        pytest.skip("this transformers has no TopHLogitsWarper")
    logits = random_logits(rows=32, vocab=300)  # more than 100 tokens: the ones past the 100 go
    scores = warpers.TemperatureLogitsWarper(1.2)(None, logits.clone())
    scores = warpers.TopHLogitsWarper(top_h)(None, scores)
    if "top_k" in more:
        scores = TopKLogitsWarper(more["top_k"])(None, scores)
    if "typical_p" in more:
        scores = TypicalLogitsWarper(more["typical_p"])(None, scores)
    theirs = scores.softmax(-1)
    ours = processed_probs(logits, SamplingParams(1.2, top_h=top_h, **more))
    assert torch.equal(ours > 0, theirs > 0) and torch.allclose(ours, theirs, atol=1e-6)
    kept = (ours > 0).sum(-1)
    assert (kept >= 1).all() and (kept <= 100).all() and (kept < 100).any()


@pytest.fixture(scope="module")
def decoder(chat_target):
    return draftsman.load({"target": {"path": str(chat_target[0])},
                           "drafter": {"name": "ngram", "k": 3, "branches": 2, "min_ngram": 1}})


PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11]]
WARPED = dict(typical_p=0.3, epsilon_cutoff=0.002, eta_cutoff=0.004, top_h=0.9)


def test_python_config_and_cli_reach_the_engine(decoder, chat_target, tmp_path, capsys):
    """generate(**WARPED) equals the same settings from a config, and from the CLI's flags; a
    draw from the unwarped distribution differs, so the settings were not dropped on the way."""
    want = decoder.generate(input_ids=PROMPTS, max_new_tokens=16, temperature=1.0, seed=3, **WARPED).token_ids
    plain = decoder.generate(input_ids=PROMPTS, max_new_tokens=16, temperature=1.0, seed=3).token_ids
    assert want != plain
    for key in WARPED:  # each one on its own changes the draw too
        alone = decoder.generate(input_ids=PROMPTS, max_new_tokens=16, temperature=1.0, seed=3, **{key: WARPED[key]})
        assert alone.token_ids != plain, key

    configured = draftsman.load({**decoder.config, "sampling": {**decoder.config["sampling"], **WARPED}})
    assert configured.generate(input_ids=PROMPTS, max_new_tokens=16, temperature=1.0, seed=3).token_ids == want

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"target": decoder.config["target"], "drafter": decoder.config["drafter"]}))
    code = cli.main(["generate", "--config", str(config), "--input-ids", "5,6,7,8,5,6", "--input-ids", "9,10,11",
                     "--max-new-tokens", "16", "--temperature", "1", "--seed", "3", "--typical-p", "0.3",
                     "--epsilon-cutoff", "0.002", "--eta-cutoff", "0.004", "--top-h", "0.9", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want


def test_the_server_takes_them_as_fields(served):
    decoder, base = served
    body = {"prompt": [PROMPTS[0]], "max_tokens": 12, "temperature": 1.0, "seed": 4, **WARPED}
    status, got = call(base, "/v1/completions", body)
    assert status == 200, got
    want = decoder.generate(input_ids=[PROMPTS[0]], max_new_tokens=12, temperature=1.0, seed=4, **WARPED)
    assert got["choices"][0]["text"] == want.texts[0]
    status, got = call(base, "/v1/completions", {**body, "typical_p": 0})
    assert status == 400 and "typical_p must be in (0, 1]" in got["error"]["message"]
