"""Drawing chain drafts under each row's own sampling settings (Drafter.draft_sampling()).

A batch may hold rows with their own temperature, top-p, ... (verifier/sampling.py's
RowSampling). A chain drafter draws each row's next token from that row's own processed
distribution: a greedy row takes its argmax and proposes a deterministic chain, a sampled row
draws from its q and proposes an IID chain with q. Either is exact under the shared verifier; a
row drafted as it will be verified accepts more.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..verifier.sampling import RowSampling, SamplingParams, draw, processed_probs
from .base import DETERMINISTIC, IID, DraftTree

if TYPE_CHECKING:
    from .eos_ban import EosBan
    from .path_bans import PathBanRound
    from .repeats import DraftRepeats


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


class ChainRules:
    """One round's rules over a chain's draft logits, step by step: the penalties (each token's
    context is the committed one plus the drafts above it), the EOS ban up to min_new_tokens and
    the bans that depend on the path (drafters/repeats.py, eos_ban.py, path_bans.py). Each is
    None when the round has none. Drafts only: a sampled token's q is what it was drawn from."""

    def __init__(self, repeats: "DraftRepeats | None", eos_ban: "EosBan | None", path_bans: "PathBanRound | None",
                 rows: int):
        self.repeats, self.eos_ban, self.path_bans = repeats, eos_ban, path_bans
        self.state = None if repeats is None else repeats.root_state
        self.paths = None if path_bans is None else [[] for _ in range(rows)]  # each row's drafts, under bans

    def apply(self, logits: torch.Tensor, depth: int) -> torch.Tensor:
        """(B, n) logits of the tokens at `depth` (1 = the first after the root), under the rules."""
        if self.state is not None:  # penalised as the target's logits will be
            logits = self.repeats.penalise(logits, self.state)
        if self.eos_ban is not None:
            logits = self.eos_ban.apply(logits, depth)
        if self.paths is not None:
            logits = self.path_bans.mask(logits, self.paths)
        return logits

    def drafted(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """The step drew `index` (B,) into the logits, token ids `tokens` (B,)."""
        if self.state is not None:
            self.state = self.repeats.plus(self.state, index)
        if self.paths is not None:
            self.paths = [path + [t] for path, t in zip(self.paths, tokens.tolist())]

    def draw_chain(self, logits: torch.Tensor, depth: int, grow: Callable[[torch.Tensor, int], torch.Tensor],
                   sampling: SamplingParams | RowSampling, generator: torch.Generator,
                   token_ids: Callable[[torch.Tensor], torch.Tensor] = lambda index: index
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A chain drafter's loop: `depth` draws, the first from `logits` (B, n), each under the
        rules and its row's own processing (draw_step); grow(token ids (B,), d) gives the logits
        after the tokens at depth d. token_ids maps logit indices to token ids (a draft
        vocabulary). Returns the tokens (B, depth) and what each depth was drawn from, (B, n) each."""
        tokens, probs = [], []
        for d in range(1, depth + 1):
            p, index = draw_step(self.apply(logits, d), sampling, generator)
            token = token_ids(index)
            self.drafted(index, token)
            tokens.append(token)
            probs.append(p)
            if d < depth:
                logits = grow(token, d)
        return torch.stack(tokens, 1), probs
