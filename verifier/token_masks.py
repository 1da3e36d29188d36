"""Grammar masks kept packed, as llguidance writes them: one bit per token, 32 tokens to an int32
word (bit i of word w is token 32 w + i). At a 152k vocabulary, unpacking a 21-node block's masks
into one bool per token and masked_fill over the logits took 13-14 ms on two CPU cores; here each
byte is looked up in a 256-row table of +inf (allowed) / -inf (forbidden), and the logits take
torch.minimum with that ceiling in place: 2.5 ms (scripts/grammar_mask_cost.py). Only the packed
words move to a GPU, a 32nd of the bools. min(x, +inf) is x and min(x, -inf) is -inf for every
logit but NaN, so the masked logits are those masked_fill gives, bit for bit.
"""
from __future__ import annotations

import torch

_SHIFTS = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
_BYTE_BITS = torch.tensor([[(byte >> i) & 1 for i in range(8)] for byte in range(256)], dtype=torch.bool)


class TokenMasks:
    """n packed masks, (n, words) int32, on the CPU where llguidance fills them."""

    def __init__(self, bitmask: torch.Tensor):
        self.bitmask = bitmask

    @classmethod
    def packed(cls, allowed: torch.Tensor) -> "TokenMasks":
        """From bool (n, width) masks (a grammar of one's own, a test's)."""
        n, width = allowed.shape
        words = (width + 31) // 32
        bits = torch.zeros(n, words * 32, dtype=torch.int64)
        bits[:, :width] = allowed.cpu()
        values = (bits.view(n, words, 32) << torch.arange(32)).sum(-1)  # in [0, 2^32)
        return cls(torch.where(values >= 2 ** 31, values - 2 ** 32, values).to(torch.int32))

    def __len__(self) -> int:
        return self.bitmask.shape[0]

    @property
    def tokens(self) -> int:
        """Token ids the words cover (a multiple of 32)."""
        return self.bitmask.shape[1] * 32

    def allows(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """bool (n, len(token_ids)), on the ids' device: whether each mask allows each token
        (False beyond the words). Only those tokens' bits are read."""
        ids = token_ids if isinstance(token_ids, torch.Tensor) else torch.tensor(token_ids, dtype=torch.long)
        inside = ids < self.tokens
        words = self.bitmask.to(ids.device)[:, torch.where(inside, ids, 0) // 32]
        return ((words >> (ids % 32).to(torch.int32)) & 1).bool() & inside

    def allow_(self, which: torch.Tensor, token_ids: list[int]) -> None:
        """Set the bits of `token_ids` in the masks `which` (bool (n,)) selects; ids beyond the
        words are no tokens and stay forbidden."""
        ids = [t for t in token_ids if t < self.tokens]
        if not ids or not bool(which.any()):
            return
        words = torch.zeros(self.bitmask.shape[1], dtype=torch.int32)
        for t in ids:
            words[t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)  # bit 31: the sign bit
        self.bitmask[which] |= words

    def _bytes(self, device) -> torch.Tensor:
        """(n * words * 4,) byte values, little-endian within each word on any machine."""
        packed = self.bitmask.to(device)
        return ((packed[:, :, None] >> _SHIFTS.to(device)) & 0xFF).flatten().long()

    def allowed(self, width: int, device=None) -> torch.Tensor:
        """bool (n, width): what each mask allows; False beyond the words."""
        device = device or self.bitmask.device
        out = _BYTE_BITS.to(device).index_select(0, self._bytes(device)).view(len(self), -1)
        return _fit(out, width, False)

    def ceiling(self, width: int, dtype: torch.dtype, device) -> torch.Tensor:
        """(n, width) of dtype: +inf where a mask allows the token, -inf where it does not."""
        out = _ceiling_table(dtype, device).index_select(0, self._bytes(device)).view(len(self), -1)
        return _fit(out, width, -torch.inf)

    def apply_(self, rows: torch.Tensor, at: list[int], columns: torch.Tensor | None = None) -> None:
        """Forbidden tokens get -inf, in place: mask i on row at[i] of `rows` (a (N, V) view of
        float logits); rows that follow each other are taken a run at a time. columns: the token
        id of each column (a draft vocabulary's: only their bits are read), else column c is token c."""
        if columns is None:
            ceiling = self.ceiling(rows.shape[-1], rows.dtype, rows.device)
        else:
            signs = torch.tensor([-torch.inf, torch.inf], dtype=rows.dtype, device=rows.device)
            ceiling = signs[self.allows(columns.to(rows.device)).long()]
        start = 0
        for end in range(1, len(at) + 1):
            if end == len(at) or at[end] != at[end - 1] + 1:
                view = rows[at[start]:at[start] + end - start]
                torch.minimum(view, ceiling[start:end], out=view)
                start = end


_CEILING_TABLES: dict = {}


def _ceiling_table(dtype: torch.dtype, device) -> torch.Tensor:
    """(256, 8): the ceiling of each byte's 8 tokens, made once per dtype and device."""
    key = (dtype, str(device))
    if key not in _CEILING_TABLES:
        _CEILING_TABLES[key] = torch.where(_BYTE_BITS, torch.inf, -torch.inf).to(dtype=dtype, device=device)
    return _CEILING_TABLES[key]


def _fit(table: torch.Tensor, width: int, fill) -> torch.Tensor:
    if table.shape[1] >= width:
        return table[:, :width]
    pad = torch.full((table.shape[0], width - table.shape[1]), fill, dtype=table.dtype, device=table.device)
    return torch.cat([table, pad], dim=1)
