"""`draftsman compare` (draftsman/bench/): a --quick run on tiny random models writes every file
with consistent numbers; the prompt-set builder is deterministic and round-trips through JSONL;
config and prompt-file mistakes are reported without loading a model."""
from __future__ import annotations

import ast
import csv
import json
import re
import statistics

import pytest
import yaml

from draftsman import cli
from draftsman.bench import prompts_set as P
from draftsman.bench.config import BUNDLED_PROMPTS, QUICK, load_bench_config

from tiny_models import CORPUS

PROMPTS = [
    {"text": CORPUS[0] * 2 + "def parse(text):\n", "category": "copy"},
    {"text": CORPUS[2] * 2 + "for i in range(10):\n", "category": "copy"},
    {"text": "class Foo:\n    def __init__(self, x):\n", "category": "continuation"},
    {"text": "import os\nimport sys\n\nif __name__ == '__main__':\n", "category": "continuation"},
]
DRAFTERS = ["none", "ngram", "draft_model"]


@pytest.fixture(scope="module")
def quick_run(tiny_models, tmp_path_factory):
    """One --quick run (the expensive part), shared by the checks below."""
    tmp = tmp_path_factory.mktemp("compare")
    target, draft = tiny_models["llama"]
    (tmp / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    (tmp / "bench.yaml").write_text(yaml.safe_dump({
        "target": {"path": str(target)},
        "drafters": [{"name": "none"}, {"name": "ngram", "k": 3}, {"name": "draft_model", "path": str(draft), "k": 3}],
        "prompts": "prompts.jsonl",  # relative to the config file
        "sweep_drafters": ["ngram"],  # the sweep runs ngram beside its baseline, not draft_model
        "out": str(tmp / "out"),
    }))
    return tmp


def test_quick_run_writes_files_with_consistent_numbers(quick_run, capsys):
    assert cli.main(["compare", "--config", str(quick_run / "bench.yaml"), "--quick", "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    out = quick_run / "out"
    for name in ("results.json", "results.csv", "peers.csv", "batch_sweep.csv", "tau_speedup.png",
                 "acceptance.png", "batch_sweep.png", "peers.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert "| drafter | category | T | tokens/s |" in stdout and "### Batch sweep" in stdout

    res = json.loads((out / "results.json").read_text())
    assert res["command"] == f"draftsman compare --config {quick_run / 'bench.yaml'} --quick --no-progress"
    cells = res["cells"]
    temps, cats = [0, 1], ["copy", "continuation"]
    assert {(c["drafter"], c["category"], c["temperature"]) for c in cells} == {
        (d, c, t) for d in DRAFTERS for c in cats for t in temps}
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(DRAFTERS) * len(cats) * len(temps) == len(cells)
    for c in cells:
        assert c["prompts"] == 2 and c["repeats"] == 1
        assert c["tau"] >= 1.0
        assert all(0.0 <= a <= 1.0 for a in c["acceptance"])
        assert c["tokens_per_s"] > 0 and c["speedup"] > 0
        assert abs(c["draft_frac"] + c["verify_frac"] + c["other_frac"] - 1.0) < 1e-6
        assert c["new_tokens"] >= c["rounds"] >= 1
        if c["temperature"] == 0:
            assert c["mismatches"] == 0 and c["divergences"] == [], c  # lossless: identical to plain decoding
        else:
            assert c["mismatches"] is None
    none = [c for c in cells if c["drafter"] == "none"]
    assert all(c["tau"] == 1.0 and c["speedup"] == 1.0 and c["acceptance"] == [] for c in none)
    draft = [c for c in cells if c["drafter"] == "draft_model"]
    assert all(c["extra_parameters"] > 0 and len(c["acceptance"]) == 3 for c in draft)

    # Every category at once (Spec-Bench's "overall"): tokens and rounds add up across the cells,
    # and with one repeat, tokens over summed seconds lies between the categories' own rates.
    assert "### All categories together" in stdout
    overall = {(r["drafter"], r["temperature"]): r for r in res["overall"]}
    assert set(overall) == {(d, t) for d in DRAFTERS for t in temps}
    for (d, t), r in overall.items():
        mine = [c for c in cells if c["drafter"] == d and c["temperature"] == t]
        assert r["prompts"] == sum(c["prompts"] for c in mine) == 4
        assert r["new_tokens"] == sum(c["new_tokens"] for c in mine)
        assert r["tau"] == r["new_tokens"] / sum(c["rounds"] for c in mine)  # batch 1: a row-round is a round
        rates = [c["tokens_per_s"] for c in mine]
        assert min(rates) <= r["tokens_per_s"] <= max(rates)
    assert all(r["speedup"] == 1.0 for (d, _), r in overall.items() if d == "none")

    peers = {(p["peer"], p["category"]): p for p in res["peers"]}
    assert set(peers) == {(p, c) for p in ("hf_generate", "hf_assisted", "hf_prompt_lookup") for c in cats}
    for (name, _), p in peers.items():
        assert p["tokens_per_s"] > 0 and 0 <= p["same_as_ours"] <= p["prompts"]
        assert p["counterparts"] and next(iter(p["counterparts"])) == p["counterpart"]
        assert p["counterparts"][p["counterpart"]] == p["counterpart_over_peer"] > 0
    # Plain HF generate and our plain decoding are the same greedy decoding of the same weights.
    assert all(p["same_as_ours"] == p["prompts"] for (name, _), p in peers.items() if name == "hf_generate")

    points = res["batch_sweep"]["points"]
    assert {(p["drafter"], p["batch_size"]) for p in points} == {(d, b) for d in ("none", "ngram") for b in (1, 2)}
    assert all(p["tokens_per_s"] > 0 for p in points)
    assert res["environment"]["torch"] and res["memory_method"]


def test_a_sampling_section_reaches_every_cell(quick_run, tiny_models, capsys, monkeypatch):
    """Penalties change greedy output, so the HF peers (plain greedy) are skipped with a note; our
    drafters all run under them and still match plain decoding at T=0."""
    from draftsman.api import Decoder

    seen = []
    generate = Decoder.generate
    monkeypatch.setattr(Decoder, "generate", lambda self, *a, **k: seen.append(dict(self.config["sampling"]))
                        or generate(self, *a, **k))
    config = yaml.safe_load((quick_run / "bench.yaml").read_text())
    config.update({"sampling": {"repetition_penalty": 1.3, "top_p": 0.9}, "temperatures": [0], "batch_sizes": [1],
                   "out": str(quick_run / "out-sampling")})
    (quick_run / "sampling.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["compare", "--config", str(quick_run / "sampling.yaml"), "--quick", "--no-progress"]) == 0
    assert "- sampling in every cell (besides its temperature): repetition_penalty 1.3, top_p 0.9" in capsys.readouterr().out
    res = json.loads((quick_run / "out-sampling" / "results.json").read_text())
    assert res["peers"] == [] and any("change greedy output" in n for n in res["notes"])
    assert all(c["mismatches"] == 0 for c in res["cells"])
    assert seen and all(s["repetition_penalty"] == 1.3 and s["top_p"] == 0.9 for s in seen)


def test_drafters_compare_under_a_grammar(quick_run, capsys, monkeypatch):
    """sampling.structured_output: every contender runs under the grammar (its outputs are what
    the grammar describes, and at T=0 plain decoding's under it), the HF peers, which would run
    without it, are skipped with a note."""
    from draftsman.api import Decoder

    texts = []
    generate = Decoder.generate

    def recording(self, *a, **k):
        out = generate(self, *a, **k)
        texts.extend(out.texts)
        return out

    monkeypatch.setattr(Decoder, "generate", recording)
    config = yaml.safe_load((quick_run / "bench.yaml").read_text())
    config.update({"sampling": {"structured_output": {"regex": "[a-c ]{1,12}"}}, "temperatures": [0],
                   "batch_sizes": [1], "out": str(quick_run / "out-grammar")})
    (quick_run / "grammar.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["compare", "--config", str(quick_run / "grammar.yaml"), "--quick", "--no-progress"]) == 0
    res = json.loads((quick_run / "out-grammar" / "results.json").read_text())
    assert res["peers"] == [] and any("structured output change greedy output" in n for n in res["notes"])
    assert all(c["mismatches"] == 0 for c in res["cells"]) and len(res["cells"]) >= 2
    assert texts and all(re.fullmatch("[a-c ]{0,12}", text) for text in texts), texts[:3]


def test_min_new_tokens_fixes_every_contenders_length(tiny_models, tmp_path, capsys):
    """min_new_tokens = max_new_tokens: every cell and every peer produces exactly that many tokens,
    still identical to plain decoding (the peers get it too, else they would end early and differ).
    EOS is a token this random target emits often, so without the key rows do end early."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from tiny_models import load_for_reference

    target = shutil.copytree(tiny_models["llama"][0], tmp_path / "target")
    model, tok = load_for_reference(target), AutoTokenizer.from_pretrained(target)
    plain = [model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
             for ids in (tok(p["text"])["input_ids"] for p in PROMPTS)]
    eos = max(set(sum(plain, [])), key=lambda t: sum(t in row for row in plain))
    for name in ("config.json", "generation_config.json"):
        path = target / name
        data = json.loads(path.read_text()) if path.exists() else {}
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data))
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    config = {"target": {"path": str(target)}, "drafters": [{"name": "none"}, {"name": "ngram", "k": 3},
                                                            {"name": "layer_skip", "exit_layer": 1, "k": 3}],
              "prompts": "prompts.jsonl", "temperatures": [0], "sweep_drafters": ["ngram"]}

    def run(out, *flags):
        (tmp_path / "bench.yaml").write_text(yaml.safe_dump({**config, "out": str(tmp_path / out)}))
        assert cli.main(["compare", "--config", str(tmp_path / "bench.yaml"), "--quick", "--no-progress", *flags]) == 0
        return json.loads((tmp_path / out / "results.json").read_text()), capsys.readouterr().out

    free, _ = run("free")
    assert any(c["new_tokens"] < 2 * 16 for c in free["cells"])  # without the key a row ends early
    fixed, stdout = run("fixed", "--min-new-tokens", "16")
    assert "16 new tokens (fixed length: EOS masked until then)" in stdout
    assert fixed["config"]["min_new_tokens"] == 16
    assert all(c["new_tokens"] == 2 * 16 and c["mismatches"] == 0 for c in fixed["cells"])  # 2 prompts a category
    assert {p["peer"] for p in fixed["peers"]} == {"hf_generate", "hf_prompt_lookup", "hf_early_exit"}
    assert all(p["same_as_ours"] == p["prompts"] for p in fixed["peers"])
    # --quick: batch sizes 1 and 2, one timed batch each
    assert all(p["new_tokens"] == 16 * p["batch_size"] for p in fixed["batch_sweep"]["points"])
    with pytest.raises(ValueError, match=r"min_new_tokens must be an integer in \[0, max_new_tokens = 16\]"):
        load_bench_config(overrides={"target": {"path": "t"}, "max_new_tokens": 16, "min_new_tokens": 17})
    # --quick keeps a fixed-length config fixed length, at its own 16 tokens
    (tmp_path / "fixed.yaml").write_text(yaml.safe_dump({**config, "min_new_tokens": 64, "max_new_tokens": 64}))
    assert load_bench_config(tmp_path / "fixed.yaml", dict(QUICK), quick=True)["min_new_tokens"] == 16
    with pytest.raises(ValueError, match="min_new_tokens must be an integer in"):  # unless asked for more
        load_bench_config(tmp_path / "fixed.yaml", {**QUICK, "min_new_tokens": 20}, quick=True)


def test_config_mistakes_are_named_before_any_model_loads(tmp_path, capsys):
    bad = tmp_path / "bench.yaml"
    bad.write_text("target: {path: nowhere}\nrepeat: 3\n")
    assert cli.main(["compare", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown compare config key(s) ['repeat']" in err and "'repeats'" in err
    bad.write_text("target: {path: nowhere}\nsweep_repeats: 0\n")
    assert cli.main(["compare", "--config", str(bad)]) == 2
    assert "sweep_repeats must be an integer >= 1 or null" in capsys.readouterr().err
    # an --out that is a file failed only when the results were written, after the whole run
    bad.write_text("target: {path: nowhere}\n")
    assert cli.main(["compare", "--config", str(bad), "--out", str(bad)]) == 2
    assert "is a file: the results go in a folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unique `label`"):
        load_bench_config(overrides={"target": {"path": "t"}, "drafters": [{"name": "ngram"}, {"name": "ngram", "k": 8}]})
    cfg = load_bench_config(overrides={"target": {"path": "t"}, "drafters": [{"name": "ngram", "label": "ng"}]})
    assert [d["name"] for d in cfg["drafters"]] == ["none", "ngram"]  # the baseline is always there
    with pytest.raises(ValueError, match=r"sweep_drafters names \['eagle'\], not among the drafters' labels"):
        load_bench_config(overrides={"target": {"path": "t"}, "drafters": [{"name": "ngram"}], "sweep_drafters": ["eagle"]})
    with pytest.raises(ValueError, match="batch_sizes"):
        load_bench_config(overrides={"target": {"path": "t"}, "batch_sizes": [0]})
    # a drafter's options and folder are checked with the config, not when its turn comes after the target loads
    with pytest.raises(ValueError, match=r"drafters\[1\]: unknown option\(s\) \['kk'\] for drafter 'ngram'"):
        load_bench_config(overrides={"target": {"path": "t"}, "drafters": [{"name": "none"},
                                                                          {"name": "ngram", "kk": 2}]})
    with pytest.raises(FileNotFoundError, match=r"drafters\[0\]: eagle: drafter.path '.*nowhere' does not exist"):
        load_bench_config(overrides={"target": {"path": "t"}, "drafters": [{"name": "eagle", "path": "nowhere"}]})
    for key, values, twice in (("temperatures", [0, 1, 0.0], 0), ("batch_sizes", [1, 2, 2], 2)):  # each ran twice
        with pytest.raises(ValueError, match=rf"{key} \[.*\] lists \[{twice}\] more than once"):
            load_bench_config(overrides={"target": {"path": "t"}, key: values})
    for flag in ("--batch-sizes", "--temperatures"):  # '1,,4' ran as 1,4
        for numbers, message in (("1,,4", "a number is missing between commas"), ("1,4,", "is missing between"),
                                 ("", "expected comma-separated numbers")):
            with pytest.raises(SystemExit):
                cli.main(["compare", "--config", str(bad), flag, numbers])
            assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\['sampling.temperature'\].*temperatures are the `temperatures` list"):
        load_bench_config(overrides={"target": {"path": "t"}, "sampling": {"temperature": 0.5}})
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        load_bench_config(overrides={"target": {"path": "t"}, "sampling": {"repetition_penalty": 0}})
    # 1e-3 is a string to PyYAML; a run config reads it as the number, and so does this one
    bad.write_text("target: {path: nowhere}\nsampling: {min_p: 1e-3}\n")
    assert load_bench_config(str(bad))["sampling"] == {"min_p": 0.001}



def test_a_drafter_labelled_none_is_refused_beside_the_baseline(tmp_path, capsys):
    """`label: none` on another drafter gave the baseline's label to it: the run exited 0 with the
    baseline row showing that drafter's numbers. Labels are unique with the baseline among them."""
    for drafters in ([{"name": "ngram", "label": "none"}], [{"name": "none"}, {"name": "ngram", "label": "none"}]):
        with pytest.raises(ValueError, match=r"drafters\[\d\] \(ngram\): the label 'none' belongs to the baseline"):
            load_bench_config(overrides={"target": {"path": "t"}, "drafters": drafters})
    (tmp_path / "bench.yaml").write_text("drafters: [{name: ngram, label: none}]\ntemperatures: [0]\n")
    assert cli.main(["compare", "--config", str(tmp_path / "bench.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "choose another `label`" in capsys.readouterr().err and not (tmp_path / "out").exists()
    cfg = load_bench_config(overrides={"target": {"path": "t"}, "drafters": [{"name": "none", "label": "base"},
                                                                            {"name": "ngram", "label": "ng"}]})
    assert [d.get("label") for d in cfg["drafters"]] == ["base", "ng"]  # a baseline of another label is allowed


def test_temperatures_that_are_not_finite_are_refused_before_the_target_loads(tiny_models, tmp_path, capsys):
    """--temperatures nan or inf passed the config check (only < 0 was refused) and failed after
    the target loaded, the --out folder already made."""
    out, prompts = tmp_path / "out", tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    for value in ("nan", "inf"):
        assert cli.main(["compare", "--target", str(tiny_models["llama"][0]), "--drafters", "ngram", "--quick",
                         "--no-peers", "--no-progress", "--batch-sizes", "1", "--temperatures", f"0,{value}",
                         "--prompts", str(prompts), "--out", str(out)]) == 2
        assert f"temperatures must be finite numbers >= 0 (0 = greedy), got [0.0, {value}]" in capsys.readouterr().err
        assert not out.exists()

def test_target_and_drafters_flags_compare_without_a_file(tiny_models, tmp_path, capsys):
    """--target DIR --drafters ...: a user's own target without a compare config. The target
    section of a file keeps its dtype and device under --target; mistakes are named first."""
    target = tiny_models["llama"][0]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    flags = ["--quick", "--no-progress", "--no-peers", "--temperatures", "0", "--batch-sizes", "1",
             "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "out")]
    assert cli.main(["compare", "--target", str(target), "--drafters", "[{name: ngram, k: 3}]", *flags]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["target"]["path"] == str(target)
    assert [d["name"] for d in results["config"]["drafters"]] == ["none", "ngram"]
    assert {c["drafter"] for c in results["cells"]} == {"none", "ngram"}
    assert all(c["mismatches"] == 0 for c in results["cells"])
    assert "--target " + str(target) in results["command"] and "--drafters" in results["command"]
    capsys.readouterr()

    file = tmp_path / "bench.yaml"
    file.write_text(yaml.safe_dump({"target": {"path": "elsewhere", "dtype": "float64", "device": "cpu"}}))
    cfg = load_bench_config(file, {"target": {"path": str(target)}})
    assert cfg["target"] == {"path": str(target), "dtype": "float64", "device": "cpu"}
    assert [d["name"] for d in cfg["drafters"]] == ["none", "ngram"]  # a user's target: no bundled heads
    for drafters, message in [("ngram,ngarm", "unknown drafter 'ngarm'; available drafters: ["),
                              ("[1, 2]", "each drafter in a YAML list is a mapping with a name"),
                              ("[{name: ngram", "--drafters is not a valid YAML list")]:
        assert cli.main(["compare", "--target", "nowhere", "--drafters", drafters]) == 2
        assert message in capsys.readouterr().err


def test_a_rerun_into_the_same_out_removes_the_earlier_runs_files_it_does_not_make(tiny_models, tmp_path, capsys):
    """A run without peers into a folder of an earlier run with them left its peers.png beside the new
    results, read as this run's. Compare's own file names are removed; a user's files stay."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("peers.png", "batch_sweep.png", "mine.png", "notes.txt"):
        (out / name).write_text("an earlier run's\n")
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    assert cli.main(["compare", "--target", str(tiny_models["llama"][0]), "--drafters", "ngram", "--quick",
                     "--no-peers", "--no-progress", "--temperatures", "0", "--batch-sizes", "1",
                     "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(out)]) == 0
    assert "note: removed peers.png: an earlier run's, not made by this one" in capsys.readouterr().out
    assert not (out / "peers.png").exists()
    assert (out / "batch_sweep.png").read_bytes().startswith(b"\x89PNG")  # this run's own, written over the old
    assert (out / "mine.png").is_file() and (out / "notes.txt").is_file()


def test_a_prompt_past_the_context_is_told_what_helps():
    """A prompt that alone fills the context was told to lower max_new_tokens, which cannot help."""
    from types import SimpleNamespace

    from draftsman.bench.compare import _encode

    decoder = SimpleNamespace(engine=SimpleNamespace(max_context=10))
    for tokens, message in ((8, "lower max_new_tokens to 2 or less, or drop the prompt"),
                            (10, "the prompt alone fills it: shorten or drop the prompt"),
                            (12, "the prompt alone fills it: shorten or drop the prompt")):
        prompt = P.Prompt(id="p", category="copy", input_ids=list(range(tokens)))
        with pytest.raises(ValueError, match=f"prompt 'p' has {tokens} tokens; .* context of 10: {message}") as e:
            _encode(decoder, [prompt], max_new_tokens=4)
        assert ("max_new_tokens to" in str(e.value)) == (tokens < 10)


def test_peak_memory_sees_a_temporary_tensor():
    import time

    import torch

    from draftsman.bench.memory import PeakMemory

    def briefly_hold_40mb():
        x = torch.ones(10_000_000)
        time.sleep(0.25)  # 250 samples due: the sampler thread may be starved for a while on a busy machine
        return x.sum()

    meter = PeakMemory(torch.device("cpu"))
    peak = meter.measure(briefly_hold_40mb)  # the tensor is freed before measure returns
    assert peak is None or peak >= 30e6, (peak, meter.method)


def test_example_config_is_valid_and_paths_are_relative_to_it():
    root = BUNDLED_PROMPTS.parents[3]
    cfg = load_bench_config(root / "configs" / "bench.yaml")
    assert cfg["target"]["path"] == str(root / "zoo" / "python-target")
    assert [d["name"] for d in cfg["drafters"]] == ["none", "ngram", "draft_model"]
    assert cfg["drafters"][2]["path"] == str(root / "zoo" / "python-draft")
    assert cfg["prompts"] == str(BUNDLED_PROMPTS) and cfg["temperatures"] == [0, 1]


# --------------------------------------------------------------------------- the prompt set

SOURCE = '''\
"""Module docstring, first line.

More words about the module that go on for a while,
and yet another line of it, and one more to be sure.
"""

TABLE = {{
{table}
}}


def work(items, scale):
    """Do the work.

    The docstring continues here with a second paragraph
    that says what the function returns and why.
    """
    total = 0
    for item in items:
        total += item * scale
    # A comment block that explains
    # the next steps in some detail,
    # over several lines of text.
    result = [total] * len(items)
    names = sorted(str(x) for x in items)
    return result, names, {{"total": total, "scale": scale}}


def helper_{n}(value):
    first = value + {n}
    second = first * 2
    third = second - value
    return first, second, third, "helper number {n} is done"
'''


def _write_sources(folder, count=4):
    files = []
    for n in range(count):
        table = "\n".join(f"    'key_{i % 4}': ('value', {i % 3}, None)," for i in range(30))
        f = folder / f"mod{n}.py"
        f.write_text(SOURCE.format(table=table, n=n))
        files.append(f)
    (folder / "py2.py").write_text("print 'not python 3'\n" * 40)  # skipped, not an error
    return files + [folder / "py2.py"]


def test_builder_gives_each_category_deterministically(tmp_path, tiny_tokenizer):
    files = _write_sources(tmp_path)
    prompts = P.build_prompts(files, tiny_tokenizer, per_category=3, max_tokens=160, min_tokens=16, root=tmp_path)
    assert [p.category for p in prompts] == ["continuation"] * 3 + ["copy"] * 3 + ["docstring"] * 3
    assert prompts == P.build_prompts(list(reversed(files)), tiny_tokenizer, per_category=3, max_tokens=160,
                                      min_tokens=16, root=tmp_path)
    for p in prompts:
        src = (tmp_path / p.source).read_text()
        lines = src.splitlines(keepends=True)
        cut = sum(len(x) for x in lines[: p.line - 1])
        assert src[:cut].endswith(p.text)  # the prompt ends exactly at the cut...
        assert cut == len(p.text) or src[cut - len(p.text) - 1] == "\n"  # ...and starts at a line start
        assert 16 <= p.tokens == len(tiny_tokenizer(p.text)["input_ids"]) <= 160
        nxt = lines[p.line - 1]
        if p.category == "docstring":
            in_comment = lines[p.line - 2].lstrip().startswith("#") and nxt.lstrip().startswith("#")
            assert in_comment or any(d.lineno < p.line < d.end_lineno for d in _docstrings(src)), p
        if p.category == "continuation":
            assert nxt.startswith("    ") and not nxt.lstrip().startswith(("#", '"""'))
        if p.category == "copy":
            assert P.overlap(p.text, src[cut:]) >= P.COPY_MIN_OVERLAP
    assert len({p.source for p in prompts if p.category == "copy"}) == 3  # one per file before seconds
    with pytest.raises(ValueError, match="give only"):
        P.build_prompts(files[:1], tiny_tokenizer, per_category=50, max_tokens=160, min_tokens=16)


def _docstrings(src: str) -> list[ast.AST]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [n.body[0] for n in ast.walk(ast.parse(src)) if isinstance(n, kinds) and ast.get_docstring(n) is not None]


def test_jsonl_round_trip_and_user_files(tmp_path, tiny_tokenizer):
    prompts = P.build_prompts(_write_sources(tmp_path), tiny_tokenizer, per_category=2, max_tokens=160, min_tokens=16,
                              root=tmp_path)
    path = tmp_path / "set.jsonl"
    P.write_prompts(path, prompts, {"built_by": "test"})
    again, meta = P.read_prompts(path)
    assert again == prompts and meta == {"built_by": "test"}
    assert json.loads(path.read_text().splitlines()[0]) == {"meta": {"built_by": "test"}}

    user = tmp_path / "mine.jsonl"
    user.write_text('{"text": "def f():\\n"}\n\n{"text": "x = 1\\n", "category": "copy"}\n')
    mine, _ = P.read_prompts(user)
    assert [(p.id, p.category) for p in mine] == [("default-000", "default"), ("copy-000", "copy")]
    assert list(P.by_category(mine, ["copy"])) == ["copy"]
    with pytest.raises(ValueError, match="have no prompts"):
        P.by_category(mine, ["docstring"])
    user.write_text('{"text": "ok"}\n{"txt": "typo"}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:2: every prompt needs"):
        P.read_prompts(user)
    user.write_text("not json\n")
    with pytest.raises(ValueError, match=r"mine.jsonl:1: not valid JSON"):
        P.read_prompts(user)

    # Token ids, as audit's files take them: read, written back and encoded as they are.
    user.write_text('{"input_ids": [5, 6, 7], "category": "ids"}\n{"text": "x = 1\\n"}\n')
    mine, _ = P.read_prompts(user)
    assert mine[0].input_ids == [5, 6, 7] and mine[0].category == "ids" and mine[1].input_ids is None
    P.write_prompts(tmp_path / "again.jsonl", mine, {})
    assert P.read_prompts(tmp_path / "again.jsonl")[0] == mine
    assert json.loads((tmp_path / "again.jsonl").read_text().splitlines()[1]) == {
        "id": "ids-000", "category": "ids", "source": "", "line": 0, "tokens": 0, "input_ids": [5, 6, 7]}
    for bad, message in [('{"input_ids": []}', '"input_ids" must be a non-empty list of token ids'),
                         ('{"input_ids": [1, "2"]}', '"input_ids" must be a non-empty list of token ids'),
                         ('{"input_ids": [1], "text": "a"}',
                          "a prompt has one of \"text\", \"messages\" or \"input_ids\""),
                         ('{"input_ids": [1], "tools": [{}]}', '"tools" go with "messages"')]:
        user.write_text(bad + "\n")
        with pytest.raises(ValueError, match="mine.jsonl:1: " + re.escape(message)):
            P.read_prompts(user)



def test_a_prompt_rows_line_and_tokens_must_be_whole_numbers(tmp_path):
    """"line": null and "tokens": [1] failed as a TypeError traceback, "line": "abc" as "invalid
    literal for int()" naming no file or row, and 3.5, -2 or true were read as 3, -2, 1."""
    user = tmp_path / "mine.jsonl"
    for field, value in [("line", None), ("tokens", [1]), ("line", "abc"), ("line", 3.5), ("tokens", -2),
                         ("line", True)]:
        user.write_text('{"text": "ok"}\n' + json.dumps({"text": "def f(x):", field: value}) + "\n")
        with pytest.raises(ValueError, match=rf'mine.jsonl:2: "{field}" must be a whole number >= 0 .* or left out'):
            P.read_prompts(user)
    user.write_text('{"text": "def f(x):", "line": 3.0, "tokens": "12"}\n')  # what int() read, whole, still reads
    assert [(p.line, p.tokens) for p in P.read_prompts(user)[0]] == [(3, 12)]


def test_a_prompt_row_with_a_meta_key_is_a_prompt_not_the_header(tmp_path):
    """Any row with a "meta" key was taken for the header and its prompt silently dropped. The
    header is {"meta": ...} alone on the first line; a row with a prompt is a prompt; a row with
    "meta" and no prompt anywhere else is named."""
    user = tmp_path / "mine.jsonl"
    user.write_text('{"meta": {"built_by": "me"}}\n{"text": "def f(x):", "meta": "from run 3"}\n'
                    '{"text": "def g(y):"}\n')
    prompts, meta = P.read_prompts(user)
    assert [p.text for p in prompts] == ["def f(x):", "def g(y):"] and meta == {"built_by": "me"}
    for rows, message in [('{"text": "a"}\n{"meta": {"b": 1}}\n', "mine.jsonl:2: a second header or one after the"),
                          ('{"meta": {}}\n\n{"meta": {"c": 2}}\n{"text": "a"}\n', "mine.jsonl:3: a second header"),
                          ('{"meta": {}, "category": "copy"}\n{"text": "a"}\n',
                           r'mine.jsonl:1: this row has "meta" and \[\'category\'\] but no prompt: give it a "text"')]:
        user.write_text(rows)
        with pytest.raises(ValueError, match=message):
            P.read_prompts(user)

def test_bundled_prompt_set():
    prompts, meta = P.read_prompts(BUNDLED_PROMPTS)
    groups = P.by_category(prompts)
    assert set(groups) == set(P.CATEGORIES)
    assert all(len(ps) >= 20 for ps in groups.values())
    assert meta["built_by"] == "draftsman compare --build-prompts draftsman/bench/data/prompts.jsonl"
    assert all(0 < p.tokens <= meta["max_prompt_tokens"] and p.source and p.line > 1 for p in prompts)


def test_cost_profile_prints_pass_times_and_break_even_acceptance(tiny_models, capsys):
    from draftsman.bench.costs import break_even, main
    assert main(["--target", str(tiny_models["llama"][0]), "--batches", "1", "2", "--tokens", "1", "3",
                 "--cached", "20", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | " in out and "break-even" in out
    # Free drafts verified at no extra cost pay at any acceptance; at twice the cost, a chain of
    # depth 1 needs a = 1 (E = 1 + a tokens for 2x the time).
    assert break_even(1.0, 1.0, 1) < 1e-6 and break_even(1.0, 2.0, 1) > 0.999


class _DriftingContender:
    """Takes `cost` seconds of a fake clock that runs 10% slower with every call anyone makes,
    like a machine heating up: only adjacent runs see the same machine."""

    clock = {"calls": 0}

    def __init__(self, label: str, cost: float):
        self.label, self.cost = label, cost

    def run(self, prompts, max_new_tokens, temperature, seed):
        from draftsman.bench.runner import Run
        self.clock["calls"] += 1
        return Run([[0] * max_new_tokens for _ in prompts], self.cost * 1.1 ** self.clock["calls"])


def test_batch_sweep_pairs_each_contender_with_its_own_baseline_runs():
    from draftsman.bench.compare import _plan
    from draftsman.bench.runner import batch_sweep
    _DriftingContender.clock["calls"] = 0
    contenders = [_DriftingContender("none", 1.0)] + [_DriftingContender(f"same{i}", 1.0) for i in range(5)]
    contenders.append(_DriftingContender("twice_as_fast", 0.5))
    ticks = []
    sweep = batch_sweep(contenders, [[1, 2, 3]], [1, 4], max_new_tokens=8, temperature=0.0, repeats=2, seed=0,
                        baseline="none", tick=lambda: ticks.append(1))
    for b in (1, 4):
        for c in contenders[1:]:
            t, base = sweep[b][c.label]
            truth = 1.0 / c.cost
            # Pair by pair (A B, then B A) the drift cancels to within a few percent; the last
            # contender sits 12+ calls from a baseline measured once per repeat (1.1^12 ~ 3x).
            assert abs(statistics.median(t.speedups(base)) / truth - 1) < 0.01, (b, c.label)
        everything, same = sweep[b]["none"]
        assert everything is same and len(everything.rep_tokens) == 2 * 6  # one baseline run per pair
    cfg = {"temperatures": [], "batch_sizes": [1, 4], "repeats": 2, "sweep_repeats": 2}
    assert len(ticks) == _plan(cfg, {}, len(contenders), 0, len(contenders))


def test_batch_sweep_measures_small_batches_on_several_prompts():
    # One prompt per batch-1 cell measured how well the drafter suits that prompt, not the batch size.
    from draftsman.bench.runner import Run, batch_sweep, sweep_batch
    seen = []

    class Recorder:
        def __init__(self, label):
            self.label = label

        def run(self, prompts, max_new_tokens, temperature, seed):
            if max_new_tokens == 8:  # timed runs (warm-ups ask for fewer tokens)
                seen.append((self.label, [p[0] for p in prompts]))
            return Run([[0] * max_new_tokens for _ in prompts], 1.0)

    rows = [[i] for i in range(5)]
    batch_sweep([Recorder("none"), Recorder("x")], rows, [1, 2], max_new_tokens=8, temperature=0.0, repeats=3,
                seed=0, baseline="none")
    x_batches = [b for label, b in seen if label == "x"]
    assert x_batches == [[0], [1], [2], [0, 1], [2, 3], [4, 0]]
    # Each contender's batch is the one its paired baseline run had.
    assert [b for label, b in seen if label == "none"] == x_batches
    assert sweep_batch(rows, 4, 1) == [[4], [0], [1], [2]]


def test_the_sweep_reports_an_interval_for_each_median_of_pairs():
    """The sign-test interval: order statistics 4 and 13 of 16 pairs, none below 6 pairs; it holds
    the true median of a known distribution about as often as it says (seeded, 400 draws)."""
    import random

    from draftsman.bench.report import _sweep_cell
    from draftsman.bench.runner import median_interval

    values = [1.0 + 0.01 * i for i in range(16)]
    random.Random(0).shuffle(values)
    assert median_interval(values) == (1.03, 1.12)
    assert median_interval(values[:5]) is None and median_interval(values[:6]) == (min(values[:6]), max(values[:6]))
    rng = random.Random(1)
    covered = sum(lo <= 1.0 <= hi for lo, hi in (median_interval([rng.gauss(1.0, 0.1) for _ in range(16)])
                                                 for _ in range(400)))
    assert 0.95 * 400 <= covered <= 400  # 97.9% nominal
    # A broken interval (the middle two order statistics) covers far less and is caught.
    narrow = sum(sorted(v)[7] <= 1.0 <= sorted(v)[8] for v in ([rng.gauss(1.0, 0.1) for _ in range(16)]
                                                                for _ in range(400)))
    assert narrow < 0.5 * 400
    cell = {"tokens_per_s": 311.4, "speedup": 0.897, "speedup_low": 0.85, "speedup_high": 0.97}
    assert _sweep_cell(cell) == "311.4 (0.90x; 0.85-0.97)"
    assert _sweep_cell({**cell, "speedup_low": None, "speedup_high": None}) == "311.4 (0.90x)"


@pytest.mark.parametrize("peer, failing", [("hf_prompt_lookup", "continuation"),  # the last category timed
                                           ("hf_prompt_lookup", "copy"),  # the first
                                           ("hf_generate", "copy")])  # the peer every other is measured against
def test_a_peer_that_fails_is_dropped_and_the_run_goes_on(peer, failing, tiny_models, tmp_path, monkeypatch,
                                                          capsys):
    """transformers' universal assisted generation raised on some prompts of the bundled pair
    (a reshape of 0 elements): a peer's failure is its result, noted, not the end of the run.
    When hf_generate failed, the other peers' rows read its tally: a KeyError after all the timing."""
    from draftsman.bench import peers as peers_module

    target = tiny_models["llama"][0]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump({
        "target": {"path": str(target)}, "drafters": [{"name": "none"}], "prompts": "prompts.jsonl",
        "temperatures": [0], "batch_sizes": [1], "out": str(tmp_path / "out")}))

    class Failing:  # the model as the lookup peer sees it: generate raises on one category's prompts
        def __init__(self, model, prompts):
            self.model, self.prompts = model, prompts

        def __getattr__(self, name):
            return getattr(self.model, name)

        def generate(self, ids, **kwargs):
            if ids[0].tolist() in self.prompts:
                raise RuntimeError("cannot reshape tensor of 0 elements")
            return self.model.generate(ids, **kwargs)

    build = peers_module.build_peers

    def with_a_failing_peer(decoder, drafters, min_new_tokens=0):
        peers, notes = build(decoder, drafters, min_new_tokens)
        chosen = next(p for p in peers if p.label == peer)
        chosen.model = Failing(chosen.model, decoder.encode([p["text"] for p in PROMPTS if p["category"] == failing]))
        return peers, notes

    from draftsman.bench import compare as compare_module
    timed, ours_runs = [], []
    interleaved = compare_module.time_interleaved

    def counted(contenders, prompts, **kwargs):  # how often each category is timed, and ours' runs in it
        ours = next(c for c in contenders if c.label == "none")
        run, calls = ours.run, []
        ours.run = lambda *a: (calls.append(a), run(*a))[1]
        try:
            return interleaved(contenders, prompts, **kwargs)
        finally:
            ours.run = run
            timed.append(len(prompts))
            ours_runs.append(len(calls))

    bars = []

    class Bar:  # the progress bar as compare drives it
        def __init__(self, total, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_description(self, text):
            pass

        refresh = close = lambda self: None

    monkeypatch.setattr("draftsman.bench.compare.build_peers", with_a_failing_peer)
    monkeypatch.setattr("draftsman.bench.compare.time_interleaved", counted)
    monkeypatch.setattr("tqdm.auto.tqdm", Bar)  # (compare imports it when it runs)
    assert cli.main(["compare", "--config", str(tmp_path / "bench.yaml"), "--quick", "--no-progress"]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    # each category timed once: the runs made before the peer failed are kept, not made again
    assert len(timed) == 2, timed
    repeats = res["config"]["repeats"]
    assert ours_runs == [1 + repeats * n + 1 for n in timed]  # warm-up, timed runs, memory
    assert bars[0].n == bars[0].total  # the bar ends full: the dropped peer's calls are not waited for
    assert next(c for c in res["cells"] if c["drafter"] == "none" and c["category"] == failing)["new_tokens"] > 0
    rows = {(p["peer"], p["category"]) for p in res["peers"]}
    cats = ["copy", "continuation"]
    lost = {(peer, c) for c in cats[cats.index(failing):]}  # its rows from the failing category on
    assert rows == {(p, c) for p in ("hf_generate", "hf_prompt_lookup") for c in cats} - lost
    for row in res["peers"]:  # without hf_generate's runs there is nothing to measure against
        assert (row["speedup_vs_hf_generate"] is None) == (("hf_generate", row["category"]) in lost), row
    assert set(res["peer_settings"]) == {"hf_generate", "hf_prompt_lookup"}  # a dropped peer's settings stay
    assert any(n.startswith(f"{peer} failed: RuntimeError: cannot reshape tensor of 0 elements "
                            f"(on a {failing} prompt)") for n in res["notes"]), res["notes"]
    assert f"{peer} failed" in capsys.readouterr().out


def test_drafters_flag_keeps_the_files_sweep_to_the_drafters_given():
    """`--config configs/bench-zoo-cpu.yaml --drafters ngram` was refused: the file's sweep_drafters
    named drafters the flag had replaced. The flag overrides the file: its sweep keeps the labels
    among the given drafters, and sweeps them all where it names none of them."""
    from draftsman.bench.command import drafters_flag

    zoo_config = BUNDLED_PROMPTS.parents[3] / "configs" / "bench-zoo-cpu.yaml"
    assert "ngram" in load_bench_config(zoo_config)["sweep_drafters"]
    assert load_bench_config(zoo_config, {"drafters": drafters_flag("ngram")})["sweep_drafters"] == ["ngram"]
    assert load_bench_config(zoo_config, {"drafters": drafters_flag("ngram,recycling")})["sweep_drafters"] == ["ngram"]
    assert load_bench_config(zoo_config, {"drafters": drafters_flag("recycling")})["sweep_drafters"] is None


def test_drafters_flag_with_a_name_missing_is_refused(tmp_path, capsys):
    """'ngram,,recycling' ran ngram and recycling, and '' the default set, without a word."""
    for drafters, message in (("ngram,,recycling", "a drafter name is missing between commas"),
                              ("ngram,", "a drafter name is missing"), ("", "--drafters is empty"),
                              (" ", "--drafters is empty")):
        assert cli.main(["compare", "--target", "nowhere", "--drafters", drafters, "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_drafters_flag_takes_one_mapping_and_names_its_two_forms(capsys):
    """'{name: ngram}' was split at its commas as names: "unknown drafter '{name:ngram}'"."""
    from draftsman.bench.command import drafters_flag

    assert drafters_flag("{name: ngram, k: 3}") == [{"name": "ngram", "k": 3}]  # a list of one
    assert drafters_flag("[{name: ngram}, {name: recycling}]") == [{"name": "ngram"}, {"name": "recycling"}]
    for text in ("name: ngram", "ngram,k:3"):  # YAML without its brackets
        assert cli.main(["compare", "--target", "nowhere", "--drafters", text]) == 2
        assert ("give a comma-separated list of names (ngram,recycling) or a YAML list of drafter configs, "
                "e.g. '[{name: ngram, k: 3}]'") in capsys.readouterr().err


def test_build_prompts_refuses_a_per_category_below_one(tiny_models, tmp_path, capsys):
    """--per-category -3 wrote an empty prompt set and exited 0."""
    out = tmp_path / "prompts.jsonl"
    for n in ("0", "-3"):
        assert cli.main(["compare", "--target", str(tiny_models["llama"][0]), "--build-prompts", str(out),
                         "--per-category", n]) == 2
        assert f"--per-category must be an integer >= 1, got {n}" in capsys.readouterr().err
        assert not out.exists()


def test_a_refused_compare_leaves_no_empty_out_folder(tiny_models, tmp_path, capsys):
    """--out was made before the prompts, the target and the categories were checked: a refused run
    left it behind, empty (with its parents). A folder that was there before stays."""
    target = tiny_models["llama"][0]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    flags = ["--quick", "--no-progress", "--no-peers", "--temperatures", "0", "--batch-sizes", "1",
             "--drafters", "ngram"]
    out = tmp_path / "new" / "out"
    for refused in (["--target", str(target), "--prompts", str(tmp_path / "missing.jsonl")],
                    ["--target", str(target), "--prompts", str(tmp_path / "empty.jsonl")],
                    ["--target", str(tmp_path / "no-target"), "--prompts", str(tmp_path / "prompts.jsonl")],
                    ["--target", str(target), "--prompts", str(tmp_path / "prompts.jsonl"), "--categories", "nope"]):
        assert cli.main(["compare", *flags, *refused, "--out", str(out)]) == 2, refused
        capsys.readouterr()
        assert not (tmp_path / "new").exists(), refused
    there = tmp_path / "there"
    there.mkdir()
    assert cli.main(["compare", *flags, "--target", str(target), "--prompts", str(tmp_path / "empty.jsonl"),
                     "--out", str(there)]) == 2
    assert there.is_dir()
