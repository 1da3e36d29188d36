"""The run configuration: every default in one place, unknown keys rejected with the valid ones.

    target:   {path: DIR, dtype: float32, device: auto,   # auto = cuda if available else cpu
               attn_implementation: null, recurrent_branches: 2}
    drafter:  {name: none, ...}                           # the drafter's own options (see its Options)
    sampling: {temperature: 0.0, top_k: null, top_p: null, top_h: null, min_p: null, typical_p: null,
               epsilon_cutoff: null, eta_cutoff: null, repetition_penalty: null, no_repeat_ngram_size: null,
               bad_words_ids: null,
               presence_penalty: null, frequency_penalty: null, logit_bias: null, structured_output: null,
               lossy_typical_acceptance: null}                  # LOSSY when set (verifier/typical.py)
    generation: {max_new_tokens: 64, min_new_tokens: 0, seed: 0, stop: null, stop_token_ids: null, ignore_eos: false}
"""
from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from .stop import check_stop_strings

DEFAULTS: dict[str, dict[str, Any]] = {
    "target": {
        "path": None,  # local Hugging Face model folder (required)
        "dtype": "float32",  # float32 | bfloat16 | float16 | float64 | auto (bfloat16 where native); verification math is float32+ anyway
        "device": "auto",  # auto | cpu | cuda | cuda:N
        "attn_implementation": None,  # None = the model's default (sdpa where available)
        # A target with recurrent layers (Qwen3-Next, Nemotron-H, Mamba, ...) reads a draft tree as its
        # branches, a row each (verifier/branches.py): this many per pass, shared by the batch's rows
        # (each reads max(1, N // rows)); 1 = every row its first chain only
        "recurrent_branches": 2,
    },
    "drafter": {
        "name": "none",  # none | ngram | draft_model | ...; other keys are the drafter's own options
    },
    "sampling": {
        "temperature": 0.0,  # 0 = greedy
        "top_k": None,
        "top_p": None,
        "top_h": None,  # Hugging Face's top-H (transformers 5), in (0, 1]; before top-k, after temperature
        "min_p": None,  # keep tokens with at least min_p x the top token's probability (after top-k / top-p)
        # Hugging Face's truncation warpers, after min_p (exact: they shape the target's distribution)
        "typical_p": None,  # locally typical sampling, e.g. 0.95 (1 or null = off)
        "epsilon_cutoff": None,  # drop tokens below this probability, e.g. 3e-4 (0 or null = off)
        "eta_cutoff": None,  # drop tokens below min(eta, sqrt(eta) exp(-entropy)), e.g. 1e-3
        "repetition_penalty": None,  # Hugging Face's (1.2 is common; 1 or null = none), before the rest
        "no_repeat_ngram_size": None,  # Hugging Face's: no n-gram of this size twice in a sequence (0 or null = off)
        "bad_words_ids": None,  # Hugging Face's: token sequences never generated, e.g. [[50256], [1, 2]]
        "presence_penalty": None,  # vLLM / OpenAI's, in [-2, 2]: minus this for each token generated before
        "frequency_penalty": None,  # vLLM / OpenAI's, in [-2, 2]: minus this x how often it was generated
        "logit_bias": None,  # OpenAI's: {token id: bias in [-100, 100]}, added to the target's logits first
        # vLLM's structured_outputs: the output held to a grammar, one of {json: SCHEMA}, {json_object: true},
        # {regex: "..."}, {choice: [...]}, {grammar: LARK} (verifier/structured.py; needs llguidance)
        "structured_output": None,
        # LOSSY when set: Medusa's typical acceptance at T > 0 (true = its defaults, or {posterior_threshold,
        # posterior_alpha}); the output is then NOT the target's distribution (verifier/typical.py)
        "lossy_typical_acceptance": None,
    },
    "generation": {
        "max_new_tokens": 64,
        "min_new_tokens": 0,  # EOS cannot end a row before this many new tokens (HF's min_new_tokens)
        "seed": 0,
        "stop": None,  # strings that end a row when generated, e.g. ["\n\n"] (the text ends before them)
        "stop_token_ids": None,  # token ids that end a row as EOS does, e.g. a chat template's end-of-turn
        "ignore_eos": False,  # vLLM's: EOS ends no row (it is sampled as any token); rows run to max_new_tokens
    },
}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, with floats read as YAML 1.2 (and JSON) read them: PyYAML reads YAML
    1.1, where an exponent without a point (1e-3, --set lr=5e-4) is text, which no setting wants.
    A key written twice in one mapping is refused: PyYAML keeps the last, so `generation:` written
    twice would drop the first section's settings without a word."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # keys a merge (<<: *anchor) brings may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                break  # PyYAML's own check below names an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is written twice in one mapping (the first value would be "
                    "dropped); write it once", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))



def parse_yaml(text: str) -> Any:
    """What every config file, --set value and YAML flag is read with."""
    return yaml.load(text, Loader=_Loader)


def parse_override(value: str, item: str) -> Any:
    """An override's value (--set KEY=VALUE), parsed as YAML; a parse error names the override."""
    try:
        return parse_yaml(value)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"--set {item!r}: the value {value!r} is not valid YAML ({problem}); quote a text value, "
                         f"e.g. KEY='{value}'") from None


def read_text(path: str | os.PathLike, what: str) -> str:
    """A file's text, as UTF-8 (as YAML and JSON are). One that cannot be read is named with `what`
    and the fix, which the OSError's or the codec's own words ("'utf-8' codec can't decode byte
    0xe9") do not; a missing one raises FileNotFoundError, for the caller to word."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise ValueError(f"{what} '{path}' is a folder: give the file in it") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} '{path}' is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") \
            from None
    except OSError as e:  # permission denied, ...
        raise ValueError(f"{what} '{path}' cannot be read ({e.strerror}): check the path and its permissions") \
            from None


def _object_without_repeats(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are each written once (json keeps the last, as PyYAML does)."""
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise ValueError(f"the key {key!r} is written twice in one object (the first value would be dropped); "
                             "write it once")
    return dict(pairs)


def read_yaml(path: str | os.PathLike, what: str = "config file") -> Any:
    """A YAML file's content (JSON is YAML too); a parse error names the file, which the parser's
    own words ("found character '\\t' that cannot start any token", a line and column) do not."""
    path = Path(path)
    text = read_text(path, what)
    try:
        return parse_yaml(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{what} '{path}' is not valid YAML: {e}") from None


def read_json_object(path: str | os.PathLike) -> dict | None:
    """The JSON object a file holds; None where it is missing, unreadable, not JSON or not an object
    (what the checks before a write ask of a config.json or an earlier output)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# The options that name a file or folder: target.path, and the drafters' (a model or heads folder, a
# retrieval datastore; suffix's and recycling's memory_file; draft_vocab's vocab_order).
PATH_KEYS = ("path", "memory_file", "vocab_order")


def _paths_relative_to(values, folder: Path) -> None:
    """The relative paths (PATH_KEYS) of a config section made relative to `folder`: a cascade's
    children hold paths too, and so do the children of a cascade among them (those were left
    relative to the working directory). "~/..." is kept as written: it is absolute once expanded."""
    children = values.get("drafters") if isinstance(values, dict) else None
    for child in children if isinstance(children, list) else []:
        _paths_relative_to(child, folder)
    for key in PATH_KEYS:
        p = values.get(key) if isinstance(values, dict) else None
        if isinstance(p, str) and p and not os.path.isabs(os.path.expanduser(p)):  # "" = unset (retrieval's)
            values[key] = str(folder / p)


def load_config(config: dict | str | os.PathLike) -> dict:
    """A dict, or the path of a YAML / JSON file -> a complete, validated config."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():  # most likely a model folder given where the run config goes
            raise ValueError(f"config '{path}' is a folder, not a YAML or JSON run config file; for a model folder, "
                             f"use --target {path} on the command line or target: {{path: {path}}} in a config")
        if not path.is_file():
            raise FileNotFoundError(f"config file '{path}' does not exist")
        if path.suffix == ".json":
            text = read_text(path, "config file")
            try:
                raw = json.loads(text, object_pairs_hook=_object_without_repeats)
            except ValueError as e:  # the parser's words say where; these say which file
                raise ValueError(f"config file '{path}' is not valid JSON: {e}") from None
        else:
            raw = read_yaml(path)
        raw = {} if raw is None else raw  # an empty file; a list or a scalar is not a config
        if not isinstance(raw, dict):
            raise ValueError(f"config file '{path}' holds a {type(raw).__name__}: a config must be a mapping of "
                             f"sections {sorted(DEFAULTS)}, e.g. target: {{path: MODEL_FOLDER}}")
        # Relative model paths in a config file are relative to that file, so configs travel (and
        # a same-named folder under the working directory cannot capture them).
        for values in (raw.get("target"), raw.get("drafter")):
            _paths_relative_to(values, path.parent)
    elif isinstance(config, dict):
        raw = config
    else:
        raise TypeError(f"config must be a dict or a file path, not {type(config).__name__}")
    return merge(raw)


def merge(raw: dict) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"a config must be a mapping of sections {sorted(DEFAULTS)}, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid top-level keys: {sorted(DEFAULTS)}")
    cfg = copy.deepcopy(DEFAULTS)
    for section, values in raw.items():
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"config section '{section}' must be a mapping, got {values!r}")
        if section != "drafter":  # drafter keys are checked by the drafter's own Options
            bad = sorted(set(values) - set(DEFAULTS[section]))
            if bad:
                raise ValueError(f"unknown key(s) {[f'{section}.{k}' for k in bad]}; valid keys in "
                                 f"'{section}': {sorted(DEFAULTS[section])}")
        if section == "drafter":
            check_drafter_named(values)
        if section == "drafter" and "name" in values and values["name"] != cfg["drafter"]["name"]:
            cfg["drafter"] = {}
        for key, value in values.items():
            if section != "drafter":
                check_type(f"{section}.{key}", value, DEFAULTS[section][key])
            cfg[section][key] = value
    if cfg["target"]["recurrent_branches"] < 1:
        raise ValueError(f"target.recurrent_branches must be 1 or more (1: a tree's first chain only), got "
                         f"{cfg['target']['recurrent_branches']}")
    check_stop_strings(cfg["generation"]["stop"], "generation.stop")
    ids = cfg["generation"]["stop_token_ids"]
    if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"generation.stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
    check_generation_limits(cfg["generation"])
    # Imported here: the CLI reads DEFAULTS to build its flags, before anything needs torch.
    from .verifier.sampling import SamplingParams

    try:  # at load, not at the first call (under `serve`, every request would be refused for it)
        SamplingParams(**cfg["sampling"])
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from None
    return cfg


def check_drafter_named(values: dict) -> None:
    """Drafter options come with the drafter's name: without it they were read as the default drafter
    none's, "unknown option(s) ['k'] for drafter 'none'"."""
    if "name" not in values and set(values) - {"adaptive"}:  # (none's one option)
        raise ValueError(f"the drafter section has options {sorted(values)} but no name: set drafter.name to the "
                         "drafter they belong to (e.g. ngram; `draftsman drafters` lists them), or leave the "
                         "section out for plain decoding")


def check_generation_limits(generation: dict) -> None:
    most, least = generation["max_new_tokens"], generation["min_new_tokens"]
    if most < 1:
        raise ValueError(f"generation.max_new_tokens must be >= 1, got {most}")
    if not 0 <= least <= most:
        raise ValueError(f"generation.min_new_tokens must be in [0, max_new_tokens = {most}], got {least}")


# Keys whose default is None still have a type: the default says nothing, so list them here.
_TYPES_WHEN_UNSET = {"target.path": str, "target.attn_implementation": str, "sampling.top_k": int,
                     "sampling.top_p": float, "sampling.top_h": float, "sampling.min_p": float,
                     "sampling.typical_p": float,
                     "sampling.epsilon_cutoff": float, "sampling.eta_cutoff": float,
                     "sampling.repetition_penalty": float, "sampling.no_repeat_ngram_size": int,
                     "sampling.bad_words_ids": list,
                     "sampling.presence_penalty": float, "sampling.frequency_penalty": float,
                     "sampling.logit_bias": dict, "sampling.structured_output": dict,
                     "generation.stop": list, "generation.stop_token_ids": list}


def check_type(name: str, value: Any, default: Any) -> None:
    """A value must have its default's type (ints pass for floats); None is allowed where the
    default is None."""
    expected = type(default) if default is not None else _TYPES_WHEN_UNSET.get(name)
    if value is None:
        if default is None:
            return
        raise ValueError(f"{name} cannot be null; its default is {default!r}")
    if expected is None:
        return
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if expected is str and isinstance(value, os.PathLike):
        ok = True
    if not ok:
        raise ValueError(f"{name} must be {expected.__name__}, got {value!r} ({type(value).__name__})")


def apply_overrides(cfg: dict, overrides: list[str]) -> dict:
    """`section.key=value` strings (value parsed as YAML) -> a new validated config."""
    raw = copy.deepcopy(cfg)
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"override '{item}' must look like section.key=value, e.g. drafter.k=6")
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".", 1)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ValueError(f"override '{item}': '{section}' is not a config section")
        parsed = parse_override(value, item)
        if section == "drafter" and key == "name" and parsed != raw["drafter"].get("name"):
            raw["drafter"] = {}  # the old drafter's options mean nothing to the new one
        raw[section][key] = parsed
    return merge(raw)


def dump(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=False)
