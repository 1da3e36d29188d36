"""`draftsman audit`: correct drafters pass, and each part catches its own kind of breakage: a
verifier that skips the first greedy check, a drafter that reports a sharpened q, an engine that
runs past EOS. Plus the chi-square test itself, prompt files and the command's exit codes."""
import json

import pytest
import torch
from scipy.stats import chi2_contingency

import draftsman
from draftsman import cli
from draftsman.audit import format_report, greedy_check, read_prompts, run_audit
from draftsman.chisquare import two_sample_chi2
from draftsman.drafters import DraftTree, register
from draftsman.drafters.draft_model import DraftModelDrafter
from draftsman.verifier import engine as engine_module
from draftsman.verifier.engine import SpeculativeEngine
from draftsman.verifier.sampling import SamplingParams

from tiny_models import perturbed_copy

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10]]
SMALL = dict(max_new_tokens=16, sample_prompts=1, samples=500, positions=2)


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models["llama"][0]


@pytest.fixture(scope="module")
def close(target, tmp_path_factory):
    """Agrees with the target often enough that both accept and reject paths run, greedy too."""
    return perturbed_copy(target, tmp_path_factory.mktemp("audit-close"), noise=0.1)


@pytest.fixture(scope="module")
def plain(target):
    return draftsman.load({"target": {"path": str(target)}})


def register_sharpened_q():
    """Samples each draft from q but reports q^3 (renormalised): the verifier then accepts likely
    tokens too rarely and unlikely ones too often. Greedy drafts carry no q, so greedy is unharmed."""

    @register
    class SharpenedQ(DraftModelDrafter):
        name = "sharpened_q_test"

        def propose(self, contexts):
            out = []
            for t in super().propose(contexts):
                if t.draft_probs is not None:
                    sharp = t.draft_probs ** 3
                    t = DraftTree(t.tokens, t.parents, t.kinds, sharp / sharp.sum(-1, keepdim=True))
                out.append(t)
            return out


def skip_first_greedy_check(monkeypatch):
    """An off-by-one verifier: the first drafted child of the root is accepted unchecked."""
    real = engine_module.verify_greedy

    def broken(target_argmax, drafts):
        argmax = target_argmax.clone()
        first = drafts.children[:, 0, 0]
        has = first >= 0
        argmax[has, 0] = drafts.tokens[has, first[has]]
        return real(argmax, drafts)

    real_chains = engine_module.verify_greedy_chains

    def broken_chains(target_argmax, chain_tokens, valid):  # the same bug on the chain path
        argmax = target_argmax.clone()
        argmax[valid[:, 0], 0] = chain_tokens[valid[:, 0], 0]
        return real_chains(argmax, chain_tokens, valid)

    monkeypatch.setattr(engine_module, "verify_greedy", broken)
    monkeypatch.setattr(engine_module, "verify_greedy_chains", broken_chains)


# ----------------------------------------------------------------------------- the audit

@pytest.mark.parametrize("drafter, sampling", [
    ({"name": "none"}, SamplingParams(1.0)),
    ({"name": "ngram", "k": 3, "branches": 2}, SamplingParams(1.0)),
    ({"name": "draft_model", "k": 3}, SamplingParams(1.0)),
    ({"name": "draft_model", "k": 3}, SamplingParams(0.9, top_k=20, top_p=0.9)),
    ({"name": "cascade"}, SamplingParams(1.0)),
    # Adaptive speculation picks each round's depth from timings: whatever it picks (here it
    # speculated, tau about 1.3 in the sampled rounds), the samples must stay the target's.
    ({"name": "draft_model", "k": 3, "adaptive": True}, SamplingParams(1.0)),
], ids=["none", "ngram", "draft_model", "draft_model_topk_topp", "cascade", "draft_model_adaptive"])
def test_correct_configurations_pass(plain, close, drafter, sampling):
    if drafter["name"] == "draft_model":
        drafter = {**drafter, "path": str(close)}
    if drafter["name"] == "cascade":
        drafter = {"name": "cascade", "drafters": [{"name": "ngram", "min_ngram": 2},
                                                   {"name": "draft_model", "path": str(close), "k": 3}]}
    result = run_audit(plain.with_drafter(drafter), PROMPTS, sampling=sampling, **SMALL)
    assert result["passed"], format_report(result)
    assert result["greedy"]["tokens"] == 32 and not result["greedy"]["prompts"][0]["mismatches"]
    assert len(result["sampling"]["tests"]) == 3  # token 1, token 2, tokens 1-2
    if drafter["name"] == "draft_model" and not drafter.get("adaptive"):  # (ngram's guesses are
        # rarely sampled by a random model; adaptive may rightly decode plainly on a slow machine)
        assert min(result["sampling"]["tau"]) > 1.0 and not result["warnings"], "the accept path must have run"
    if drafter["name"] == "cascade":  # the report says which child drafted
        assert result["greedy"]["tau"] > 1.0
        assert [d["drafter"] for d in result["greedy"]["drafter_report"]["drafters"]] == ["0:ngram", "1:draft_model"]


def test_a_drafter_that_reports_the_wrong_q_fails_the_sampling_check(plain, close):
    register_sharpened_q()
    result = run_audit(plain.with_drafter({"name": "sharpened_q_test", "path": str(close), "k": 3}), PROMPTS,
                       sampling=SamplingParams(1.0), **{**SMALL, "samples": 1000, "sample_prompts": 2})
    assert result["greedy"]["passed"], "greedy drafts carry no q: that part must pass"
    assert not result["sampling"]["passed"] and not result["passed"]
    assert result["sampling"]["min_p_value"] < 1e-10  # far below the 1e-4 / 6 threshold: not luck
    report = format_report(result)
    assert "sampling: FAIL" in report and "RESULT: FAIL" in report


def test_a_verifier_that_skips_a_check_fails_the_greedy_check(plain, close, monkeypatch):
    skip_first_greedy_check(monkeypatch)
    dec = plain.with_drafter({"name": "draft_model", "path": str(close), "k": 3})
    result = greedy_check(dec, PROMPTS, max_new_tokens=16)
    assert not result["passed"]
    bad = [m for row in result["prompts"] for m in row["mismatches"]]
    assert bad and all(m["emitted"] != m["argmax"] and m["logit_gap"] > 1e-3 and m["rank"] >= 1 for m in bad)
    # The same tokens within a (silly) tolerance count as near-ties, reported but not failing.
    lenient = greedy_check(dec, PROMPTS, max_new_tokens=16, tolerance=1e9)
    assert lenient["passed"] and sum(len(r["near_ties"]) for r in lenient["prompts"]) == len(bad)
    shown = {"target": "t", "dtype": "float32", "drafter": {}, "warnings": [], "passed": True, "greedy": lenient}
    assert "near-tie at new token" in format_report(shown)


def test_output_must_stop_at_eos(plain, monkeypatch):
    dec = plain.with_drafter({"name": "ngram"})
    first = dec.generate(input_ids=[PROMPTS[1]], max_new_tokens=16).token_ids[0]
    dec.engine.eos_token_ids = {first[4]}  # a token greedy emits: now the row ends there
    ok = greedy_check(dec, [PROMPTS[1]], max_new_tokens=16)
    assert ok["passed"] and ok["prompts"][0]["tokens"] == first.index(first[4]) + 1

    real_clip = SpeculativeEngine._clip

    def ignores_eos(self, tokens, produced, context_len, max_new_tokens, end_ids):
        return real_clip(self, tokens, produced, context_len, max_new_tokens, frozenset())  # the row's EOS ignored

    monkeypatch.setattr(SpeculativeEngine, "_clip", ignores_eos)
    broken = greedy_check(dec, [PROMPTS[1]], max_new_tokens=16)
    assert not broken["passed"]
    assert any("tokens emitted after EOS" in p for p in broken["prompts"][0]["problems"])


@pytest.mark.parametrize("generation", [{"min_new_tokens": 8}, {"ignore_eos": True}, {"stop_token_ids": "FIFTH"},
                                        {"stop_token_ids": "FIFTH", "min_new_tokens": 8}])
def test_the_configs_eos_settings_hold_in_the_greedy_check(target, close, generation):
    """The check's reference holds EOS and stop ids back before min_new_tokens, and lets EOS pass under
    ignore_eos, as the engine does: a correct drafter under such a config failed with NOT ARGMAX or
    'tokens emitted after EOS'."""
    first = draftsman.load({"target": {"path": str(target)}}).generate(input_ids=[PROMPTS[1]],
                                                                       max_new_tokens=16).token_ids[0]
    fifth = first[4]  # a token greedy emits: it ends the row (as EOS, or as a stop id)
    generation = {k: [fifth] if v == "FIFTH" else v for k, v in generation.items()}
    dec = draftsman.load({"target": {"path": str(target)}, "generation": generation,
                          "drafter": {"name": "draft_model", "path": str(close), "k": 3}})
    if "stop_token_ids" not in generation:
        dec.engine.eos_token_ids = {fifth}
    result = greedy_check(dec, [PROMPTS[1]], max_new_tokens=16)
    assert result["passed"], format_report({"target": "t", "dtype": "float32", "drafter": {}, "greedy": result})
    ended_at = first.index(fifth) + 1
    tokens = result["prompts"][0]["tokens"]
    assert tokens > ended_at if generation.get("min_new_tokens", 0) > ended_at or "ignore_eos" in generation \
        else tokens == ended_at


# ----------------------------------------------------------------------------- the statistics

def test_chi_square_equals_scipy_when_nothing_is_pooled():
    g = torch.Generator().manual_seed(0)
    a = torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), 400, True, generator=g).tolist()
    b = torch.multinomial(torch.tensor([0.4, 0.35, 0.25]), 300, True, generator=g).tolist()
    mine = two_sample_chi2(a, b)
    table = [[a.count(k) for k in range(3)], [b.count(k) for k in range(3)]]
    stat, p, dof, _ = chi2_contingency(table, correction=False)
    assert mine["dof"] == dof == 2 and mine["statistic"] == pytest.approx(stat)
    assert mine["p_value"] == pytest.approx(p, rel=1e-9)


def test_rare_categories_are_pooled_and_same_samples_pass():
    a = [0] * 200 + [1] * 100 + list(range(10, 40))  # 30 categories seen once
    table = two_sample_chi2(a, list(a))
    assert table["categories"] == 3 and table["distinct"] == 32 and table["p_value"] == pytest.approx(1.0)
    hashed = two_sample_chi2([(x,) for x in a], [(x,) for x in a], hash_rare=True)
    assert hashed["p_value"] == pytest.approx(1.0)
    assert two_sample_chi2([7] * 50, [7] * 60)["p_value"] == 1.0  # one category: nothing can differ
    assert two_sample_chi2([0] * 100 + [1] * 100, [0] * 200)["p_value"] < 1e-20


# ----------------------------------------------------------------------------- prompts and the command

def test_prompt_files_jsonl_or_one_per_line(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "def f(x):\\n    return"}\n\n{"input_ids": [1, 2, 3]}\n')
    assert read_prompts(jsonl) == ["def f(x):\n    return", [1, 2, 3]]
    txt = tmp_path / "p.txt"
    txt.write_text("import os\n\nclass A:\n")
    assert read_prompts(txt) == ["import os", "class A:"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: every prompt needs a non-empty string \"text\""):
        read_prompts(bad)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="has no prompts"):
        read_prompts(tmp_path / "empty.txt")



def test_a_jsonl_row_with_a_meta_key_is_audited(tmp_path):
    """A prompt row with a "meta" key was taken for the file's header and silently left out."""
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "def f(x):", "meta": "from run 3"}\n{"text": "def g(y):"}\n')
    assert read_prompts(jsonl) == ["def f(x):", "def g(y):"]

@pytest.fixture(scope="module")
def config_file(target, close, tmp_path_factory):
    path = tmp_path_factory.mktemp("audit-cli") / "run.yaml"
    path.write_text(f"target: {{path: {target}}}\ndrafter: {{name: draft_model, path: {close}, k: 3}}\n"
                    "generation: {max_new_tokens: 12}\n")
    return path


QUICK = ["--samples", "300", "--sample-prompts", "1", "--positions", "2"]


def test_command_exits_0_on_a_pass_with_a_readable_report_or_json(config_file, capsys):
    assert cli.main(["audit", "--config", str(config_file), *QUICK]) == 0
    out = capsys.readouterr().out
    assert "greedy: PASS" in out and "sampling: PASS" in out and out.rstrip().endswith("RESULT: PASS")
    assert "temperature 1" in out  # the config is greedy: sampling is audited at temperature 1
    assert cli.main(["audit", "--config", str(config_file), "--only", "sampling", "--top-k", "5", *QUICK,
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["passed"] and "greedy" not in got and got["sampling"]["top_k"] == 5
    assert all(0 <= t["p_value"] <= 1 for t in got["sampling"]["tests"])


def test_command_exits_1_on_a_failure(config_file, monkeypatch, capsys):
    skip_first_greedy_check(monkeypatch)
    assert cli.main(["audit", "--config", str(config_file), "--only", "greedy"]) == 1
    out = capsys.readouterr().out
    assert "NOT ARGMAX" in out and "RESULT: FAIL" in out


@pytest.mark.parametrize("args, message", [
    (["--samples", "3"], "--samples must be at least 10"),
    (["--alpha", "2"], "--alpha must be in (0, 1)"),
    (["--tie-tolerance", "-1"], "--tie-tolerance must be >= 0 (a logit gap), got -1.0"),
    (["--tie-tolerance", "nan"], "--tie-tolerance must be >= 0"),
    (["--prompts", "/no/such/prompts.jsonl"], "prompts file '/no/such/prompts.jsonl' does not exist"),
    (["--prompts", "/dev/null"], "prompts file '/dev/null' is not a regular file"),
    (["--temperature", "0"], "--temperature must be > 0 for the sampling check"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--min-p", "1.5"], "min_p must be in [0, 1]"),
    (["--set", "drafter.kk=3"], "unknown option(s) ['kk'] for drafter 'draft_model'"),
])
def test_user_errors_exit_2(config_file, capsys, args, message):
    assert cli.main(["audit", "--config", str(config_file), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err



@pytest.mark.parametrize("row, message", [
    ('{"text": "def f(x):", "line": null}', '"line" must be a whole number >= 0'),
    ('{"text": "def f(x):", "tokens": [1]}', '"tokens" must be a whole number >= 0'),
    ('{"text": "def f(x):", "line": "abc"}', '"line" must be a whole number >= 0'),
])
def test_a_prompt_rows_bad_field_exits_2_naming_its_file_and_line(config_file, tmp_path, capsys, row, message):
    """These failed as a TypeError traceback or as "invalid literal for int()", naming no file or line."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "import os"}\n' + row + "\n")
    assert cli.main(["audit", "--config", str(config_file), "--prompts", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:2: ") and message in err and "or left out, got" in err, err

@pytest.mark.parametrize("penalties", [{"repetition_penalty": 1.3}, {"presence_penalty": 2.0, "frequency_penalty": 2.0},
                                       {"logit_bias": {5: -100.0, 9: 4.0}, "repetition_penalty": 1.3},
                                       {"no_repeat_ngram_size": 1}, {"bad_words_ids": "BITE"}],
                         ids=["repetition", "presence_frequency", "logit_bias", "no_repeat_ngram", "bad_words"])
def test_a_config_with_penalties_and_stop_strings_passes(target, close, penalties):
    """The greedy check takes the argmax after the config's penalties and logit bias (else every
    penalised position would be a false mismatch); the audit ignores the config's stop strings."""
    if penalties.get("bad_words_ids") == "BITE":  # words that bite: each prompt's first greedy token
        plain = draftsman.load({"target": {"path": str(target)}}).generate(input_ids=PROMPTS, max_new_tokens=2)
        penalties = {"bad_words_ids": [[row[0]] for row in plain.token_ids] + [row[:2] for row in plain.token_ids]}
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "draft_model", "path": str(close), "k": 3},
                          "sampling": penalties, "generation": {"stop": ["e"]}})
    result = run_audit(dec, PROMPTS, sampling=SamplingParams(1.0, **penalties), **SMALL)
    assert result["passed"], format_report(result)
    assert result["greedy"]["tokens"] == 32


def test_a_min_new_tokens_above_positions_or_max_new_tokens_is_capped(target, close, tmp_path, capsys):
    """A valid config with generation.min_new_tokens 5 was refused after the greedy check ran: the
    sampling check generates --positions tokens (2 here), below it. Capped, it still bans EOS at every
    sampled position, as the config does; so is one above --max-new-tokens in the greedy check."""
    path = tmp_path / "minnew.yaml"
    path.write_text(f"target: {{path: {target}}}\ndrafter: {{name: draft_model, path: {close}, k: 3}}\n"
                    "generation: {max_new_tokens: 12, min_new_tokens: 5}\n")
    assert cli.main(["audit", "--config", str(path), *QUICK]) == 0, capsys.readouterr().err
    assert "RESULT: PASS" in capsys.readouterr().out
    assert cli.main(["audit", "--config", str(path), "--only", "greedy", "--max-new-tokens", "3"]) == 0
    assert "greedy: PASS" in capsys.readouterr().out


def test_a_prompts_path_that_is_a_folder_or_not_a_regular_file_says_so(tmp_path):
    """Both were reported as a file that "does not exist"."""
    with pytest.raises(IsADirectoryError, match="is a folder: give a file in it"):
        read_prompts(tmp_path)
    with pytest.raises(ValueError, match="'/dev/null' is not a regular file: save the prompts to a file"):
        read_prompts("/dev/null")


def test_the_sampling_check_reports_the_drafters_report(plain, close):
    """A cascade's report() was printed only by the greedy check: `--only sampling` showed none."""
    cascade = {"name": "cascade", "drafters": [{"name": "ngram", "min_ngram": 2},
                                               {"name": "draft_model", "path": str(close), "k": 3}]}
    result = run_audit(plain.with_drafter(cascade), PROMPTS, sampling=SamplingParams(1.0), checks=("sampling",),
                       **{**SMALL, "samples": 100, "batch_size": 50})
    calls = result["sampling"]["drafter_reports"]
    assert len(calls) == 1 and len(calls[0]) == 2  # one sampled prompt, two engine calls of 50 rows
    assert [d["drafter"] for d in calls[0][0]["drafters"]] == ["0:ngram", "1:draft_model"]
    assert "drafter report, per engine call: " in format_report(result)
