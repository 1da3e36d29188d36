"""The `draftsman compare` config (bench.yaml): defaults, validation, path resolution.

Unknown keys are rejected with the valid ones listed. Relative model and prompt paths in a config
file are relative to that file (as in run configs); `out` is relative to the current directory.
"""
from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..config import DEFAULTS as RUN_DEFAULTS, check_type, read_yaml
from ..models import resolve_device
from ..verifier.sampling import SamplingParams, TypicalAcceptance
from .prompts_set import BUNDLED_PROMPTS

DEFAULTS: dict[str, Any] = {
    "target": None,  # the run config's target section; None = the bundled zoo target
    "drafters": None,  # list of drafter dicts ({name, label?, options...}); None = default_drafters()
    #                    with the zoo target, else none + ngram
    "prompts": None,  # JSONL prompt file; None = the bundled set (draftsman/bench/data/prompts.jsonl)
    "categories": None,  # categories to run; None = every category in the prompt file
    "prompts_per_category": None,  # first N prompts of each category; None = all
    "temperatures": [0, 1],
    "sampling": None,  # every cell's other sampling settings: the run config's `sampling` keys but
    #                    temperature (top_k, top_p, min_p, repetition / presence / frequency penalty)
    "batch_sizes": [1, 2, 4, 8, 16],
    "batch_category": None,  # rows of the batch sweep: one category, or None = mixed (round-robin)
    "max_new_tokens": 64,
    "min_new_tokens": 0,  # EOS cannot end a row before this many new tokens; = max_new_tokens times
    #                       fixed-length runs (Spec-Bench style), the peers included
    "repeats": 3,  # timed passes over the prompts; medians are taken over them
    "sweep_drafters": None,  # labels of the drafters the batch sweep runs (and `none`); None = all
    "sweep_repeats": None,  # timed pairs per batch-sweep cell; None = repeats (one batch is one
    #                         call of a few seconds, so a cell's median needs more of them)
    "seed": 0,
    "peers": True,  # also time Hugging Face generate (plain, assisted, prompt lookup) at T=0
    "out": "results/compare",  # output folder, relative to the current directory
}

# --quick: a smoke run, to see a config work end to end, not to read speedups from. Every drafter
# still loads and runs each category at each temperature, beside the peers, so it takes minutes on a
# CPU, not seconds: on the bundled target, `--drafters ngram` alone took 3 minutes of CPU time, and
# the default set adds every bundled drafter's turn.
QUICK = {"prompts_per_category": 2, "max_new_tokens": 16, "repeats": 1, "sweep_repeats": 1, "batch_sizes": [1, 2]}


# Drafters whose checkpoint is bundled in zoo/: (drafter name, zoo folder, options). Each joins
# the default comparison and `make demo` once its folder exists and its drafter is registered.
# Heads and the draft model draft among the 1024 tokens the target picks most (100% of its greedy
# picks on training text); Medusa verifies an 8-node tree (on a CPU a 16-node pass costs more than
# it gains). EAGLE-3 and MTP draft with int8 weights on a CPU, else in bfloat16 where native; the
# draft model with int8 weights on a CPU, else in the target's dtype.
BUNDLED_DRAFTERS = [("draft_model", "python-draft", {"k": 4, "draft_vocab": 1024, "quantize": "auto"}),
                    ("medusa", "python-medusa", {"draft_vocab": 1024, "tree_budget": 8}),
                    ("eagle", "python-eagle", {"draft_vocab": 1024, "dtype": "auto"}),
                    # its own draft vocabulary
                    ("eagle", "python-eagle3", {"label": "eagle3", "quantize": "auto", "dtype": "auto"}),
                    ("mtp", "python-mtp", {"draft_vocab": 1024, "quantize": "auto", "dtype": "auto"}),
                    ("mlp_speculator", "python-mlp-speculator", {"draft_vocab": 1024})]
# Where its levels are int8 (cheaper), the EAGLE-3 tree pays one level deeper; its sampled chains
# stay 5 long (docs/benchmarks.md, session 16). Where each node widens a compute-bound target pass,
# nodes with path confidence below 0.05 cost more than they bring (session 19).
INT8_EAGLE3_TREE = {"depth": 6, "total_tokens": 20, "sampled_depth": 5, "min_confidence": 0.05}


def default_drafters(device: str | torch.device = "auto") -> list[dict]:
    """`none`, the drafters that need no checkpoint (`ngram`, `recycling`), and every drafter whose
    checkpoint is bundled in zoo/, as set up for a target on `device`."""
    from .. import zoo
    from ..drafters import registry
    from ..drafters.int8_linear import int8_runs_on

    int8 = int8_runs_on(resolve_device(device))
    out = [{"name": "none"}, {"name": "ngram"}, {"name": "recycling"}]
    for name, folder, options in BUNDLED_DRAFTERS:
        path = zoo.zoo_dir() / folder
        if name in registry.available() and (path / "config.json").is_file():
            tree = INT8_EAGLE3_TREE if int8 and options.get("label") == "eagle3" else {}
            out.append({"name": name, "path": str(path), **options, **tree})
    return out


def default_target() -> dict:
    from .. import zoo

    return {"path": str(zoo.target_path())}


def load_bench_config(path: str | os.PathLike | None = None, overrides: dict | None = None,
                      quick: bool = False) -> dict:
    """The complete, validated compare config from a YAML file (or the defaults), then overrides
    (command-line flags; None values are ignored). quick: the QUICK overrides are among them, and
    a file's min_new_tokens is capped at their max_new_tokens (a fixed-length config stays fixed
    length, at the smoke run's length)."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"compare config '{p}' does not exist")
        raw = read_yaml(p, "compare config") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"compare config '{p}' must be a mapping of keys {sorted(DEFAULTS)}")
        _check_keys(raw)
        _resolve_paths(raw, p.parent)
    for key, value in (overrides or {}).items():
        if value is not None:
            if key == "target" and isinstance(raw.get("target"), dict):
                value = {**raw["target"], **value}  # --target: another folder, the file's dtype and device
            raw[key] = value
    _check_keys(raw)
    cfg = copy.deepcopy(DEFAULTS)
    cfg.update(raw)
    if cfg["target"] is None:
        cfg["target"] = default_target()
    if cfg["drafters"] is None:
        # The bundled draft model only fits the bundled target's tokenizer.
        cfg["drafters"] = (default_drafters(cfg["target"].get("device", "auto")) if raw.get("target") is None
                           else [{"name": "none"}, {"name": "ngram"}])
    if cfg["prompts"] is None:
        cfg["prompts"] = str(BUNDLED_PROMPTS)
    overridden = overrides or {}
    if overridden.get("drafters") is not None and overridden.get("sweep_drafters") is None:
        cfg["sweep_drafters"] = _swept_among(cfg["sweep_drafters"], cfg["drafters"])
    low, high = cfg["min_new_tokens"], cfg["max_new_tokens"]
    if quick and "min_new_tokens" not in (overrides or {}) and type(low) is int and type(high) is int:
        cfg["min_new_tokens"] = min(low, high)
    _validate(cfg)
    if cfg["sweep_repeats"] is None:
        cfg["sweep_repeats"] = cfg["repeats"]
    return cfg


def _swept_among(swept, drafters):
    """The file's sweep_drafters when --drafters replaced its drafters: the labels among the given
    drafters, or None (sweep them all) where none is; a label the file's list alone had is no error.
    Anything malformed is left for _validate to name."""
    if not isinstance(swept, list) or not all(isinstance(d, dict) and "name" in d for d in drafters):
        return swept
    given = {drafter_label(d) for d in drafters}
    kept = [label for label in swept if label in given]
    return kept or None


def _check_keys(raw: dict) -> None:
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown compare config key(s) {unknown}; valid keys: {sorted(DEFAULTS)}")


def _resolve_paths(raw: dict, base: Path) -> None:
    def fix(value):
        if isinstance(value, str) and not os.path.isabs(os.path.expanduser(value)):
            return os.path.normpath(base / value)
        return value

    if isinstance(raw.get("target"), dict) and "path" in raw["target"]:
        raw["target"]["path"] = fix(raw["target"]["path"])
    if isinstance(raw.get("prompts"), str):
        raw["prompts"] = fix(raw["prompts"])

    def walk(d):  # drafter paths, nested ones (a cascade's children) included
        if isinstance(d, dict):
            for k, v in d.items():
                d[k] = fix(v) if k == "path" else walk(v)
        elif isinstance(d, list):
            return [walk(x) for x in d]
        return d

    if isinstance(raw.get("drafters"), list):
        walk(raw["drafters"])


def _validate(cfg: dict) -> None:
    t = cfg["target"]
    if not isinstance(t, dict) or not t.get("path"):
        raise ValueError("target must be a mapping with a path, e.g. target: {path: zoo/python-target}")
    bad = sorted(set(t) - set(RUN_DEFAULTS["target"]))
    if bad:
        raise ValueError(f"unknown key(s) {[f'target.{k}' for k in bad]}; valid keys in 'target': "
                         f"{sorted(RUN_DEFAULTS['target'])}")
    for key, value in t.items():
        check_type(f"target.{key}", value, RUN_DEFAULTS["target"][key])

    drafters = cfg["drafters"]
    if not isinstance(drafters, list) or not drafters or not all(isinstance(d, dict) for d in drafters):
        raise ValueError("drafters must be a non-empty list of drafter mappings, e.g. "
                         "[{name: none}, {name: ngram, k: 4}]")
    from ..drafters import registry

    for i, d in enumerate(drafters):
        if "name" not in d:
            raise ValueError(f"drafter {d} has no name; e.g. {{name: ngram, k: 4}}")
        try:  # its name, options and folder named here, before the target loads
            registry.check_drafter_config(drafter_options(d))
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"drafters[{i}]: {e}") from None
        try:  # this drafter's rows verified by typical acceptance, beside the exact ones
            TypicalAcceptance.parse(d.get("lossy_typical_acceptance"))
        except ValueError as e:
            raise ValueError(f"drafters[{i}] ({d['name']}): {e}") from None
    for i, d in enumerate(drafters):  # (its rows would be the baseline's, which compare adds as `none`)
        if d["name"] != "none" and drafter_label(d) == "none":
            raise ValueError(f"drafters[{i}] ({d['name']}): the label 'none' belongs to the baseline, the drafter "
                             f"`none` (added when not listed); choose another `label`, or leave it out to use the name")
    if not any(d["name"] == "none" for d in drafters):
        drafters.insert(0, {"name": "none"})  # the baseline every speedup is measured against
    labels = [drafter_label(d) for d in drafters]  # the baseline's among them
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"drafter label(s) {dupes} appear twice; give each drafter a unique `label`")
    taken = sorted(x for x in labels if x.startswith("hf_"))
    if taken:
        raise ValueError(f"drafter label(s) {taken}: names starting with hf_ belong to the Hugging Face peers; "
                         "choose another `label`")

    swept = cfg["sweep_drafters"]
    if swept is not None:
        if not isinstance(swept, list) or not all(isinstance(x, str) for x in swept):
            raise ValueError(f"sweep_drafters must be a list of drafter labels or null (= all), got {swept!r}")
        unknown = sorted(set(swept) - set(labels) - {"none"})
        if unknown:
            raise ValueError(f"sweep_drafters names {unknown}, not among the drafters' labels {labels}")

    for key in ("temperatures", "batch_sizes"):
        v = cfg[key]
        if not isinstance(v, list) or not v or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                        for x in v):
            raise ValueError(f"{key} must be a non-empty list of numbers, got {v!r}")
        twice = sorted({x for x in v if v.count(x) > 1})
        if twice:  # (each ran again, its rows and table cells written twice under one key)
            raise ValueError(f"{key} {v} lists {twice} more than once: give each value once")
    if any(not math.isfinite(t) or t < 0 for t in cfg["temperatures"]):  # (nan failed after the target loaded)
        raise ValueError(f"temperatures must be finite numbers >= 0 (0 = greedy), got {cfg['temperatures']}")
    _validate_sampling(cfg["sampling"])
    if any(not isinstance(b, int) or b < 1 for b in cfg["batch_sizes"]):
        raise ValueError(f"batch_sizes must be integers >= 1, got {cfg['batch_sizes']}")
    for key in ("max_new_tokens", "repeats"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    m = cfg["min_new_tokens"]
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= cfg["max_new_tokens"]:
        raise ValueError(f"min_new_tokens must be an integer in [0, max_new_tokens = {cfg['max_new_tokens']}], "
                         f"got {m!r}: lower it or raise max_new_tokens")
    r = cfg["sweep_repeats"]
    if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
        raise ValueError(f"sweep_repeats must be an integer >= 1 or null (= repeats), got {r!r}")
    n = cfg["prompts_per_category"]
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"prompts_per_category must be an integer >= 1 or null, got {n!r}")
    cats = cfg["categories"]
    if cats is not None and (not isinstance(cats, list) or not all(isinstance(c, str) for c in cats) or not cats):
        raise ValueError(f"categories must be a list of names or null, got {cats!r}")
    if not isinstance(cfg["peers"], bool):
        raise ValueError(f"peers must be true or false, got {cfg['peers']!r}")
    if not isinstance(cfg["seed"], int) or isinstance(cfg["seed"], bool):
        raise ValueError(f"seed must be an integer, got {cfg['seed']!r}")


def _validate_sampling(sampling) -> None:
    if sampling is None:
        return
    valid = sorted(set(RUN_DEFAULTS["sampling"]) - {"temperature"})
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling must be a mapping of {valid} or null, got {sampling!r}")
    bad = sorted(set(sampling) - set(valid))
    if bad:
        raise ValueError(f"unknown key(s) {[f'sampling.{k}' for k in bad]}; valid keys in 'sampling': {valid} "
                         "(temperatures are the `temperatures` list)")
    for key, value in sampling.items():
        check_type(f"sampling.{key}", value, RUN_DEFAULTS["sampling"][key])
    SamplingParams(1.0, **sampling)  # ranges (top_p in (0, 1], penalties, ...)


def changes_greedy_output(sampling: dict | None) -> bool:
    """Penalties, a logit bias and the bans change what greedy decoding emits (top-k / top-p /
    min-p / the truncation warpers never do)."""
    return SamplingParams(0.0, **(sampling or {})).changes_logits


# Keys of a compare drafter entry that are not the drafter's own options.
BENCH_ONLY_KEYS = ("label", "lossy_typical_acceptance")


def drafter_label(d: dict) -> str:
    """`label` or the name; a drafter verified by LOSSY typical acceptance says so in its label."""
    label = str(d.get("label") or d["name"])
    return label if not is_lossy(d) or "LOSSY" in label else f"{label} (LOSSY)"


def is_lossy(settings: dict) -> bool:
    """A drafter entry or a sampling section that turns LOSSY typical acceptance on."""
    return settings.get("lossy_typical_acceptance") not in (None, False)


def drafter_options(d: dict) -> dict:
    """The drafter config without the bench-only keys."""
    return {k: v for k, v in d.items() if k not in BENCH_ONLY_KEYS}
