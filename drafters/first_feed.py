"""Rows that start from the same prompt (n samples of one prompt) feed a drafter's empty cache
once: the first feed runs the distinct rows, then copies their cache rows, as the engine's
prefill does for the target. Bundled models, 8 copies of a 600-token prompt, time to the first
token: EAGLE-3 0.51 s -> 0.33 s, draft model 0.41 s -> 0.30 s (plain decoding 0.32-0.36 s)."""
from __future__ import annotations


def distinct_rows(keys: list) -> tuple[list[int], list[int]] | None:
    """(the first row of each distinct key, each row's index among those), or None when no two
    rows share a key (nothing to save)."""
    first_of: dict = {}
    distinct = [first_of.setdefault(key, len(first_of)) for key in keys]
    if len(first_of) == len(keys):
        return None
    firsts = [0] * len(first_of)
    for row in reversed(range(len(keys))):
        firsts[distinct[row]] = row
    return firsts, distinct
