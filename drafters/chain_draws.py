"""Drawing chain drafts under each row's own sampling settings (Drafter.draft_sampling()).

A batch may hold rows with their own temperature, top-p, ... (verifier/sampling.py's
RowSampling). A chain drafter draws each row's next token from that row's own processed
distribution: a greedy row takes its argmax and proposes a deterministic chain, a sampled row
draws from its q and proposes an IID chain with q. Either is exact under the shared verifier; a
row drafted as it will be verified accepts more.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..verifier.sampling import RowSampling, SamplingParams, draw, processed_probs
from .base import DETERMINISTIC, IID, DraftTree


def greedy_rows(params: SamplingParams | RowSampling, rows: int) -> list[bool]:
    """Whether each of the batch's rows is greedy under params."""
    if isinstance(params, SamplingParams):
        return [params.greedy] * rows
    return [setting.greedy for setting in params.rows]


def draw_step(logits: torch.Tensor, params: SamplingParams | RowSampling,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n) logits -> (each row's processed distribution (B, n), its drawn index (B,)): the
    argmax for a greedy row, a draw from its distribution for a sampled one."""
    p = processed_probs(logits, params)
    if params.greedy:
        return p, p.argmax(-1)
    index = draw(p, generator)
    if isinstance(params, RowSampling):  # greedy rows' p is one-hot; take its argmax outright
        index = torch.where(params.greedy_rows(p.device), p.argmax(-1), index)
    return p, index


def chain_trees(tokens: torch.Tensor, lengths: list[int], params: SamplingParams | RowSampling,
                q_of: Callable[[], torch.Tensor], ready: list[bool] | None = None) -> list[DraftTree]:
    """Each row's chain of its first lengths[b] tokens (B, depth): deterministic for a greedy row,
    IID for a sampled one with q_of() (B, depth, V), the distributions they were drawn from (asked
    for only when some row samples). A row that is not ready proposes nothing."""
    B, device = tokens.shape[0], tokens.device
    greedy = greedy_rows(params, B)
    q = None if all(greedy) else q_of()
    ready = ready if ready is not None else [True] * B
    return [DraftTree.empty(device) if not ready[b] else
            DraftTree.chain(tokens[b, : lengths[b]], DETERMINISTIC, device=device) if greedy[b] else
            DraftTree.chain(tokens[b, : lengths[b]], IID, q[b, : lengths[b]], device=device)
            for b in range(B)]
