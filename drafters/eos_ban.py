"""Drafting under min_new_tokens: a row's new token number n <= min_new_tokens cannot be EOS (the
engine sets the target's EOS logit to -inf there), so a model drafter masks EOS in its own logits
at those depths and proposes its next guess instead of a token the verifier must reject. In a
fixed-length run (`draftsman compare --min-new-tokens`), a model that wants to stop would
otherwise draft EOS at every round after its natural end. On the bundled target, 16 held-out
prompts that stop 8 tokens before their file's end (7 of them end within 64 tokens unforced), 64
tokens fixed length, T=0: EAGLE-3's tau went from 5.07 to 5.31, MTP's from 2.62 to 2.65; `eagle`,
`medusa` and `draft_model` did not change. On the bundled prompt set no row wants EOS within 128
tokens, so nothing changes there.

Drafts only. A sampled draft token's q is the distribution it was drawn from, masked or not, so
the verifier stays exact either way; a deterministic draft needs no q.
"""
from __future__ import annotations

import torch


class EosBan:
    """One round's ban: in row b, a draft token at depth d (1 = the root's child, the row's next
    token) cannot be EOS while d <= deepest[b]. `columns`: EOS's indices among the drafter's
    logits (a draft vocabulary may hold none of them)."""

    def __init__(self, deepest: torch.Tensor, columns: torch.Tensor):
        self.deepest = deepest
        self.columns = columns

    @staticmethod
    def columns_of(eos_token_ids, width: int, vocab_map: torch.Tensor | None, device) -> torch.Tensor:
        """EOS's indices among `width` logits (all tokens, or a draft vocabulary's rows: `vocab_map`
        row -> token id). Fixed for a request: computed once, not per round."""
        eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)
        if vocab_map is None:
            return eos[eos < width]
        return torch.isin(vocab_map[:width], eos).nonzero()[:, 0]

    @classmethod
    def for_round(cls, produced: list[int], minimums: list[int], columns: torch.Tensor,
                  device) -> "EosBan | None":
        """The ban for rows that have produced `produced[b]` new tokens of the `minimums[b]` they
        must (each row its own request's min_new_tokens); None when no row's draft can reach a
        banned token, or no EOS is among the logits (drafting is then unchanged)."""
        left = [least - n for least, n in zip(minimums, produced)]
        if columns.numel() == 0 or max(left, default=0) <= 0:
            return None
        return cls(torch.tensor(left, device=device), columns)

    def rows(self, index: torch.Tensor) -> "EosBan":
        """The ban of a subset of rows (drafters that draft for some rows only)."""
        return EosBan(self.deepest[index], self.columns)

    def apply(self, logits: torch.Tensor, depth: int | torch.Tensor) -> torch.Tensor:
        """(B, ..., width) logits of draft tokens at `depth` (an int, or a tensor shaped like the
        middle dimensions: one depth each), with EOS at -inf where banned. A new tensor: the
        caller's logits may be cached."""
        middle = logits.shape[1:-1]
        deepest = self.deepest.view(-1, *[1] * len(middle))
        banned = (torch.as_tensor(depth, device=logits.device) <= deepest).expand(logits.shape[0], *middle)
        out = logits.clone()
        out[..., self.columns] = out[..., self.columns].masked_fill(banned[..., None], -torch.inf)
        return out
