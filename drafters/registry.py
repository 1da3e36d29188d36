"""Config name -> drafter class. Adding a drafter is one class plus one `@register` line.

Each drafter class carries an `Options` dataclass: its fields are the drafter's config keys (with
defaults), and `build_drafter` rejects keys that are not among them.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import Drafter

_REGISTRY: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name` to be registered")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    return sorted(_REGISTRY)


@dataclass
class TargetInfo:
    """What a drafter may know about the target it drafts for."""

    model: torch.nn.Module
    path: str
    tokenizer: Any  # a transformers tokenizer, or None when the target folder has none
    vocab_size: int
    device: torch.device
    dtype: torch.dtype


def drafter_options(cls: type[Drafter], options: dict):
    """Build the drafter's Options from a config dict, naming unknown keys (listing the valid ones), values
    of the wrong type and a `path` that does not exist."""
    opts_cls = getattr(cls, "Options", None)
    fields = {f.name for f in dataclasses.fields(opts_cls)} if opts_cls else set()
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for drafter '{cls.name}'; valid options: "
                         f"{sorted(fields | {'adaptive'})}")
    if opts_cls is None:
        return None
    hints = typing.get_type_hints(opts_cls)
    for key, value in options.items():
        _check_option(cls.name, key, value, hints[key])
    if isinstance(options.get("path"), str):  # "~/..." for every drafter (retrieval opened it as given)
        options = {**options, "path": os.path.expanduser(options["path"])}
    opts = opts_cls(**options)
    path = getattr(opts, "path", None)
    if isinstance(path, (str, os.PathLike)) and path and not Path(path).exists():
        holds = _option_help(opts_cls, "path")
        holds = f"the {holds}" if holds else f"what `draftsman drafters` says {cls.name}'s path holds"
        raise FileNotFoundError(f"{cls.name}: drafter.path '{path}' does not exist; it should be {holds}")
    return opts


def _option_help(opts_cls, key: str) -> str:
    """The `# comment` after an option in its Options class (what `draftsman drafters` prints), or ""."""
    from ..drafter_catalog import option_comments  # (torch-free: the listing's reader)

    return option_comments(opts_cls).get(key, "")


def _check_option(drafter: str, key: str, value, hint) -> None:
    """Options are typed like `k: int = 4` or `path: str | None = None`; check the value fits."""
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # (no option reads inf as "no limit": int(inf) failed mid-run)
                raise ValueError(f"drafter '{drafter}': option {key} must be a finite number, got {value!r}")
            return
        if t is str and isinstance(value, (str, os.PathLike)):
            return
        if typing.get_origin(t) is list:  # e.g. skip_layers: list[int]
            if isinstance(value, list):
                for at, each in enumerate(value):
                    _check_option(drafter, f"{key}[{at}]", each, typing.get_args(t)[0])
                return
            continue
        if isinstance(t, type) and t is not type(None) and isinstance(value, t) and not (
                isinstance(value, bool) and t is not bool):
            return
        if not isinstance(t, type):  # other hints are checked by the drafter
            return
    names = " or ".join("null" if t is type(None) else str(t) if typing.get_origin(t)
                        else getattr(t, "__name__", str(t)) for t in allowed)
    raise ValueError(f"drafter '{drafter}': option {key} must be {names}, got {value!r}")


def check_drafter_config(config: dict) -> tuple[type[Drafter], Any, bool]:
    """The drafter's class, its Options and `adaptive`, checked without a target: a misspelt name or key,
    a value of the wrong type or a missing folder is named before the target loads (minutes for a large
    one), not after."""
    config = dict(config)
    name = config.pop("name", "none")
    adaptive = config.pop("adaptive", False)
    if not isinstance(adaptive, bool):
        raise ValueError(f"drafter option adaptive must be true or false, got {adaptive!r}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter '{name}'; available drafters: {available()}")
    cls = _REGISTRY[name]
    return cls, drafter_options(cls, config), adaptive


def build_drafter(config: dict, target: TargetInfo) -> Drafter:
    """`adaptive: true` (any drafter) wraps it in adaptive speculation (drafters/adaptive.py)."""
    cls, options, adaptive = check_drafter_config(config)
    drafter = cls(options, target)
    if adaptive:
        from .adaptive import AdaptiveDrafter
        drafter = AdaptiveDrafter(drafter)
    return drafter
