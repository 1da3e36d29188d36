"""sampling.lossy_typical_acceptance: Medusa's typical acceptance, LOSSY and opt-in
(verifier/typical.py). The rule on hand-made trees against thresholds written out here; the
engine keeps its cache on the path the rule accepts (logprobs recomputed by teacher forcing); at
temperature 0 the output stays the target's greedy output; and it is labelled lossy everywhere:
the stats, the CLI's warning and stats line, compare's notes, and the audit, whose sampling check
catches it as not exact."""
import json
import math

import pytest
import torch

import draftsman
from draftsman import cli
from draftsman.audit import format_report, run_audit
from draftsman.config import load_config
from draftsman.drafters import DraftTree
from draftsman.drafters.base import DETERMINISTIC
from draftsman.verifier.rejection import Coin
from draftsman.verifier.sampling import SamplingParams, TypicalAcceptance
from draftsman.verifier.tree import pack_drafts
from draftsman.verifier.typical import verify_typical

from tiny_models import load_for_reference, perturbed_copy

RULE = TypicalAcceptance(posterior_threshold=0.3, posterior_alpha=0.5)
# A lax rule for the sampled tests: it accepts nearly every draft of these near-uniform targets, so
# its effects stand out of the sampling noise on any random stream (CUDA's differs from the CPU's).
# With Medusa's defaults, 2 rows of 20 tokens gained tau in only 10 of 16 seeds, and the audit's
# 500 samples gave p = 3e-9 to 1e-4 over seeds 0-7; with this rule, a gain of 0.4-1.6 in 12 of 12,
# and p <= 8e-11 in 8 of 8.
LAX = {"posterior_threshold": 0.01, "posterior_alpha": 0.05}
REPETITIVE = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # n-gram lookup drafts deep here


class RecordingCoin(Coin):
    """Draws token 0 and keeps the distribution it was asked to draw from."""

    def __init__(self):
        self.drawn_from = []

    def accept(self, prob, mask):
        raise AssertionError("typical acceptance draws no accept coins")

    def sample(self, probs, mask):
        self.drawn_from.append(probs.clone())
        return torch.zeros(probs.shape[0], dtype=torch.long)


def threshold(p: list[float]) -> float:
    """Medusa's bar, written out: min(threshold, alpha * exp(-entropy in nats))."""
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    return min(RULE.posterior_threshold, RULE.posterior_alpha * math.exp(-entropy))


def tree(tokens, parents):
    n = len(tokens)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.full((n,), DETERMINISTIC))


def verdict(slots: list[list[float]], tokens, parents):
    probs = torch.tensor([slots], dtype=torch.float64)
    coin = RecordingCoin()
    v = verify_typical(probs, pack_drafts([tree(tokens, parents)], 4, "cpu"), coin, RULE)
    return v.accepted[0, : int(v.num_accepted[0])].tolist(), coin.drawn_from[0][0]


FLAT = [0.25, 0.25, 0.25, 0.25]  # bar min(0.3, 0.5 / 4) = 0.125: every token passes
SURE = [0.02, 0.94, 0.02, 0.02]  # bar 0.3: only token 1 passes


def test_the_thresholds_are_medusas():
    assert threshold(FLAT) == pytest.approx(0.125) and threshold(SURE) == pytest.approx(0.3)
    probs = torch.tensor([FLAT, SURE, [0.5, 0.3, 0.1, 0.1]], dtype=torch.float64)
    from draftsman.verifier.typical import typical_thresholds
    assert typical_thresholds(probs, RULE).tolist() == pytest.approx([threshold(p) for p in probs.tolist()])


def test_the_deepest_passing_path_is_accepted_and_the_next_token_drawn_after_it():
    # Slots: 0 root, node i at slot i + 1. Nodes: 0 (token 1) and 1 (token 2) under the root;
    # 2 (token 3) under 0; 3 (token 1) under 1; 4 (token 1) under 3.
    slots = [FLAT, SURE, [0.1, 0.8, 0.05, 0.05], SURE, SURE, FLAT]
    accepted, drawn_from = verdict(slots, [1, 2, 3, 1, 1], [-1, -1, 0, 1, 3])
    # node 2's token 3 has 0.02 at node 0 (bar 0.3): that path stops at depth 1; 1 -> 3 -> 4 passes.
    assert accepted == [1, 3, 4]
    assert drawn_from.tolist() == FLAT  # the target's distribution after node 4, not a draft's


def test_a_tie_in_depth_goes_to_the_likelier_path_and_nothing_passing_draws_at_the_root():
    root = [0.1, 0.3, 0.5, 0.1]  # bar min(0.3, 0.5 exp(-H)) ~ 0.16: tokens 1 and 2 pass
    accepted, _ = verdict([root, FLAT, FLAT], [1, 2], [-1, -1])
    assert accepted == [1]  # both depth 1: token 2 (0.5) beats token 1 (0.3)
    accepted, drawn_from = verdict([SURE, FLAT, FLAT], [0, 2], [-1, -1])
    assert accepted == [] and drawn_from.tolist() == SURE


def test_a_passing_node_under_a_failing_parent_is_not_accepted():
    accepted, drawn_from = verdict([SURE, FLAT, FLAT], [0, 1], [-1, 0])  # token 0 fails at the root
    assert accepted == [] and drawn_from.tolist() == SURE


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models["llama"][0]


@pytest.fixture(scope="module")
def close(target, tmp_path_factory):
    return perturbed_copy(target, tmp_path_factory.mktemp("typical-close"), noise=0.1)


@pytest.mark.parametrize("drafter", [{"name": "ngram", "k": 4, "branches": 3, "min_ngram": 1},
                                     {"name": "draft_model", "k": 3, "top_k": 2, "total_tokens": 6}],
                         ids=["ngram_tree", "draft_model_tree"])
def test_the_cache_follows_the_accepted_path(target, close, drafter):
    """Every emitted token's logprob equals the target's over the whole sequence at once: the cache
    and positions follow what typical acceptance accepted, batch of two, ragged."""
    if drafter["name"] == "draft_model":
        drafter = {**drafter, "path": str(close)}
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": drafter})
    prompts = [REPETITIVE, [7, 8, 9, 10]]
    exact = dec.generate(input_ids=prompts, max_new_tokens=20, temperature=1.0, seed=1)
    out = dec.generate(input_ids=prompts, max_new_tokens=20, temperature=1.0, seed=1, logprobs=True,
                       lossy_typical_acceptance=LAX)
    assert out.stats.lossy and not exact.stats.lossy and out.stats.as_dict()["lossy"]
    assert out.stats.tau > exact.stats.tau  # what it is for: more drafts accepted than exact sampling
    model = load_for_reference(target)
    for prompt, tokens, values in zip(prompts, out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
        want = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(values), want, atol=1e-4)


def test_at_temperature_0_the_output_stays_the_targets_greedy_output(target):
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "ngram", "k": 4, "branches": 2},
                          "sampling": {"lossy_typical_acceptance": True}})
    out = dec.generate(input_ids=[REPETITIVE], max_new_tokens=20)
    plain = dec.with_drafter({"name": "none"}).generate(input_ids=[REPETITIVE], max_new_tokens=20,
                                                        lossy_typical_acceptance=False)
    assert out.token_ids == plain.token_ids and not out.stats.lossy


def test_the_audit_catches_it_as_not_exact(target, close):
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "draft_model", "path": str(close),
                                                                        "k": 3}})
    small = dict(max_new_tokens=8, sample_prompts=1, samples=500, positions=2, checks=("sampling",))
    exact = run_audit(dec, [REPETITIVE], sampling=SamplingParams(1.0), **small)
    assert exact["passed"], format_report(exact)
    lossy = run_audit(dec, [REPETITIVE], sampling=SamplingParams(1.0, lossy_typical_acceptance=LAX), **small)
    assert not lossy["passed"] and lossy["sampling"]["min_p_value"] < 1e-8
    assert any("lossy_typical_acceptance is on" in w for w in lossy["warnings"])


def test_the_cli_says_lossy_and_refuses_bad_values(target, capsys):
    base = ["generate", "--set", f"target.path={target}", "--drafter", "ngram", "--input-ids",
            ",".join(map(str, REPETITIVE)), "--max-new-tokens", "8", "--temperature", "1"]
    assert cli.main([*base, "--lossy-typical-acceptance"]) == 0
    captured = capsys.readouterr()
    assert "NOT distributed as the target's own samples" in captured.err
    assert "(LOSSY: typical acceptance)" in captured.out
    assert cli.main([*base, "--lossy-typical-acceptance", "0.05,0.2", "--json"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert got["stats"]["lossy"] and "NOT distributed" in captured.err
    assert cli.main([*base, "--json"]) == 0  # off by default: exact, and said nothing
    captured = capsys.readouterr()
    assert not json.loads(captured.out)["stats"]["lossy"] and "lossy" not in captured.err
    with pytest.raises(SystemExit) as exit_:  # argparse's own exit for a flag it cannot read
        cli.main([*base, "--lossy-typical-acceptance", "0.5"])
    assert exit_.value.code == 2
    assert "expected THRESHOLD,ALPHA" in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [
    ({"posterior_threshold": 0}, "posterior_threshold must be a number > 0"),
    ({"posterior_threshold": 1.5}, "posterior_threshold must be <= 1"),
    ({"posterior_alpha": -1}, "posterior_alpha must be a number > 0"),
    ({"alpha": 0.3}, r"unknown key\(s\) \['alpha'\]; valid: \['posterior_alpha', 'posterior_threshold'\]"),
    ("yes", "must be null \\(exact\\), true"),
])
def test_bad_config_values_are_named(value, message):
    with pytest.raises(ValueError, match="sampling.lossy_typical_acceptance.*" + message):
        load_config({"sampling": {"lossy_typical_acceptance": value}})


def test_compare_notes_a_lossy_run(target, tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"text": "def parse(text):\n"}) + "\n")
    (tmp_path / "bench.yaml").write_text(json.dumps({
        "target": {"path": str(target)}, "drafters": [{"name": "none"}, {"name": "ngram", "k": 3}],
        "prompts": str(tmp_path / "prompts.jsonl"), "peers": False, "temperatures": [1],
        "sampling": {"lossy_typical_acceptance": True}, "out": str(tmp_path / "out")}))
    assert cli.main(["compare", "--config", str(tmp_path / "bench.yaml"), "--quick", "--no-progress"]) == 0
    assert "note: LOSSY: sampling.lossy_typical_acceptance is on" in capsys.readouterr().out
    assert any(n.startswith("LOSSY") for n in json.loads((tmp_path / "out" / "results.json").read_text())["notes"])


def test_compare_puts_lossy_rows_beside_exact_ones(target, tmp_path, capsys):
    """A drafter entry's own lossy_typical_acceptance: its label says LOSSY, its T>0 cells are
    marked lossy, its T=0 cells stay equal to plain decoding."""
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"text": "def parse(text):\n"}) + "\n")
    (tmp_path / "bench.yaml").write_text(json.dumps({
        "target": {"path": str(target)}, "prompts": str(tmp_path / "prompts.jsonl"), "peers": False,
        "drafters": [{"name": "none"}, {"name": "ngram", "k": 3},
                     {"name": "ngram", "k": 3, "lossy_typical_acceptance": True}],
        "temperatures": [0, 1], "out": str(tmp_path / "out")}))
    assert cli.main(["compare", "--config", str(tmp_path / "bench.yaml"), "--quick", "--no-progress"]) == 0
    assert "note: LOSSY: at T > 0 the rows labelled (LOSSY)" in capsys.readouterr().out
    cells = json.loads((tmp_path / "out" / "results.json").read_text())["cells"]
    lossy = {(c["drafter"], c["temperature"]): c["lossy"] for c in cells}
    assert lossy == {("none", 0): False, ("ngram", 0): False, ("ngram (LOSSY)", 0): False,
                     ("none", 1): False, ("ngram", 1): False, ("ngram (LOSSY)", 1): True}
    assert all(c["mismatches"] == 0 for c in cells if c["temperature"] == 0)
    bad = json.loads((tmp_path / "bench.yaml").read_text())
    bad["drafters"][2]["lossy_typical_acceptance"] = {"posterior_alpha": 0}
    (tmp_path / "bench.yaml").write_text(json.dumps(bad))
    assert cli.main(["compare", "--config", str(tmp_path / "bench.yaml"), "--quick", "--no-progress"]) == 2
    assert "drafters[2] (ngram): lossy_typical_acceptance.posterior_alpha must be a number > 0" \
        in capsys.readouterr().err
