"""stop_token_ids (vLLM's): tokens that end a row as EOS does, also inside a round of several
accepted drafts, and that min_new_tokens holds back like EOS (at every tree node by its own depth,
and in the drafters' own drafts). The reference is Hugging Face generate with the stop tokens
added to eos_token_id, which is how it takes several end tokens."""
import json
import re

import pytest
import torch

import draftsman
from draftsman import cli

from tiny_models import load_for_reference, perturbed_copy

NEW = 24
PROMPT_TEXTS = ["def parse(", "class Foo:\n    def", "for i in range(10):\n    print(i", "import"]


@pytest.fixture(scope="module")
def close_drafts(tiny_models, tmp_path_factory):
    return {arch: perturbed_copy(t, tmp_path_factory.mktemp(f"{arch}-stop-close"), noise=0.05)
            for arch, (t, _) in tiny_models.items()}


def hf(model, prompt, end_ids, **kw) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=end_ids,
                          pad_token_id=end_ids[0], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          **kw)[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_stop_token_ids_end_rows_as_hugging_face_eos_token_ids_do(arch, tiny_models, tiny_tokenizer, close_drafts):
    """Greedy, batch 1 and 4, plain decoding, an n-gram tree and a draft model close enough to the
    target that rounds accept several tokens: rows end at the first stop token (kept), where HF's
    generate(eos_token_id=[eos, stop]) ends them; with min_new_tokens too."""
    target = tiny_models[arch][0]
    model = load_for_reference(target)
    eos = tiny_tokenizer.eos_token_id
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    plain = [hf(model, p, [eos]) for p in prompts]
    # A token these rows emit early (but not first), so rows end mid-output and often mid-round.
    stop = max(set(sum((row[1:-1] for row in plain), [])), key=lambda t: sum(t in row[1:-1] for row in plain))
    assert stop != eos
    close = str(close_drafts[arch])
    drafters = {"none": {"name": "none"},
                "ngram_tree": {"name": "ngram", "k": 3, "branches": 3, "min_ngram": 1, "max_ngram": 2},
                "draft_model_chain": {"name": "draft_model", "path": close, "k": 5},
                "draft_model_tree": {"name": "draft_model", "path": close, "k": 4, "top_k": 3, "total_tokens": 8}}
    base = draftsman.load({"target": {"path": str(target)}})
    for min_new in (0, 6):
        expected = [hf(model, p, [eos, stop], min_new_tokens=min_new) for p in prompts]
        assert sum(row[-1] == stop and len(row) < NEW for row in expected) >= 2 - (min_new > 0), expected  # it bites
        for name, drafter in drafters.items():
            dec = base.with_drafter(drafter)
            where = f"{arch}/{name}/min_new {min_new}"
            rows = [dec.generate(input_ids=[p], max_new_tokens=NEW, stop_token_ids=[stop], min_new_tokens=min_new)
                    for p in prompts]
            assert [r.token_ids[0] for r in rows] == expected, where
            batch = dec.generate(input_ids=prompts, max_new_tokens=NEW, stop_token_ids=[stop], min_new_tokens=min_new)
            assert batch.token_ids == expected, where + " batch 4"
            assert batch.stats.finish_reasons == ["stop" if row[-1] == stop else "eos" if row[-1] == eos else "length"
                                                  for row in expected], where
    # Not given: the same rows run on past the token.
    assert base.generate(input_ids=prompts, max_new_tokens=NEW).token_ids == plain


def test_drafters_draft_no_stop_token_before_min_new_tokens(tiny_models):
    """The target as its own draft model, with a token it emits often as the stop token and
    min_new_tokens = max_new_tokens: its drafts hold the stop token back as the verifier does, so
    every round is accepted whole (tau 5 with k = 4) and no row ends early."""
    target = str(tiny_models["llama"][0])
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "draft_model", "path": target, "k": 4}})
    prompts = [[5, 6, 7, 8], [9], [1, 2, 3, 1, 2, 3], [40, 41]]
    unstopped = dec.generate(input_ids=prompts, max_new_tokens=20).token_ids
    stop = max(set(sum(unstopped, [])), key=lambda t: sum(row.count(t) for row in unstopped))
    assert any(stop in row[:-1] for row in unstopped)
    out = dec.generate(input_ids=prompts, max_new_tokens=20, min_new_tokens=20, stop_token_ids=[stop])
    assert all(len(row) == 20 for row in out.token_ids)
    assert out.stats.tau == 5.0, out.stats.accepted_per_round
    plain = dec.with_drafter({"name": "none"})
    assert out.token_ids == plain.generate(input_ids=prompts, max_new_tokens=20, min_new_tokens=20,
                                           stop_token_ids=[stop]).token_ids


@pytest.mark.parametrize("ids, message", [
    ([-1], "stop_token_ids [-1] are not token ids of the target's vocabulary [0, 320)"),
    ([5, 320], "stop_token_ids [320] are not token ids"),
    (["x"], "stop_token_ids ['x'] are not token ids"),
    ([True], "stop_token_ids [True] are not token ids"),
    (7, "stop_token_ids must be a list of token ids, e.g. [2], got 7"),
])
def test_bad_stop_token_ids_are_refused(tiny_models, ids, message):
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=re.escape(message)):
        dec.generate(input_ids=[[5, 6]], max_new_tokens=2, stop_token_ids=ids)


def test_stop_token_ids_from_the_config_and_the_cli(tiny_models, tmp_path, capsys):
    target = str(tiny_models["llama"][0])
    with pytest.raises(ValueError, match=r"generation.stop_token_ids must be a list of token ids \(integers >= 0\)"):
        draftsman.load({"target": {"path": target}, "generation": {"stop_token_ids": ["<|im_end|>"]}})
    free = draftsman.load({"target": {"path": target}}).generate(input_ids=[[5, 6, 7]], max_new_tokens=12)
    stop = free.token_ids[0][5]
    want = free.token_ids[0][: free.token_ids[0].index(stop) + 1]
    dec = draftsman.load({"target": {"path": target}, "generation": {"stop_token_ids": [stop], "max_new_tokens": 12}})
    out = dec.generate(input_ids=[[5, 6, 7]])
    assert out.token_ids[0] == want and out.stats.finish_reasons == ["stop"]
    assert dec.generate(input_ids=[[5, 6, 7]], stop_token_ids=[]).token_ids == free.token_ids  # a call overrides
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"target": {"path": target}}))
    assert cli.main(["generate", "--config", str(config), "--input-ids", "5,6,7", "--max-new-tokens", "12",
                     "--stop-token-id", str(stop), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"][0] == want and got["stats"]["finish_reasons"] == ["stop"]
