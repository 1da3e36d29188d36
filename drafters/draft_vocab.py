"""A reduced draft vocabulary (as EAGLE-3 uses): heads rank candidates among the N tokens the
target picks most, so their LM head is N rows instead of the whole vocabulary, which is most of
what a head's drafting step costs. The order is counted on training text when heads are evaluated
(`tokens_by_frequency` in the heads' config.json). Exactness does not depend on it: drafts are
proposals, whatever set they come from."""
from __future__ import annotations

import torch


def frequent_tokens(head_config: dict, path: str, n: int, vocab_size: int, drafter: str, kind: str,
                    device) -> torch.Tensor:
    """Sorted token ids of the n most frequent target picks (the rows a shrunk LM head keeps)."""
    order = head_config.get("tokens_by_frequency")
    if order is None:
        raise ValueError(f"{drafter}: the heads in '{path}' carry no token frequencies, so draft_vocab cannot be "
                         f"used; add them with `draftsman train {kind} --config FILE --eval-only`")
    if not 1 <= n <= vocab_size:
        raise ValueError(f"{drafter}: draft_vocab must be between 1 and the vocabulary size {vocab_size}, got {n}")
    return torch.tensor(sorted(order[:n]), dtype=torch.long, device=device)


class OwnDtypeLinear(torch.nn.Linear):
    """A Linear that casts its input to its own weight's dtype: a bfloat16 copy of the LM head can
    then read a float32 final norm's output (MTP shares the target's norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def shrunk_linear(full: torch.nn.Module, keep: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> torch.nn.Linear:
    """A bias-free copy of an LM head with only the rows in `keep` (None: all), in `dtype`."""
    weight = full.weight.data if keep is None else full.weight.data[keep]
    dtype = dtype or weight.dtype
    small = OwnDtypeLinear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=dtype)
    small.weight.data = weight.to(dtype).clone()
    return small.requires_grad_(False)
