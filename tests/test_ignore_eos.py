"""ignore_eos (vLLM's): EOS ends no row and is not held back either; it is drawn as any other
token, so the output is the target's own decoding with no EOS known, run to max_new_tokens or a
stop token. What benchmark clients (vLLM's and SGLang's serving benchmarks) send to fix output
lengths; `draftsman serve` takes it, and their "best_of": 1."""
import pytest
import torch

import draftsman
from draftsman import cli

from serving import call
from test_row_min_new_tokens import (SAMPLED_PROMPT, SAMPLED_ROWS, close_draft, drafters,  # noqa: F401 (a fixture)
                                     frequent_eos, likeliest_first_token)
from test_engine_sampling import ALPHA, fit_pvalue

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12], [7, 7, 7]]
NEW = 16


def load(tiny_models, drafter, eos_ids):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": drafter})
    decoder.engine.eos_token_ids = frozenset(eos_ids)
    return decoder


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "draft_model_tree", "eagle3", "mtp"])
def test_rows_run_past_eos_as_decoding_without_one(tiny_models, close_draft, fresh_heads, frequent_eos, name):  # noqa: F811
    spec = drafters(tiny_models, close_draft, fresh_heads)[name]
    without_eos = load(tiny_models, {"name": "none"}, ()).generate(input_ids=PROMPTS, max_new_tokens=NEW,
                                                                   temperature=0.0)
    # Minimums past each row's first EOS: under ignore_eos they hold nothing back.
    minimums = [min(NEW, row.index(frequent_eos) + 2) if frequent_eos in row else 0 for row in without_eos.token_ids]
    decoder = load(tiny_models, spec, {frequent_eos})
    ended = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0)
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=minimums, temperature=0.0,
                           ignore_eos=True)
    assert out.token_ids == without_eos.token_ids, name
    assert out.stats.finish_reasons == ["length"] * len(PROMPTS)
    # EOS mattered: rows ended at it without ignore_eos; it stands inside the outputs now.
    assert "eos" in ended.stats.finish_reasons and sum(m > 0 for m in minimums) >= 2, (ended.stats, minimums)


def test_stop_tokens_still_end_rows(tiny_models, frequent_eos):  # noqa: F811
    decoder = load(tiny_models, {"name": "ngram", "k": 3, "min_ngram": 1}, {frequent_eos})
    free = decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=True).token_ids
    stop = free[0][6]
    out = decoder.generate(input_ids=PROMPTS[:1], max_new_tokens=NEW, temperature=0.0, ignore_eos=True,
                           stop_token_ids=[stop])
    want = free[0][: free[0].index(stop) + 1]
    assert out.token_ids[0] == want and out.stats.finish_reasons == ["stop"]


def test_sampled_rows_draw_eos_from_the_targets_own_distribution(tiny_models):
    """T=1, every row held for 1 token, EOS the target's likeliest first token: under ignore_eos
    the first tokens follow the target's distribution, EOS included (held back, they would not)."""
    target = tiny_models["llama"][0]
    eos, p1, _ = likeliest_first_token(target)
    decoder = load(tiny_models, {"name": "draft_model", "path": str(target), "k": 2}, {eos})
    out = decoder.generate(input_ids=[SAMPLED_PROMPT] * SAMPLED_ROWS, max_new_tokens=2, min_new_tokens=1,
                           temperature=1.0, seed=5, ignore_eos=True)
    first = torch.tensor([row[0] for row in out.token_ids])
    assert fit_pvalue(first, p1) > ALPHA and (first == eos).sum() > 0.5 * SAMPLED_ROWS * float(p1[eos])
    assert all(len(row) == 2 for row in out.token_ids) and out.stats.tau > 1.01


def test_ignore_eos_from_the_config_the_cli_and_bad_values(tiny_models, capsys, monkeypatch):
    target = str(tiny_models["llama"][0])
    decoder = draftsman.load({"target": {"path": target}, "generation": {"ignore_eos": True}})
    decoder.engine.eos_token_ids = frozenset(range(decoder.engine.vocab_size))  # every token an EOS
    assert decoder.generate(input_ids=PROMPTS[:1], max_new_tokens=5).stats.finish_reasons == ["length"]
    assert decoder.generate(input_ids=PROMPTS[:1], max_new_tokens=5, ignore_eos=False).stats.finish_reasons == ["eos"]
    with pytest.raises(ValueError, match="ignore_eos must be true or false, got 'yes'"):
        decoder.generate(input_ids=PROMPTS[:1], ignore_eos="yes")
    # The CLI's --ignore-eos reaches generate (None without it: the config's value).
    seen = []
    generate = draftsman.api.Decoder.generate
    monkeypatch.setattr(draftsman.api.Decoder, "generate",
                        lambda self, *a, **kw: seen.append(kw["ignore_eos"]) or generate(self, *a, **kw))
    args = ["generate", "--set", f"target.path={target}", "--input-ids", "5,6,7", "--max-new-tokens", "4", "--json"]
    assert cli.main(args) == 0 and cli.main([*args, "--ignore-eos"]) == 0 and seen == [None, True]
    capsys.readouterr()
    with pytest.raises(ValueError, match="generation.ignore_eos"):
        draftsman.load({"target": {"path": target}, "generation": {"ignore_eos": 1}})


def test_serve_takes_ignore_eos_and_best_of_as_benchmark_clients_send_them(served):
    decoder, base = served
    body = {"prompt": "def parse(text):\n", "max_tokens": 24, "ignore_eos": True, "best_of": 1, "temperature": 0}
    status, got = call(base, "/v1/completions", body)
    want = decoder.generate(["def parse(text):\n"], max_new_tokens=24, ignore_eos=True)
    assert status == 200 and got["usage"]["completion_tokens"] == 24 == len(want.token_ids[0])
    assert got["choices"][0]["text"] == want.texts[0] and got["choices"][0]["finish_reason"] == "length"
    status, got = call(base, "/v1/completions", {**body, "best_of": 3})
    assert status == 400 and '"best_of" 3 is not served' in got["error"]["message"]
