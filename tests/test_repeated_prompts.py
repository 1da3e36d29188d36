"""Rows that share a prompt prefix are prefilled once and their cache copied (verifier/engine.py),
and num_return_sequences=n samples each prompt n times that way. Each row must still be what the
target gives that prompt alone. The chi-square tests in test_engine_sampling.py sample 6000 copies
of one prompt, so they run through this path too."""
import json
import re

import pytest
import torch

import draftsman
from draftsman import cli

from tiny_models import load_for_reference

NEW = 16


def generate_watching_prefill(dec, **kwargs):
    """generate(**kwargs) and the batch size of the target's first pass: the prefill."""
    target, rows = dec.engine.target, []
    real = target.forward

    def forward(block, *args, **kw):
        rows.append(block.tokens.shape[0])
        return real(block, *args, **kw)

    target.forward = forward
    try:
        return dec.generate(**kwargs), rows[0]
    finally:
        del target.forward  # the class's method again


@pytest.mark.parametrize("drafter", [{"name": "none"}, {"name": "ngram", "k": 3, "branches": 2},
                                     {"name": "draft_model", "k": 4, "top_k": 2, "total_tokens": 6}],
                         ids=["none", "ngram", "draft_model_tree"])
def test_repeated_prompts_are_prefilled_once_and_each_row_is_the_targets_own(drafter, tiny_models, tiny_tokenizer):
    target, draft = tiny_models["llama"]
    if drafter["name"] == "draft_model":
        drafter = {**drafter, "path": str(draft)}
    a, b = tiny_tokenizer("def parse(")["input_ids"], tiny_tokenizer("class Foo:\n    def")["input_ids"]
    a_other_end = a[:-1] + [b[-1]]  # a's prefix, another last token (the first round's root)
    prompts = [a, b, a, a_other_end, a, [7]]
    model = load_for_reference(target)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in prompts]
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": drafter})
    out, prefilled = generate_watching_prefill(dec, input_ids=prompts, max_new_tokens=NEW)
    assert out.token_ids == expected
    assert prefilled == 3  # a's prefix, b's prefix and [7]'s empty one


def test_num_return_sequences_samples_each_prompt_n_times(tiny_models):
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out, prefilled = generate_watching_prefill(dec, input_ids=prompts, max_new_tokens=NEW, temperature=1.0, seed=2,
                                               num_return_sequences=4, logprobs=True)
    assert prefilled == 2 and len(out.token_ids) == len(out.logprobs) == 8
    for p in range(2):  # four samples of one prompt: not one row four times
        assert len({tuple(row) for row in out.token_ids[4 * p: 4 * p + 4]}) > 1
    # The same as giving each prompt four times, prompt by prompt.
    same = dec.generate(input_ids=[p for p in prompts for _ in range(4)], max_new_tokens=NEW, temperature=1.0,
                        seed=2)
    assert same.token_ids == out.token_ids
    assert len(dec.generate("def", max_new_tokens=4, temperature=0.8, num_return_sequences=3).texts) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"num_return_sequences": 0, "temperature": 1.0}, "num_return_sequences must be a whole number >= 1, got 0"),
    ({"num_return_sequences": "2", "temperature": 1.0}, "num_return_sequences must be a whole number >= 1, got '2'"),
    ({"num_return_sequences": 2}, "num_return_sequences=2 at temperature 0 would give identical rows: sample "
                                  "(temperature > 0) or leave it at 1"),
])
def test_bad_num_return_sequences_are_refused(tiny_models, kwargs, message):
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=re.escape(message)):
        dec.generate(input_ids=[[5, 6]], max_new_tokens=2, **kwargs)


def test_num_return_sequences_from_the_cli(tiny_models, tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"target": {"path": str(tiny_models["llama"][0])}}))
    args = ["generate", "--config", str(config), "--input-ids", "5,6,7", "--input-ids", "9", "--max-new-tokens", "4",
            "--temperature", "1", "--seed", "3", "--num-return-sequences", "3"]
    assert cli.main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = draftsman.load(str(config)).generate(input_ids=[[5, 6, 7], [9]], max_new_tokens=4, temperature=1.0,
                                                seed=3, num_return_sequences=3)
    assert got["token_ids"] == want.token_ids and len(got["token_ids"]) == 6
    assert cli.main(args) == 0 and capsys.readouterr().out.count("--- [") == 6


DRAFTERS = {"eagle": {"name": "eagle", "depth": 3, "top_k": 3, "total_tokens": 8},
            "eagle3": {"name": "eagle", "depth": 3, "top_k": 3, "total_tokens": 8},
            "mtp": {"name": "mtp", "depth": 3},
            "draft_model": {"name": "draft_model", "k": 3},
            "draft_model_tree": {"name": "draft_model", "k": 3, "top_k": 2, "total_tokens": 6}}


@pytest.mark.parametrize("name", DRAFTERS)
def test_drafters_feed_a_repeated_prompt_once_and_draft_as_for_it_alone(name, tiny_models, fresh_heads):
    """A batch holding one prompt three times (and one that differs only in its first token, which
    a head's first feed does not see as a token): the drafter's first feed runs 3 rows, not 5, and
    every row's drafts, round by round, are those drafted for its prompt alone."""
    target, draft = tiny_models["llama"]
    path = draft if name.startswith("draft_model") else fresh_heads / name
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {**DRAFTERS[name], "path": str(path)}})
    a, b = [5, 6, 7, 8, 9], [40, 41, 42]
    prompts = [a, a, b, a, [11] + a[1:]]

    def drafts(batch):
        """Per row, each round's tree as (tokens, parents) while no row has left the batch; the
        first feed's batch size; the output."""
        per_row, fed = [[] for _ in batch], []
        propose, forward = dec.drafter.propose, dec.drafter.lm.forward

        def record(contexts):
            trees = propose(contexts)
            if len(trees) == len(batch):
                for row, tree in enumerate(trees):
                    per_row[row].append((tree.tokens.tolist(), tree.parents.tolist()))
            return trees

        def counting(block, *args, **kwargs):
            fed.append(block.tokens.shape[0])
            return forward(block, *args, **kwargs)

        dec.drafter.propose, dec.drafter.lm.forward = record, counting
        try:
            out = dec.generate(input_ids=batch, max_new_tokens=12)
        finally:
            del dec.drafter.propose, dec.drafter.lm.forward
        return per_row, fed[0], out

    together, first_feed, out = drafts(prompts)
    assert first_feed == 3
    for row, prompt in enumerate(prompts):
        alone, _, single = drafts([prompt])
        assert single.token_ids[0] == out.token_ids[row]
        rounds = len(together[row])
        assert rounds >= 2 and together[row] == alone[0][:rounds], (name, row)
