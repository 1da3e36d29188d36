"""Prefill: every prompt token but the last goes into a cache (the last is the first round's root).

Rows with the same prefix (a prompt sampled n times) are prefilled once, then their cache rows
copied. A prefill may run in chunks of at most `chunk` tokens per row, one chunk per step (chunked
prefill, as vLLM's): the engine prefills a prompt that joins a running batch a chunk per round,
so the batch's rows wait one chunk's pass a round, not the whole prompt's. On this project's
2-core CPU the bundled target prefills 1000 tokens in 310 ms against a 17.5 ms round at batch 4;
a 128-token chunk takes 47 ms.
"""
from __future__ import annotations

import torch

from .cached_model import CachedLM
from .tree import TreeBlock


class Prefill:
    """The prefill of `prompts` into `lm` (emptied first), one chunk per step()."""

    def __init__(self, lm: CachedLM, prompts: list[list[int]], layers: tuple[int, ...], device):
        self.lm, self.prompts, self.layers, self.device = lm, prompts, layers, device
        first_of: dict[tuple[int, ...], int] = {}  # prefix -> its row among the distinct ones
        self.distinct = [first_of.setdefault(tuple(p[:-1]), len(first_of)) for p in prompts]
        self.prefixes = [list(prefix) for prefix in first_of]
        self.longest = max(len(p) for p in self.prefixes)
        self.done = 0  # tokens of each prefix in the cache
        self.states: list[dict[int, list[torch.Tensor]]] = [{k: [] for k in layers} for _ in self.prefixes]
        lm.reset(len(self.prefixes))

    @property
    def finished(self) -> bool:
        return self.done >= self.longest

    def step(self, chunk: int | None = None) -> bool:
        """Prefill the next `chunk` tokens of each prefix (None: all the rest); True once done."""
        end = self.longest if chunk is None else min(self.longest, self.done + chunk)
        while self.done < end:
            self._pass(end)
        return self.finished

    def _pass(self, end: int) -> None:
        """One target pass: each prefix's tokens up to `end`. For a model with recurrent layers,
        a pass stops where the shortest unfinished prefix does (the state after a row's last token
        is the one it must keep), so prompts of k lengths take up to k passes."""
        if self.lm.recurrent:
            end = min([end] + [len(p) for p in self.prefixes if len(p) > self.done])
        pieces = [p[self.done:end] for p in self.prefixes]
        block = TreeBlock.chains(pieces, self.device)
        no_logits = torch.zeros(len(pieces), dtype=torch.long, device=self.device)  # a prefill needs none
        _, hidden = self.lm.forward(block, self.layers, logits_at=no_logits, keep_all=True)
        self.lm.accept([list(range(len(piece))) for piece in pieces])
        for k, h in hidden.items():
            for u, piece in enumerate(pieces):
                self.states[u][k].append(h[u, : len(piece)])
        self.done = end

    def finish(self) -> list[dict[int, torch.Tensor]]:
        """Copy shared prefixes' cache rows to every row; per row, the requested layers' states at
        its prefix positions ({} for a one-token prompt)."""
        assert self.finished, "finish() before the last step()"
        if len(self.prefixes) < len(self.prompts):
            self.lm.select_rows(self.distinct)
        return [{k: torch.cat(parts) for k, parts in self.states[u].items()} if len(p) > 1 else {}
                for u, p in zip(self.distinct, self.prompts)]
