"""Rows that join a running batch (continuous batching): what each brings, and where it waits.

A joining row gives its prompt and limit, and may give its own min_new_tokens, stop check, stop
token ids, sampling settings and ignore_eos; whatever it leaves out it takes from the batch. It is
numbered when it joins, and enters the batch's rounds once its prompt is prefilled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

from .prefill import Prefill


class _Batch:
    """The value a joining row leaves to the batch (a stop of None means "no stop check")."""

    def __repr__(self) -> str:
        return "BATCH"


BATCH: Any = _Batch()


class JoiningRow(NamedTuple):
    """One row for SpeculativeEngine.stream's joining. A plain tuple in this order works too.
    Left out (BATCH), or None where None means nothing else: the batch's value."""
    prompt: Iterable[int]
    max_new_tokens: int
    min_new_tokens: int | None = None
    stop: Callable | None = BATCH  # None: no stop check
    stop_token_ids: Iterable[int] | None = BATCH  # None: no stop ids (EOS still ends the row)
    sampling: Any = None  # SamplingParams; None: the batch's (its drafter's when rows had their own)
    ignore_eos: bool | None = None

    @classmethod
    def of(cls, row) -> "JoiningRow":
        return as_named(cls, row, 2, "a joining row")


def as_named(cls, given, least: int, what: str):
    """A NamedTuple class's value from itself, or from a tuple of `least` or more of its fields in order."""
    if isinstance(given, cls):
        return given
    if not isinstance(given, (tuple, list)) or not least <= len(given) <= len(cls._fields):
        raise ValueError(f"{what} is a {cls.__name__} or a tuple ({', '.join(cls._fields)}) of {least} to "
                         f"{len(cls._fields)} values, got {given!r}")
    return cls(*given)


@dataclass
class PendingJoin:
    """Rows that joined a running batch, numbered, while their prompts are prefilled."""
    rows: list[int]
    prompts: list[list[int]]
    prefill: Prefill
