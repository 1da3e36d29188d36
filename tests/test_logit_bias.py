"""logit_bias (OpenAI's; Hugging Face's single-token sequence_bias): a bias added to the target's
logits at every tree node before the penalties, so greedy output is Hugging Face's
generate(sequence_bias=...) and sampled output follows the biased distribution exactly."""
import json
import re

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

import draftsman
from draftsman import cli
from draftsman.verifier.sampling import SamplingParams, processed_probs

from test_engine_sampling import ROWS, fit_pvalue
from tiny_models import load_for_reference, perturbed_copy

NEW = 24
PROMPT_TEXTS = ["def parse(", "class Foo:\n    def", "for i in range(10):\n    print(i", "import"]
ALPHA = 1e-6


@pytest.fixture(scope="module")
def close_drafts(tiny_models, tmp_path_factory):
    return {arch: perturbed_copy(t, tmp_path_factory.mktemp(f"{arch}-bias-close"), noise=0.05)
            for arch, (t, _) in tiny_models.items()}


def frequent_tokens(rows: list[list[int]], n: int) -> list[int]:
    counts = {}
    for row in rows:
        for t in row:
            counts[t] = counts.get(t, 0) + 1
    return sorted(counts, key=lambda t: -counts[t])[:n]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_with_logit_bias_equals_hugging_face_sequence_bias(arch, tiny_models, tiny_tokenizer, close_drafts):
    """The most frequent greedy token banned (-100), the second pushed (+3), alone and with a
    repetition penalty (which Hugging Face applies after the bias): every drafter, batch 1 and 4."""
    target = tiny_models[arch][0]
    model = load_for_reference(target)
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    base = draftsman.load({"target": {"path": str(target)}})
    plain = base.generate(input_ids=prompts, max_new_tokens=NEW).token_ids
    banned, pushed = frequent_tokens(plain, 2)
    bias = {banned: -100.0, pushed: 3.0}
    close = str(close_drafts[arch])
    drafters = {"none": {"name": "none"},
                "ngram_tree": {"name": "ngram", "k": 3, "branches": 3, "min_ngram": 1, "max_ngram": 2},
                "draft_model_chain": {"name": "draft_model", "path": close, "k": 5},
                "draft_model_tree": {"name": "draft_model", "path": close, "k": 4, "top_k": 3, "total_tokens": 8}}
    for extra in ({}, {"repetition_penalty": 1.3}):
        expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                   sequence_bias={(t,): b for t, b in bias.items()},
                                   attention_mask=torch.ones(1, len(p), dtype=torch.long), **extra)[0, len(p):].tolist()
                    for p in prompts]
        assert all(banned not in row for row in expected) and expected != plain
        for name, drafter in drafters.items():
            dec = base.with_drafter(drafter)
            where = f"{arch}/{name}/{extra}"
            got = [dec.generate(input_ids=[p], max_new_tokens=NEW, logit_bias=bias, **extra).token_ids[0]
                   for p in prompts]
            assert got == expected, where
            batch = dec.generate(input_ids=prompts, max_new_tokens=NEW, logit_bias=bias, **extra)
            assert batch.token_ids == expected, where + " batch 4"


def biased_marginals(model, prompt, bias, params, eos_ids=()):
    """The first two tokens' exact distributions under Hugging Face's processors: the bias, then
    the repetition penalty, then temperature; the second given that the first was not EOS."""
    sequence_bias = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}) if bias else None
    penalty = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)

    def probs(ids):
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1].double()
        return processed_probs(penalty(ids, sequence_bias(ids, logits) if bias else logits), params)

    p1 = probs(torch.tensor([prompt]))[0]
    cont = p1.clone()
    cont[list(eos_ids)] = 0
    support = cont.nonzero().squeeze(1)
    p2 = (cont[support, None] * probs(torch.cat([torch.tensor([prompt]).expand(len(support), -1), support[:, None]],
                                              dim=1))).sum(0)
    return p1, p2


@pytest.mark.parametrize("drafter", ["none", "draft_model"])
def test_sampling_with_logit_bias_follows_the_biased_target(drafter, tiny_models):
    target = tiny_models["llama"][0]
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    params = SamplingParams(0.9, repetition_penalty=1.3)
    dec = draftsman.load({"target": {"path": str(target)},
                          "drafter": {"name": "none"} if drafter == "none" else
                          {"name": "draft_model", "path": str(target), "k": 3}})  # always accepted: depth 2 verified
    model = load_for_reference(target)
    unbiased, _ = biased_marginals(model, prompt, {}, params)
    top = unbiased.argsort(descending=True)[:2].tolist()
    bias = {top[0]: -100.0, top[1]: 2.0}  # the likeliest banned, the second made likelier
    p1, p2 = biased_marginals(model, prompt, bias, params, dec.engine.eos_token_ids)
    assert p1[top[0]] < 1e-30 and p1[top[1]] > unbiased[top[1]]
    out = dec.generate(input_ids=[prompt] * ROWS, max_new_tokens=2, temperature=params.temperature,
                       repetition_penalty=params.repetition_penalty, logit_bias=bias, seed=11)
    first = torch.tensor([row[0] for row in out.token_ids])
    second = torch.tensor([row[1] for row in out.token_ids if len(row) == 2])
    assert len(second) > 0.9 * ROWS  # rows that end at EOS after one token are rare here
    assert fit_pvalue(first, p1) > ALPHA
    assert fit_pvalue(second, p2 / p2.sum()) > ALPHA
    # The same samples do not follow the unbiased target (the test can fail).
    assert fit_pvalue(first, unbiased) < ALPHA


def test_logit_bias_from_the_config_and_the_cli(tiny_models, tmp_path, capsys):
    target = str(tiny_models["llama"][0])
    free = draftsman.load({"target": {"path": target}}).generate(input_ids=[[5, 6, 7]], max_new_tokens=8)
    banned = free.token_ids[0][0]
    config = tmp_path / "run.json"  # JSON writes the ids as strings, as OpenAI's logit_bias does
    config.write_text(json.dumps({"target": {"path": target}, "sampling": {"logit_bias": {str(banned): -100}}}))
    out = draftsman.load(str(config)).generate(input_ids=[[5, 6, 7]], max_new_tokens=8)
    assert banned not in out.token_ids[0] and out.token_ids != free.token_ids
    assert cli.main(["generate", "--config", str(config), "--input-ids", "5,6,7", "--max-new-tokens", "8",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out.token_ids
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"target": {"path": target}}))
    assert cli.main(["generate", "--config", str(plain), "--input-ids", "5,6,7", "--max-new-tokens", "8",
                     "--logit-bias", f"{banned}=-100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out.token_ids
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        cli.main(["generate", "--config", str(plain), "--input-ids", "5", "--logit-bias", "5:-1"])
    assert "'5:-1': expected ID=BIAS, e.g. 50256=-100" in capsys.readouterr().err


@pytest.mark.parametrize("bias, message", [
    ({320: 1.0}, "logit_bias has token ids [320] outside the target's vocabulary [0, 320): drop them"),
    ({5: 101}, "logit_bias values must be in [-100, 100]"),
    ({"x": 1}, "logit_bias must map token ids (integers >= 0) to biases, e.g. {50256: -100}"),
])
def test_bad_logit_bias_is_refused(tiny_models, bias, message):
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=re.escape(message)):
        dec.generate(input_ids=[[5, 6]], max_new_tokens=2, logit_bias=bias)


def test_compare_leaves_out_the_hugging_face_peers_under_a_logit_bias():
    """compare's peers run plain HF generate: under a bias (as under penalties) their greedy output
    is another model's, so they are left out."""
    from draftsman.bench.config import changes_greedy_output

    assert changes_greedy_output({"logit_bias": {5: 1.0}}) and not changes_greedy_output({"top_k": 5})
