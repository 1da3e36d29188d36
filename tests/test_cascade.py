"""The `cascade` drafter: output equal to the target's own greedy decoding and exact sampling, its
children kept in sync whichever of them drafted, later children asked only when a row needs them,
and a report of which child proposed what."""
from dataclasses import dataclass

import pytest
import torch

import draftsman
from draftsman.drafters import Drafter, DraftTree, TargetNeeds, register
from draftsman.drafters.draft_model import DraftModelDrafter
from draftsman.verifier.sampling import SamplingParams

from test_engine_sampling import exact_marginals, fit_pvalue
from tiny_models import load_for_reference, perturbed_copy
from toy_drafters import ToyDrafter

NEW_TOKENS = 30
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10], [5, 6, 5, 6, 5, 6], [40, 41, 42, 43, 40, 41]]


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models["llama"][0]


@pytest.fixture(scope="module")
def close_draft(target, tmp_path_factory):
    """Close enough to the target that its drafts are often accepted (random tiny drafts are not)."""
    return perturbed_copy(target, tmp_path_factory.mktemp("cascade-close"), noise=0.1)


@pytest.fixture(scope="module")
def plain(target):
    return draftsman.load({"target": {"path": str(target)}})


def cascade(draft_path, first=None, second="draft_model"):
    return {"name": "cascade", "drafters": [first or {"name": "ngram", "min_ngram": 2, "k": 3},
                                            {"name": second, "path": str(draft_path), "k": 3}]}


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain_decoding_and_the_report_adds_up(plain, close_draft, batch):
    dec = plain.with_drafter(cascade(close_draft))
    want = [plain.generate(input_ids=[p], max_new_tokens=NEW_TOKENS).token_ids[0] for p in PROMPTS[:batch]]
    out = dec.generate(input_ids=PROMPTS[:batch], max_new_tokens=NEW_TOKENS)
    assert out.token_ids == want
    report = dec.drafter.report()
    ngram, model = report["drafters"]
    assert ngram["drafter"] == "0:ngram" and model["drafter"] == "1:draft_model"
    assert ngram["row_rounds"] > 0 and model["row_rounds"] > 0, "both children must have drafted"
    assert model["accepted"] > 0
    # Every row-round is either one child's or nobody's; accepted drafts add up to the engine's.
    assert ngram["row_rounds"] + model["row_rounds"] + report["no_proposal_row_rounds"] == out.stats.row_rounds
    assert ngram["accepted"] + model["accepted"] == sum(map(sum, out.stats.accepted_per_round))
    assert ngram["proposed"] >= ngram["row_rounds"] and model["proposed"] >= model["row_rounds"]


def test_adaptive_cascade_still_equals_plain_decoding(plain, close_draft):
    """`adaptive: true` wraps the whole cascade: rounds it skips reach no child's observe."""
    dec = plain.with_drafter({**cascade(close_draft), "adaptive": True})
    want = [plain.generate(input_ids=[p], max_new_tokens=NEW_TOKENS).token_ids[0] for p in PROMPTS]
    assert dec.generate(input_ids=PROMPTS, max_new_tokens=NEW_TOKENS).token_ids == want
    assert 0 in dec.drafter.depth_log and max(dec.drafter.depth_log) > 0


def test_children_stay_in_sync_whichever_child_drafted(plain, close_draft):
    """The draft model's proposals inside the cascade equal those of a fresh draft model that
    prefills each context from scratch: its cache was rolled back and caught up correctly in
    rounds where ngram's tree was verified instead of its own, and in rounds it sat out."""
    checked = []

    @register
    class CheckedDraftModel(DraftModelDrafter):
        name = "checked_draft_model_test"

        def __init__(self, options, target):
            super().__init__(options, target)
            self.fresh = DraftModelDrafter(options, target)

        def propose(self, contexts):
            trees = super().propose(contexts)
            self.fresh.begin(contexts, self.sampling, self.generator)
            want = self.fresh.propose(contexts)
            checked.append([t.tokens.tolist() for t in trees] == [t.tokens.tolist() for t in want])
            return trees

    dec = plain.with_drafter(cascade(close_draft, second="checked_draft_model_test"))
    dec.generate(input_ids=PROMPTS, max_new_tokens=NEW_TOKENS)
    report = dec.drafter.report()
    assert report["drafters"][0]["row_rounds"] > 0 and len(checked) > 3
    assert all(checked), f"out of sync in rounds {[i for i, ok in enumerate(checked) if not ok]}"


def test_later_children_are_asked_only_when_a_row_needs_them(plain):
    calls = {"propose": 0, "observe": 0, "keep_rows": 0, "begin": 0}

    @register
    class Always(ToyDrafter):
        name = "always_test"
        needs = TargetNeeds(hidden_state_layers=(-1,))

        def propose(self, contexts):
            return [DraftTree.chain([c[-1]] * self.k) for c in contexts]

    @register
    class Spy(Drafter):
        name = "spy_test"
        needs = TargetNeeds(hidden_state_layers=(0, -1))

        @dataclass
        class Options:
            pass

        def __init__(self, options, target):
            pass

        def max_depth(self):
            return 7

        def extra_parameters(self):
            return 11

        def begin(self, prompts, sampling, generator):
            calls["begin"] += 1

        def propose(self, contexts):
            calls["propose"] += 1
            return [DraftTree.empty() for _ in contexts]

        def observe(self, feedback):
            calls["observe"] += 1

        def keep_rows(self, indices):
            calls["keep_rows"] += 1

    dec = plain.with_drafter({"name": "cascade", "drafters": [{"name": "always_test", "k": 3}, {"name": "spy_test"}]})
    assert dec.drafter.needs.hidden_state_layers == (-1, 0)  # the union, each layer once
    assert dec.drafter.max_depth() == 7 and dec.drafter.extra_parameters() == 11
    out = dec.generate(input_ids=[[1, 2], [3, 4, 5]], max_new_tokens=6)
    assert calls["propose"] == 0
    # ...but it hears every round (feature-level heads keep a history of the emitted tokens).
    assert calls["observe"] == out.stats.rounds
    assert calls["begin"] == 1 and calls["keep_rows"] >= 1  # rows leaving the batch reach every child
    report = dec.drafter.report()
    assert report["drafters"][1] == {"drafter": "1:spy_test", "row_rounds": 0, "proposed": 0, "accepted": 0}
    assert report["drafters"][0]["row_rounds"] == out.stats.row_rounds


def test_sampling_is_exact(target, plain, tmp_path_factory):
    """First two tokens of 2000 rows against the target's exact marginals (as in
    test_engine_sampling), with both children's trees verified in the same run: ngram drafts the
    first round (the prompt repeats [2, 3]), the draft model most second rounds."""
    medium = perturbed_copy(target, tmp_path_factory.mktemp("cascade-medium"), noise=0.3)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    dec = plain.with_drafter(cascade(medium, first={"name": "ngram", "min_ngram": 2, "k": 2}))
    out = dec.generate(input_ids=[prompt] * 2000, max_new_tokens=3, temperature=1.0, seed=11)
    report = dec.drafter.report()
    assert all(d["row_rounds"] > 0 and d["accepted"] > 0 for d in report["drafters"]), report
    p1, p2 = exact_marginals(load_for_reference(target), prompt, SamplingParams(1.0), dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) >= 2])
    assert fit_pvalue(first, p1) > 1e-6
    assert fit_pvalue(second, p2) > 1e-6


@pytest.mark.parametrize("drafters, message", [
    (None, "set drafter.drafters to a list"),
    ([], "set drafter.drafters to a list"),
    ([{"k": 3}], r"drafters\[0\] must be a mapping with a name"),
    ([{"name": "ngram"}, {"name": "no_such_drafter"}],
     r"drafters\[1\]: unknown drafter 'no_such_drafter'; available drafters"),
    ([{"name": "ngram", "kk": 3}], r"drafters\[0\]: unknown option\(s\) \['kk'\] for drafter 'ngram'"),
    ([{"name": "ngram", "k": "four"}], r"drafters\[0\]: drafter 'ngram': option k must be int"),
    ([{"name": "draft_model"}], r"drafters\[0\]: draft_model: set drafter.path"),
    ([{"name": "ngram", "adaptive": True}], r"drafters\[0\]: set adaptive: true on the cascade itself"),
])
def test_bad_child_configs_are_named(target, drafters, message):
    cfg = {"name": "cascade"} if drafters is None else {"name": "cascade", "drafters": drafters}
    with pytest.raises(ValueError, match=message):
        draftsman.load({"target": {"path": str(target)}, "drafter": cfg})


def test_relative_child_paths_in_a_config_file_resolve_against_the_file(tiny_models, tmp_path):
    target, draft = tiny_models["llama"]
    (tmp_path / "run.yaml").write_text(
        f"target: {{path: {target}}}\n"
        f"drafter: {{name: cascade, drafters: [{{name: ngram}}, {{name: draft_model, path: draft}}]}}\n")
    (tmp_path / "draft").symlink_to(draft)
    cfg = draftsman.config.load_config(tmp_path / "run.yaml")
    assert cfg["drafter"]["drafters"][1]["path"] == str(tmp_path / "draft")
    # ... and those of a cascade among the children (they were left relative to the working directory)
    (tmp_path / "nested.yaml").write_text(
        f"target: {{path: {target}}}\n"
        "drafter: {name: cascade, drafters: [{name: cascade, drafters: [{name: draft_model, path: draft}]}]}\n")
    cfg = draftsman.config.load_config(tmp_path / "nested.yaml")
    assert cfg["drafter"]["drafters"][0]["drafters"][0]["path"] == str(tmp_path / "draft")
