"""`none`: no drafts at all, so every round is one plain decoding step through the same engine.
This is the baseline every speedup is measured against."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Drafter, DraftTree
from .registry import register


@register
class NoDrafter(Drafter):
    name = "none"
    can_add_rows = True  # no per-row state

    @dataclass
    class Options:
        pass

    def __init__(self, options=None, target=None):
        self.device = target.device if target is not None else "cpu"

    def propose(self, contexts):
        return [DraftTree.empty(self.device) for _ in contexts]
