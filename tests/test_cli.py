"""The `draftsman` command: the same tokens as the Python API, clean errors, the drafter list.

Each subprocess pays a torch import (seconds), so only three run as real processes; the other
checks call cli.main() in this process.
"""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

import draftsman
from draftsman import cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # subprocesses: one thread, like conftest.py
PROMPTS = ["def parse(text):", "class Foo:\n    def"]


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "draftsman", *args], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def config_file(tiny_models, tmp_path_factory):
    """A config with a draft_model drafter, its paths relative to the config file."""
    target, draft = tiny_models["qwen2"]
    folder = target.parent  # holds target/ and draft/
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump({
        "target": {"path": "target"},
        "drafter": {"name": "draft_model", "path": "draft", "k": 3},
        "generation": {"max_new_tokens": 12, "seed": 1},
    }))
    return path


def test_generate_json_matches_the_python_api(config_file, tmp_path):
    # --drafter ngram must drop draft_model's `path` (ngram would reject it), then --set adds k.
    proc = run("generate", "--config", str(config_file), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
               "--drafter", "ngram", "--set", "drafter.k=5", "--set", "sampling.top_k=40",
               "--max-new-tokens", "10", "--temperature", "0.8", "--top-p", "0.95", "--min-p", "0.5", "--seed", "7", "--json",
               cwd=tmp_path)  # another working directory: the config's relative paths still hold
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)

    cfg = draftsman.config.load_config(config_file)
    cfg["drafter"] = {"name": "ngram", "k": 5}
    cfg["sampling"]["top_k"] = 40
    want = draftsman.load(cfg).generate(PROMPTS, max_new_tokens=10, temperature=0.8, top_p=0.95, min_p=0.5,
                                             seed=7)
    assert got["token_ids"] == want.token_ids
    assert got["texts"] == want.texts
    assert got["config"]["drafter"] == {"name": "ngram", "k": 5}
    assert set(got["stats"]) == set(want.stats.as_dict())
    assert got["stats"]["new_tokens"] == sum(map(len, want.token_ids))


def test_target_flag_runs_without_a_config_file(tiny_models, capsys):
    """`--target DIR` instead of a config or `--set target.path=DIR` (generate, chat, serve, audit,
    regenerate take it); greedy output is the target's own."""
    target = tiny_models["qwen2"][0]
    assert cli.main(["generate", "--target", str(target), "--input-ids", "5,6,7", "--max-new-tokens", "6",
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = draftsman.load({"target": {"path": str(target)}}).generate(input_ids=[[5, 6, 7]], max_new_tokens=6)
    assert got["token_ids"] == want.token_ids and got["config"]["target"]["path"] == str(target)
    for name in ("chat", "serve", "audit", "regenerate"):
        parser = cli.build_parser([name])
        assert parser.parse_args([name, "--target", "t", *(["--data-file", "d", "--out", "o"]
                                                            if name == "regenerate" else [])]).target == "t"


def test_a_bad_key_prints_error_and_exits_2_without_traceback(config_file):
    proc = run("generate", "--config", str(config_file), "--prompt", "x", "--set", "sampling.temprature=0.5")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown key(s) ['sampling.temprature']"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_drafters_lists_every_drafter_with_its_options():
    # The installed console script when there is one (it checks the entry point too).
    exe = shutil.which("draftsman")
    cmd = [exe, "drafters"] if exe else [sys.executable, "-m", "draftsman", "drafters"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = [line for line in proc.stdout.splitlines() if line and not line.startswith(" ")]
    assert {"none", "ngram", "draft_model"} <= set(names)
    assert "drafter.k = 4" in proc.stdout and "drafter.max_ngram = 3" in proc.stdout
    assert "drafter.path = null" in proc.stdout


def test_the_drafter_listing_reads_the_sources_as_the_imported_classes_read():
    """`draftsman drafters` reads the drafters' files without importing them (no torch: a fraction of a
    second, not 4-5 s); what it reads must be what the imported classes say, down to each option's help."""
    from draftsman import drafter_catalog

    from draftsman.drafters import registry

    read = drafter_catalog.read_drafter_sources()
    # (other tests in this process may have registered drafters of their own)
    built_in = [d for d in drafter_catalog.import_drafters()
                if registry._REGISTRY[d["name"]].__module__.startswith("draftsman.drafters.")]
    assert read == built_in
    assert {d["name"] for d in read} >= {"none", "ngram", "eagle", "cascade", "retrieval"}
    assert all(o["help"] for d in read for o in d["options"]), "an option without a same-line # comment"
    code = "import sys; from draftsman import cli; cli.main(['drafters']); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "False", proc.stdout[-300:] + proc.stderr


def test_a_drafter_source_the_listing_cannot_read_is_listed_from_the_classes(monkeypatch):
    from draftsman import drafter_catalog

    def unreadable():
        raise ValueError("a default that is not a literal")

    monkeypatch.setattr(drafter_catalog, "read_drafter_sources", unreadable)
    listed = drafter_catalog.describe_drafters()
    assert listed == drafter_catalog.import_drafters() and {"ngram", "eagle"} <= {d["name"] for d in listed}


# ---------------------------------------------------------------------------- in-process

def test_text_output_has_one_block_per_prompt_and_a_stats_line(config_file, capsys):
    assert cli.main(["generate", "--config", str(config_file), "--prompt", PROMPTS[0],
                     "--prompt", PROMPTS[1], "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "--- [0] ---" in out and "--- [1] ---" in out
    stats = out.splitlines()[-1]
    assert stats.startswith("[stats] drafter draft_model: tau ")
    assert "tokens/s" in stats and "rounds" in stats


def test_input_ids_are_accepted(config_file, capsys):
    assert cli.main(["generate", "--config", str(config_file), "--input-ids", "5, 6,7",
                     "--max-new-tokens", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = draftsman.load(str(config_file)).generate(input_ids=[[5, 6, 7]], max_new_tokens=3)
    assert got["token_ids"] == want.token_ids


def test_logprobs_come_with_the_json_output(config_file, capsys):
    args = ["generate", "--config", str(config_file), "--input-ids", "5,6,7", "--input-ids", "9",
            "--max-new-tokens", "4", "--json", "--logprobs"]
    assert cli.main([*args, "--top-logprobs", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = draftsman.load(str(config_file)).generate(input_ids=[[5, 6, 7], [9]], max_new_tokens=4,
                                                     logprobs=True, top_logprobs=2)
    assert got["token_ids"] == want.token_ids and got["logprobs"] == want.logprobs
    assert got["top_logprobs"] == [[[list(pair) for pair in pos] for pos in row] for row in want.top_logprobs]
    assert [len(v) for v in got["logprobs"]] == [len(t) for t in got["token_ids"]]
    assert cli.main(args) == 0 and "top_logprobs" not in json.loads(capsys.readouterr().out)
    assert cli.main([*args, "processed", "--temperature", "0.7", "--top-k", "5"]) == 0
    processed = draftsman.load(str(config_file)).generate(input_ids=[[5, 6, 7], [9]], max_new_tokens=4,
                                                          logprobs="processed", temperature=0.7, top_k=5)
    assert json.loads(capsys.readouterr().out)["logprobs"] == processed.logprobs != want.logprobs
    assert cli.main(args[:-1]) == 0 and "logprobs" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("args, message", [
    (["--prompt", "a", "--logprobs"], "--logprobs adds a field to the JSON output: add --json"),
    (["--prompt", "a", "--json", "--top-logprobs", "3"], "--top-logprobs needs --logprobs (and --json)"),
    (["--input-ids", "1,x"], "--input-ids '1,x': expected integers"),
    (["--input-ids", "1,,2"], "--input-ids '1,,2': an id is missing between commas"),  # ran as [1, 2]
    (["--input-ids", "1,2,"], "an id is missing between commas"),
    ([], "give the prompts one way: --prompt TEXT, --input-ids 1,2,3 or --chat TEXT"),
    (["--prompt", "a", "--input-ids", "1"], "not several, not none"),
    (["--prompt", "a", "--set", "drafter.k"], "must look like section.key=value"),
    (["--prompt", "a", "--drafter", "no_such_drafter"], "unknown drafter 'no_such_drafter'; available drafters"),
    (["--prompt", "a", "--set", "target.path=/no/such/folder"], "model folder '/no/such/folder' does not exist"),
    (["--prompt", "x = 1\n" * 200], "context is 256 positions"),
])
def test_user_errors_exit_2_with_one_line(config_file, capsys, args, message):
    assert cli.main(["generate", "--config", str(config_file), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err


def test_missing_and_malformed_config_files(tmp_path, capsys):
    assert cli.main(["generate", "--config", str(tmp_path / "none.yaml"), "--prompt", "a"]) == 2
    assert "none.yaml' does not exist" in capsys.readouterr().err
    # a model folder where the run config goes (it said "does not exist")
    assert cli.main(["generate", "--config", str(tmp_path), "--prompt", "a"]) == 2
    assert f"is a folder, not a YAML or JSON run config file; for a model folder, use --target {tmp_path}" in \
        capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {path: [unclosed\n")
    assert cli.main(["generate", "--config", str(bad), "--prompt", "a"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("kind", ["medusa", "pard"])
def test_a_missing_training_config_is_named(kind, tmp_path, capsys):
    """It said "[Errno 2] No such file or directory"."""
    assert cli.main(["train", kind, "--config", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"error: training config '{tmp_path / 'none.yaml'}' does not exist; start from one of training/configs/" \
        in err


def test_demo_says_when_it_is_not_built(capsys):
    if importlib.util.find_spec("draftsman.demo") is not None:
        pytest.skip("draftsman/demo.py exists: the demo has its own tests")
    assert cli.main(["demo"]) == 2
    assert "not built yet" in capsys.readouterr().err


def test_every_subcommand_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in cli.SUBCOMMANDS:
        assert name in out


# Run in a fresh interpreter: which of the heavy libraries is loaded after each command line.
_LOADED_AFTER = """
import json, sys
from draftsman import cli
loaded = {}
for argv in json.loads(sys.argv[1]):
    try:
        cli.main(argv)
    except SystemExit:
        pass
    loaded[" ".join(argv)] = sorted({"torch", "transformers"} & set(sys.modules))
print(json.dumps(loaded))
"""


def test_help_version_and_flag_typos_answer_without_loading_torch():
    """`draftsman --help` took 6 s: every command's module was imported to build its flags. Every
    command's --help answers without torch, train pard's too."""
    argvs = [["--help"], ["--version"], ["bogus"], *([name, "--help"] for name in cli.SUBCOMMANDS),
             ["generate", "--tempurature", "1"], ["serve", "--prot", "80"], ["audit", "--sampels", "3"],
             ["export", "eagle", "--hedas", "x"], ["train", "medusa", "--confg", "x"], ["train", "pard", "--help"],
             ["train", "pard", "--confg", "x"], ["vocab", "--outt", "x"],
             ["datastore", "x", "--min-ngarm", "2"], ["compare", "--quik"], ["demo", "--prompst", "2"]]
    out = subprocess.run([sys.executable, "-c", _LOADED_AFTER, json.dumps(argvs)], capture_output=True,
                         text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {" ".join(a): [] for a in argvs}


def test_the_api_is_still_at_the_top_of_the_package():
    from draftsman import api

    for name in ("Decoder", "GenerationOutput", "GenerationStats", "JoiningPrompt", "load"):
        assert getattr(draftsman, name) is getattr(api, name) and name in dir(draftsman)
    with pytest.raises(AttributeError, match="no attribute 'Loader'"):
        draftsman.Loader


def test_a_plain_import_still_reaches_the_modules_the_api_imports():
    """`import draftsman` once loaded draftsman.api and all it imports: scripts that go on to
    draftsman.config.X or draftsman.verifier.sampling.X without importing them keep working
    (draftsman/_submodules.py)."""
    code = ("import draftsman; print(draftsman.verifier.sampling.SamplingParams.__name__, "
            "draftsman.config.load_config.__name__, draftsman.drafters.build_drafter.__name__, "
            "draftsman.heads.medusa.__name__, hasattr(draftsman, 'nope'), hasattr(draftsman.verifier, 'nope'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.stdout.split() == ["SamplingParams", "load_config", "build_drafter", "draftsman.heads.medusa",
                                  "False", "False"], out.stderr


@pytest.mark.parametrize("name", [n for n, (_, add_arguments, _) in cli.SUBCOMMANDS.items() if add_arguments])
def test_each_command_gets_its_own_flags(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    flags = [line for line in out.split("options:")[1].splitlines() if line.strip().startswith("--")]
    assert out.startswith(f"usage: draftsman {name}") and flags  # more than -h, --help


def test_names_the_light_flags_repeat_are_the_heavy_modules_own():
    """datastore's and vocab's flags name a file of a module that imports torch; they repeat the
    name rather than import it (test above)."""
    from draftsman import datastore_build
    from draftsman.drafters import datastore_index, draft_vocab
    from draftsman.training import vocab

    assert datastore_build.SUFFIX == datastore_index.SUFFIX
    parser = argparse.ArgumentParser()
    vocab.add_arguments(parser)
    assert draft_vocab.ORDER_FILE in parser.format_help().replace("\n", "").replace(" ", "")


def test_json_config_holds_the_flags_the_run_used(config_file, capsys):
    """--json's "config" held the file's sampling and generation values, not the flags': rerunning from
    it gave another output."""
    flags = {"--temperature": "0.8", "--top-k": "5", "--max-new-tokens": "5", "--seed": "3", "--stop": "zz"}
    assert cli.main(["generate", "--config", str(config_file), "--prompt", PROMPTS[0], "--json",
                     *[part for pair in flags.items() for part in pair]]) == 0
    got = json.loads(capsys.readouterr().out)
    cfg = got["config"]
    assert (cfg["sampling"]["temperature"], cfg["sampling"]["top_k"]) == (float(flags["--temperature"]),
                                                                          int(flags["--top-k"]))
    assert (cfg["generation"]["max_new_tokens"], cfg["generation"]["seed"], cfg["generation"]["stop"]) == (
        int(flags["--max-new-tokens"]), int(flags["--seed"]), [flags["--stop"]])
    again = draftsman.load(cfg).generate(PROMPTS[0])  # the config alone repeats the run
    assert again.token_ids == got["token_ids"]


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: generation.max_new_tokens must be >= 1"),
    (["--min-new-tokens", "5", "--max-new-tokens", "2"], "--min-new-tokens: generation.min_new_tokens must be in"),
    (["--top-p", "0"], "--top-p: sampling.top_p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature: sampling.temperature must be >= 0"),
    (["--stop", ""], "--stop: generation.stop: stop strings must not be empty"),
    (["--stop-token-id", "-1"], "--stop-token-id: generation.stop_token_ids must be a list of token ids"),
    (["--num-return-sequences", "3"], "--num-return-sequences: num_return_sequences=3 at temperature 0"),
])
def test_bad_flag_values_are_refused_before_a_model_loads(tmp_path, capsys, args, message):
    """They were checked by generate, after the model loaded (seconds to minutes). The target folder
    here does not exist: a check after loading would report that instead."""
    assert cli.main(["generate", "--target", str(tmp_path / "none"), "--prompt", "a", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}"), err


def test_empty_input_ids_are_refused_before_a_model_loads(tmp_path, capsys):
    assert cli.main(["generate", "--target", str(tmp_path / "none"), "--input-ids", " "]) == 2
    assert capsys.readouterr().err.startswith("error: --input-ids ' ': no token ids: give at least one")


@pytest.mark.parametrize("flag", ["--messages", "--tools"])
def test_a_file_flag_that_cannot_be_read_names_the_flag_and_the_file(tmp_path, capsys, flag):
    """A folder said "[Errno 21] Is a directory: '/tmp'"; a file in another encoding only the codec's words."""
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('[{"role": "user", "content": "café"}]'.encode("latin-1"))
    prompt = ["--chat", "hi"] if flag == "--tools" else []
    for path, problem in ((tmp_path, "is a folder: give the file in it"),
                          (latin1, "is not UTF-8 text (invalid continuation byte at byte ")):
        assert cli.main(["generate", "--target", str(tmp_path / "none"), *prompt, flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag} '{path}' {problem}"), err
        assert "save it as UTF-8" in err or "folder" in problem


def test_the_stats_line_names_the_drafter_that_ran(config_file, capsys):
    """With drafter.adaptive it said `drafter ngram`, the config's name, not adaptive's."""
    args = ["--drafter", "ngram", "--set", "drafter.adaptive=true", "--max-new-tokens", "3"]
    cfg = cli.build_config(str(config_file), "ngram", args[3:4])
    ran = draftsman.load(cfg).drafter.name
    assert ran != cfg["drafter"]["name"]
    for prompts in (["--prompt", PROMPTS[0]], ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]):  # streamed, not
        assert cli.main(["generate", "--config", str(config_file), *prompts, *args]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith(f"[stats] drafter {ran}: tau ")
