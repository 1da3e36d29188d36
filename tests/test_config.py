"""Config files, overrides and the CLI's --drafter semantics. No models are loaded here."""
import json

import pytest
import yaml

from draftsman.cli import build_config
from draftsman.config import DEFAULTS, apply_overrides, load_config

RUN = {
    "target": {"path": "models/target", "dtype": "float32"},
    "drafter": {"name": "draft_model", "path": "models/draft", "k": 3},
    "sampling": {"temperature": 0.7, "top_k": 20},
    "generation": {"max_new_tokens": 16},
}


@pytest.fixture
def config_dir(tmp_path):
    """A folder holding configs next to the model folders they name."""
    (tmp_path / "models" / "target").mkdir(parents=True)
    (tmp_path / "models" / "draft").mkdir()
    return tmp_path


@pytest.mark.parametrize("suffix, dump", [(".yaml", yaml.safe_dump), (".yml", yaml.safe_dump),
                                          (".json", json.dumps)])
def test_config_files_load_with_defaults_filled_in(config_dir, suffix, dump):
    path = config_dir / f"run{suffix}"
    path.write_text(dump(RUN))
    cfg = load_config(path)
    assert cfg["drafter"] == {"name": "draft_model", "path": str(config_dir / "models" / "draft"), "k": 3}
    assert cfg["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": None, "min_p": None,
                               "repetition_penalty": None,
                               "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
                               "lossy_typical_acceptance": None, "typical_p": None, "epsilon_cutoff": None,
                               "eta_cutoff": None, "no_repeat_ngram_size": None, "bad_words_ids": None,
                               "top_h": None, "structured_output": None}
    assert cfg["generation"] == {"max_new_tokens": 16, "min_new_tokens": 0, "seed": DEFAULTS["generation"]["seed"],
                                 "stop": None, "stop_token_ids": None, "ignore_eos": False}
    assert cfg["target"]["device"] == "auto"
    assert load_config(str(path)) == cfg  # a str path works as well as a Path


def test_relative_paths_resolve_relative_to_the_config_file(config_dir, tmp_path_factory, monkeypatch):
    path = config_dir / "run.yaml"
    path.write_text(yaml.safe_dump(RUN))
    elsewhere = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert cfg["target"]["path"] == str(config_dir / "models" / "target")
    assert cfg["drafter"]["path"] == str(config_dir / "models" / "draft")
    # A folder of the same name under the working directory must not capture the path: the
    # config means the same models wherever it is used from.
    (elsewhere / "models" / "target").mkdir(parents=True)
    assert load_config(path)["target"]["path"] == str(config_dir / "models" / "target")


def test_absolute_paths_and_dict_configs_are_kept_as_written(config_dir):
    absolute = str(config_dir / "models" / "target")
    path = config_dir / "abs.yaml"
    path.write_text(yaml.safe_dump({"target": {"path": absolute}}))
    assert load_config(path)["target"]["path"] == absolute
    # A dict has no file to be relative to: its paths are the caller's (working directory).
    assert load_config({"target": {"path": "models/target"}})["target"]["path"] == "models/target"


def test_empty_config_file_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == DEFAULTS


def test_missing_config_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")



def test_a_file_that_does_not_parse_is_named(tmp_path, capsys):
    """The parser's error alone (a yaml ScannerError, "Expecting value: line 1 column 12") named no file."""
    for name, text, kind in (("tabs.yaml", "target:\n\tpath: x\n", "YAML"), ("cut.json", '{"target": ', "JSON")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"(?s)config file '.*{name}' is not valid {kind}: .*line"):
            load_config(tmp_path / name)
    # the other commands' configs, through the command line
    from draftsman import cli

    tabs = str(tmp_path / "tabs.yaml")
    for argv, what in ((["train", "medusa", "--config", tabs], "training config"),
                       (["train", "pard", "--config", tabs], "training config"),
                       (["compare", "--config", tabs], "compare config")):
        assert cli.main(argv) == 2
        assert f"error: {what} '{tabs}' is not valid YAML" in capsys.readouterr().err
    (tmp_path / "list.yaml").write_text("- kind: medusa\n")  # a list: failed as "list indices must be integers"
    assert cli.main(["train", "medusa", "--config", str(tmp_path / "list.yaml"), "--set", "max_steps=1"]) == 2
    assert "must be a mapping of keys to values, got list" in capsys.readouterr().err


def test_a_number_pyyaml_reads_as_text_is_the_number_where_a_float_is_due(tmp_path):
    """PyYAML reads YAML 1.1, where 1e-3 (no point) is a string: `min_p: 1e-3` was refused as "must
    be float", and a drafter's float option with it failed as well."""
    path = tmp_path / "run.yaml"
    path.write_text("sampling: {min_p: 1e-3, top_p: 9.5E-1}\ndrafter: {name: suffix, min_token_prob: 2e-2}\n")
    cfg = load_config(path)
    assert (cfg["sampling"]["min_p"], cfg["sampling"]["top_p"]) == (0.001, 0.95)
    assert apply_overrides(cfg, ["sampling.min_p=5e-2"])["sampling"]["min_p"] == 0.05
    from draftsman.drafters.registry import _REGISTRY, drafter_options
    options = {k: v for k, v in cfg["drafter"].items() if k != "name"}
    assert drafter_options(_REGISTRY["suffix"], options).min_token_prob == 0.02
    with pytest.raises(ValueError, match=r"sampling.min_p must be float, got 'abc' \(str\)"):
        load_config({"sampling": {"min_p": "abc"}})
    path.write_text("generation: {seed: 1e3}\n")  # a float now, and an int key refuses it
    with pytest.raises(ValueError, match=r"generation.seed must be int, got 1000.0"):
        load_config(path)
    path.write_text("sampling: {min_p: '1e-3'}\n")  # quoted, it is text, as YAML means
    with pytest.raises(ValueError, match=r"sampling.min_p must be float, got '1e-3' \(str\)"):
        load_config(path)



@pytest.mark.parametrize("name, text", [
    ("run.yaml", "target: {path: models/target}\ngeneration: {max_new_tokens: 8}\ngeneration: {seed: 3}\n"),
    ("run.yaml", "generation: {max_new_tokens: 8, max_new_tokens: 9}\n"),
    ("run.json", '{"generation": {"max_new_tokens": 8}, "generation": {"seed": 3}}'),
])
def test_a_key_written_twice_is_refused_not_dropped(config_dir, name, text):
    """PyYAML and json keep a repeated key's last value: the first section's max_new_tokens: 8 was
    silently lost (the run took 64)."""
    path = config_dir / name
    path.write_text(text)
    with pytest.raises(ValueError, match=r"the key '(generation|max_new_tokens)' is written twice .* write it once"):
        load_config(path)


def test_a_merge_key_may_still_be_overridden(config_dir):
    path = config_dir / "run.yaml"
    path.write_text("sampling:\n  <<: {temperature: 0.5, top_k: 5}\n  top_k: 7\n")
    sampling = load_config(path)["sampling"]
    assert (sampling["temperature"], sampling["top_k"]) == (0.5, 7)


@pytest.mark.parametrize("text, kind", [("[]\n", "list"), ("false\n", "bool"), ("0\n", "int")])
def test_a_config_file_that_is_not_a_mapping_is_named(config_dir, text, kind):
    """An empty list, false or 0 was read as an empty config, and the run went on with defaults."""
    path = config_dir / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"config file '.*run.yaml' holds a {kind}: a config must be a mapping of sections"):
        load_config(path)
    path.write_text("# nothing yet\n")  # an empty file is an empty config
    assert load_config(path) == load_config({})

def test_drafter_options_without_a_name_are_named():
    """{drafter: {k: 3}} was read as the default drafter none's, "unknown option(s) ['k'] for drafter 'none'"."""
    with pytest.raises(ValueError, match=r"the drafter section has options \['k'\] but no name: set drafter.name"):
        load_config({"drafter": {"k": 3}})
    assert load_config({"drafter": {"adaptive": False}})["drafter"] == {"name": "none", "adaptive": False}

def test_overrides_parse_values_as_yaml():
    cfg = apply_overrides(load_config({"drafter": {"name": "ngram"}, "sampling": {"top_k": 50}}),
                          ["drafter.k=6", "sampling.top_p=0.9", "sampling.top_k=null", "sampling.min_p=0.05",
                           "sampling.temperature=1", "target.path=some/dir", "target.dtype=bfloat16"])
    assert cfg["drafter"] == {"name": "ngram", "k": 6}
    assert isinstance(cfg["drafter"]["k"], int)
    assert cfg["sampling"] == {"temperature": 1, "top_k": None, "top_p": 0.9, "min_p": 0.05,
                               "repetition_penalty": None,
                               "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
                               "lossy_typical_acceptance": None, "typical_p": None, "epsilon_cutoff": None,
                               "eta_cutoff": None, "no_repeat_ngram_size": None, "bad_words_ids": None,
                               "top_h": None, "structured_output": None}
    assert cfg["target"]["path"] == "some/dir" and cfg["target"]["dtype"] == "bfloat16"


def test_overrides_do_not_change_their_input():
    base = load_config({})
    apply_overrides(base, ["generation.seed=7"])
    assert base["generation"]["seed"] == 0


@pytest.mark.parametrize("item, message", [
    ("drafter.k", "must look like section.key=value"),
    ("k=6", "must look like section.key=value"),
    ("sampling.temprature=0.5", r"unknown key\(s\) \['sampling.temprature'\].*'temperature'"),
    ("decoding.k=6", r"unknown config key\(s\) \['decoding'\].*valid top-level keys"),
    ("sampling.stop=[a,", r"--set 'sampling.stop=\[a,': the value '\[a,' is not valid YAML \(.*quote a text value"),
])
def test_bad_overrides_say_what_is_wrong(item, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(load_config({}), [item])


def _write(tmp_path, raw) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_drafter_flag_replaces_the_options_of_another_drafter(config_dir):
    cfg = build_config(_write(config_dir, RUN), "ngram", [])
    assert cfg["drafter"] == {"name": "ngram"}  # draft_model's path and k are gone
    cfg = build_config(_write(config_dir, RUN), "ngram", ["drafter.k=6", "drafter.branches=2"])
    assert cfg["drafter"] == {"name": "ngram", "k": 6, "branches": 2}
    # Everything outside the drafter section stays as the file says.
    assert cfg["sampling"]["top_k"] == 20 and cfg["generation"]["max_new_tokens"] == 16


def test_drafter_flag_naming_the_configs_drafter_keeps_its_options(config_dir):
    cfg = build_config(_write(config_dir, RUN), "draft_model", ["drafter.k=5"])
    assert cfg["drafter"] == {"name": "draft_model", "path": str(config_dir / "models" / "draft"), "k": 5}


def test_build_config_without_a_file_starts_from_the_defaults():
    cfg = build_config(None, "ngram", ["target.path=/models/t"])
    assert cfg["drafter"] == {"name": "ngram"}
    assert cfg["target"]["path"] == "/models/t"
    assert build_config(None, None, []) == DEFAULTS


def test_target_flag_sets_the_folder_as_typed_over_the_config_and_set(config_dir):
    """--target: a folder named like a YAML value stays a string (--set target.path=yes would read a bool)."""
    cfg = build_config(_write(config_dir, RUN), None, ["target.path=/elsewhere"], target="yes")
    assert cfg["target"]["path"] == "yes" and cfg["drafter"]["name"] == "draft_model"
    assert build_config(None, None, [], target="1.0")["target"]["path"] == "1.0"


def test_drafter_file_options_resolve_relative_to_the_config_file(config_dir, tmp_path_factory, monkeypatch):
    """memory_file and vocab_order were left relative to the working directory (only `path` was not):
    a suffix drafter's memory was written wherever the command ran."""
    path = config_dir / "sub" / "run.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"drafter": {"name": "cascade", "drafters": [
        {"name": "suffix", "memory_file": "mem.safetensors"},
        {"name": "layer_skip", "vocab_order": "../order.json"},
        {"name": "recycling", "memory_file": "~/recycling.safetensors"}]}}))
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    suffix, layer_skip, recycling = load_config(path)["drafter"]["drafters"]
    assert suffix["memory_file"] == str(path.parent / "mem.safetensors")
    assert layer_skip["vocab_order"] == str(path.parent / "../order.json")
    assert recycling["memory_file"] == "~/recycling.safetensors"  # as `path`: absolute once expanded


def test_every_drafter_option_naming_a_file_is_resolved_as_a_path():
    """An option added later that holds a file or folder must join PATH_KEYS, or it would resolve
    against the working directory again."""
    import re

    from draftsman.config import PATH_KEYS
    from draftsman.drafter_catalog import read_drafter_sources

    named = {o["name"] for d in read_drafter_sources() for o in d["options"]
             if o["type"].startswith("str") and (o["name"] == "path" or o["name"].endswith(("_file", "_order"))
                                                 or re.search(r"\b(file|folder)\b", o["help"]))}
    assert named and named <= set(PATH_KEYS), sorted(named - set(PATH_KEYS))


@pytest.mark.parametrize("name", ["latin1.yaml", "latin1.json"])
def test_a_config_file_that_is_not_utf8_is_named(tmp_path, name):
    """The codec's words alone ("'utf-8' codec can't decode byte 0xe9") named no file."""
    path = tmp_path / name
    path.write_bytes('{"target": {"path": "café"}}'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"config file '.*{name}' is not UTF-8 text .*: save it as UTF-8"):
        load_config(path)
