"""What a heads training run is told: the kinds, every config key with its default, the checks on a
config, and `draftsman train`'s flags (train pard's too). Kept apart from the trainers
(training/heads.py and pard.py, which import torch and transformers) so `draftsman train --help`,
`draftsman vocab --help` and a mistyped flag answer at once; training/heads.py imports these
names back."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ..config import parse_override, read_yaml

KINDS = ("medusa", "eagle", "eagle3", "mtp", "mlp_speculator")

# How each optimizer step is taken; shared by every trainer (training/pard.py too).
STEP_DEFAULTS = {
    "grad_accum_steps": 1,  # micro-batches of batch_size per optimizer step (effective batch: their product)
    "grad_clip": None,  # clip the gradient's total norm to this before each step (EAGLE's recipe: 0.5; None = off)
}
# Keys added after checkpoints were written without them, with the value those runs had.
LATER_KEYS = {**STEP_DEFAULTS, "target_dtype": "float32", "eval_every": 0}

DEFAULTS = {
    "kind": "medusa",  # medusa | eagle | eagle3 | mtp | mlp_speculator
    "target": None,  # local HF folder of the frozen target (required)
    "out": None,  # folder for the trained heads (required)
    "work_dir": "zoo/.work",  # token caches and resumable checkpoints
    "seed": 0,
    "threads": 2,  # torch.set_num_threads on CPU
    "mixed_precision": "auto",  # autocast for the frozen target's forward: "no", "bf16", or "auto" (bf16 where native)
    "target_dtype": "float32",  # the frozen target's weights: float32 | bfloat16 | float16 | auto (bf16 where native)
    "labels": "self_distill",  # self_distill (target's greedy predictions) | corpus (next tokens)
    "corpus_root": None,  # None = the stdlib of this interpreter, train split only
    "data_file": None,  # instead of corpus_root: JSONL of chat conversations or texts (training/documents.py)
    "assistant_only_loss": False,  # data_file: learn only where the next token is in an assistant's reply
    "num_heads": 4,  # medusa: heads; mlp_speculator: stages (its n_predict, the deepest draft)
    "num_layers": 1,  # medusa: residual blocks per head
    "share_lm_head": False,  # medusa: read out through the target's frozen LM head instead of copies
    "loss_decay": 0.8,  # medusa / mlp_speculator: head (stage) i's loss weighs loss_decay ** i
    "inner_dim": 0,  # mlp_speculator: width of its state (0 = the target's hidden size)
    "tie_weights": False,  # mlp_speculator: stages 1+ share weights (fewer parameters; drafts any depth)
    "scale_input": True,  # mlp_speculator: RMS-normalise the target's state first (fms-extras' option)
    "feature_noise": 0.1,  # eagle: uniform noise U(-a, a) on the input features
    "ce_weight": 0.1,  # eagle: weight of the token loss next to the feature regression
    "eval_depths": 4,  # eagle / eagle3 / mtp: held-out agreement measured for draft depths 1..eval_depths
    "ttt_steps": 4,  # eagle3: steps of the training-time test (the head fed its own outputs)
    "ttt_decay": 0.8,  # eagle3: step j's loss weighs ttt_decay ** j
    "draft_vocab": None,  # eagle3: rows of its LM head, the tokens the target picks most (None = all)
    "aux_layers": None,  # eagle3: target hidden_states indices fused, low to high (None = EAGLE-3's default)
    "layer": "target",  # eagle / eagle3: the head's layer, of the target's class or "llama" (exports for any target)
    "seq_len": 512,
    "batch_size": 8,
    "lr": 1e-3,
    "warmup_steps": 20,
    "lr_schedule": "constant",  # after warmup: constant | cosine (down to lr * min_lr_ratio at the end)
    "min_lr_ratio": 0.1,  # cosine: the final learning rate as a fraction of lr
    "init_from": None,  # a heads folder of this kind and target to continue from (its shape wins; None = fresh)
    **STEP_DEFAULTS,
    "max_steps": 2000,  # optimizer steps
    "max_minutes": None,  # wall-clock budget; training stops at whichever limit comes first
    "checkpoint_minutes": 3.0,
    "eval_tokens": 32768,  # held-out tokens for the final per-head agreement
    "eval_every": 0,  # optimizer steps between held-out agreement checks during training (0 = at the end only)
    "eval_ranks": 10,  # accuracy is measured for candidate ranks 0..eval_ranks-1 (tree calibration)
    "tree_budget": 16,  # nodes of the calibrated Medusa tree stored with the heads
}


def merged_config(raw, defaults: dict, what: str, required: tuple[str, ...]) -> dict:
    """A training config (a dict, or a YAML file's path) over its defaults; unknown keys (with the
    valid ones) and missing required ones are named, `what` saying which trainer's."""
    if not isinstance(raw, dict):
        raw = read_yaml(raw, f"the {what}") or {}
    unknown = sorted(set(raw) - set(defaults))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the {what}; valid keys: {sorted(defaults)}")
    cfg = {**defaults, **raw}
    for key in required:
        if not cfg[key]:
            raise ValueError(f"{what}: '{key}' is required")
    check_step_keys(cfg, what)
    check_values(cfg, defaults, what)
    work = cfg.get("work_dir")
    if work and Path(work).exists() and not Path(work).is_dir():  # (a bare "[Errno 17] File exists" at the cache)
        raise ValueError(f"{what}: work_dir '{work}' is a file: it is the folder for token caches and checkpoints; "
                         "give a folder's path")
    return cfg


def check_step_keys(cfg: dict, what: str) -> None:
    """grad_accum_steps (a whole number >= 1), grad_clip (None or a norm > 0) and eval_every (a whole
    number >= 0), where a config has them."""
    steps = cfg.get("grad_accum_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{what}: grad_accum_steps must be a whole number >= 1 (micro-batches per optimizer "
                         f"step), got {steps!r}")
    clip = cfg.get("grad_clip")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise ValueError(f"{what}: grad_clip must be a gradient norm > 0 (e.g. 0.5) or null for no clipping, "
                         f"got {clip!r}")
    every = cfg.get("eval_every", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"{what}: eval_every must be a whole number of steps >= 0 (0: evaluate at the end only), "
                         f"got {every!r}")


# Keys whose default is None still have a type: the default says nothing, so they are listed here.
_PATH_KEYS = ("target", "out", "draft", "work_dir", "corpus_root", "data_file", "init_from")
_TYPES_WHEN_UNSET = {"draft_vocab": int, "aux_layers": list, "max_minutes": float, "grad_clip": float}
# Ranges of the numbers (each where a config has the key): whole numbers >= 1 or >= 0, numbers > 0 or >= 0.
_AT_LEAST_1 = ("threads", "num_heads", "num_layers", "eval_depths", "ttt_steps", "seq_len", "batch_size",
               "eval_tokens", "eval_ranks", "tree_budget", "draft_vocab")
_AT_LEAST_0 = ("max_steps", "warmup_steps", "inner_dim", "checkpoint_minutes", "feature_noise", "ce_weight")
_ABOVE_0 = ("lr", "max_minutes", "loss_decay", "ttt_decay")
_MIXED_PRECISION = ("no", "bf16", "auto")


def check_values(cfg: dict, defaults: dict, what: str) -> None:
    """Every value of the type its default has (whole numbers for ints, any number for floats,
    true/false for bools) and in its range: a string lr or a batch_size of 0 failed deep inside
    torch, after the target had loaded and the corpus been read."""
    for key, value in cfg.items():
        if value is None and defaults.get(key) is not None:  # `--set lr=` or `lr:` left empty
            raise ValueError(f"{what}: {key} cannot be null; its default is {defaults[key]!r}")
        if value is None or key in _PATH_KEYS:
            if key in _PATH_KEYS and value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{what}: {key} must be a folder or file path, got {value!r}")
            continue
        default = defaults.get(key)
        expected = type(default) if default is not None else _TYPES_WHEN_UNSET.get(key)
        if expected is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = expected is None or isinstance(value, expected)
        if not ok:
            kind = {float: "a finite number", int: "a whole number", bool: "true or false", str: "a string",
                    list: "a list"}.get(expected, expected.__name__ if expected else "")
            raise ValueError(f"{what}: {key} must be {kind}, got {value!r}")
    for key in _AT_LEAST_1:
        if cfg.get(key) is not None and cfg[key] < 1:
            raise ValueError(f"{what}: {key} must be at least 1, got {cfg[key]!r}")
    for key in _AT_LEAST_0:
        if cfg.get(key) is not None and cfg[key] < 0:
            raise ValueError(f"{what}: {key} must be at least 0, got {cfg[key]!r}")
    for key in _ABOVE_0:
        if cfg.get(key) is not None and not cfg[key] > 0:
            raise ValueError(f"{what}: {key} must be greater than 0, got {cfg[key]!r}")
    if "min_lr_ratio" in cfg and not 0 <= cfg["min_lr_ratio"] <= 1:
        raise ValueError(f"{what}: min_lr_ratio must be in [0, 1] (the final rate as a fraction of lr), "
                         f"got {cfg['min_lr_ratio']!r}")
    if "mixed_precision" in cfg and cfg["mixed_precision"] not in _MIXED_PRECISION:
        raise ValueError(f"{what}: mixed_precision must be one of {list(_MIXED_PRECISION)}, "
                         f"got {cfg['mixed_precision']!r}")


def config_with_overrides(path: str, overrides: list[str]) -> dict:
    """The YAML config at `path` with each `--set KEY=VALUE` applied (VALUE parsed as YAML)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"training config '{path}' does not exist; start from one of training/configs/ "
                                "(medusa.yaml, eagle.yaml, eagle3.yaml, mtp.yaml, mlp_speculator.yaml, pard.yaml)")
    raw = read_yaml(path, "training config") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"training config '{path}' must be a mapping of keys to values, got {type(raw).__name__}")
    for item in overrides:
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"--set {item!r} must look like KEY=VALUE, e.g. max_steps=100")
        raw[key.strip()] = parse_override(value, item)
    return raw


def train_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsman train", description="Train draft heads on a frozen target "
                                 "(or, with kind pard, adapt a draft model for parallel drafting).")
    ap.add_argument("kind", choices=list(KINDS) + ["pard"])
    ap.add_argument("--config", required=True, help="YAML file (see training/configs/<kind>.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override one config key, value parsed as YAML (repeatable)")
    ap.add_argument("--eval-only", action="store_true",
                    help="evaluate the heads already in `out` on held-out text (Medusa: and recalibrate "
                         "its tree with tree_budget) instead of training")
    return ap


def pard_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsman train pard",
                                 description="Adapt a draft model for parallel drafting (PARD).")
    ap.add_argument("--config", required=True, help="YAML file (see training/configs/pard.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override one config key, value parsed as YAML (repeatable)")
    ap.add_argument("--eval-only", action="store_true",
                    help="measure the held-out accuracy by depth of the parallel draft model already in `out` "
                         "instead of training")
    return ap
