"""Drafting under logit_bias: a model drafter adds the request's bias to its own logits where they
come out of its network, as the engine adds it to the target's (before the penalties), so a token
the request bans is not drafted for the verifier to reject, and a favoured one is drafted where
the target will now pick it. On the bundled target at T=0 with the newline token banned,
EAGLE-3's tau went from 3.74 / 4.06 / 3.49 to 4.37 / 4.43 / 4.34 (continuation / copy /
docstring prompts; the other drafters in docs/choosing-a-drafter.md).

A bias of -100, the floor, bans the token from drafts outright (-inf): a drafter's logits need not
be on the target's scale (a fresh EAGLE head fed its own features reached logits of 170 on a tiny
target, where -100 left the token on top), and the request's intent is plain.

Drafts only. A sampled draft token's q is the distribution it was drawn from, biased or not, so
the verifier stays exact either way; a deterministic draft needs no q. `ngram` copies tokens from
the context: it ends a continuation before a banned token and ignores other biases.

Rows of one batch may have biases of their own (verifier/sampling.py's ROW_FIELDS): a drafter
then biases each row's logits by its own (RowDraftBias), and `ngram` and `retrieval` end each
row's continuations before the tokens that row bans (banned_ids, in drafters/path_bans.py).
"""
from __future__ import annotations

import torch

BAN = -100.0  # the API's floor (OpenAI's logit_bias range is [-100, 100])


class DraftBias:
    """One request's logit_bias over a drafter's `width` logits: all tokens (`vocab_map` None), or
    a draft vocabulary's rows (`vocab_map`: row -> token id; biased tokens outside it are left
    out, as are ids at or past `width`)."""

    def __init__(self, logit_bias: tuple[tuple[int, float], ...], width: int, vocab_map: torch.Tensor | None,
                 device):
        ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.long, device=device)
        biases = torch.tensor([-torch.inf if b <= BAN else b for _, b in logit_bias], dtype=torch.float64,
                              device=device)
        if vocab_map is None:
            inside = ids < width
            self.columns, self.values = ids[inside], biases[inside]
        else:
            rows = vocab_map[:width]
            match = rows[:, None] == ids[None, :]  # (width, biased ids)
            self.columns = match.any(1).nonzero()[:, 0]
            self.values = biases[match[self.columns].int().argmax(1)]

    def apply(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(..., width) logits plus the bias: a new tensor (the caller's logits may be cached).
        rows: which rows the logits hold (RowDraftBias's; one bias for every row needs none)."""
        if self.columns.numel() == 0:
            return logits
        out = logits.clone()
        out[..., self.columns] += self.values.to(logits.dtype)
        return out


class RowDraftBias:
    """Each row's own logit_bias over a drafter's (B, ..., width) logits (B: the first dim): one
    (B, width) table, 0 where a row has no bias, -inf where it bans. `row_biases`: each row's
    (id, bias) pairs, () for none."""

    def __init__(self, row_biases: list[tuple[tuple[int, float], ...]], width: int, vocab_map: torch.Tensor | None,
                 device):
        self.table = torch.zeros(len(row_biases), width, dtype=torch.float64, device=device)
        made: dict[tuple, DraftBias] = {}  # rows mostly repeat a few biases
        for row, biases in enumerate(row_biases):
            if biases:
                if biases not in made:
                    made[biases] = DraftBias(biases, width, vocab_map, device)
                self.table[row, made[biases].columns] = made[biases].values
        self._cast: dict[torch.dtype, torch.Tensor] = {}  # the table in each logits dtype met

    def apply(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(B, ..., width) logits plus each row's bias: a new tensor. rows: which of the batch's
        rows the logits' first dim holds, when not all."""
        if logits.dtype not in self._cast:
            self._cast[logits.dtype] = self.table.to(logits.dtype)
        table = self._cast[logits.dtype] if rows is None else self._cast[logits.dtype].index_select(0, rows)
        return logits + table.view(table.shape[0], *[1] * (logits.dim() - 2), table.shape[1])


def banned_ids(sampling) -> frozenset[int]:
    """The tokens a setting's logit_bias bans (-100)."""
    return frozenset(t for t, bias in sampling.logit_bias or () if bias <= BAN)

