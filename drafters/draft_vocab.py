"""A reduced draft vocabulary (as EAGLE-3 uses): a drafter ranks candidates among the N tokens the
target picks most, so its LM head is N rows instead of the whole vocabulary, which is most of what
a small drafter's step costs. The order is counted on training text (`tokens_by_frequency`): in
the heads' config.json when heads are evaluated, or in a tokens_by_frequency.json that
`draftsman vocab` writes for a draft model. Exactness does not depend on it: drafts are
proposals, whatever set they come from, and a sampled draft's q is the distribution over the N
tokens it was drawn from, placed in the full vocabulary."""
from __future__ import annotations

import json
from pathlib import Path

import torch

ORDER_FILE = "tokens_by_frequency.json"


def check_needs_draft_vocab(drafter: str, draft_vocab: int | None, **options) -> None:
    """Options that only mean something under draft_vocab (draft_vocab_sampling, vocab_order): set
    without it, a named error rather than a silent no-op. And draft_vocab's lower bound, which needs
    no model, so that a bad count is named before the target loads (its upper bound, the target's
    vocabulary: check_fits_vocabulary)."""
    if draft_vocab is not None and draft_vocab < 1:
        raise ValueError(f"{drafter}: draft_vocab must be >= 1 (the number of tokens the target picks most to draft "
                         f"among), got {draft_vocab}: set a positive count, or leave draft_vocab unset to draft "
                         "among all tokens")
    for key, value in options.items():
        if value and draft_vocab is None:
            raise ValueError(f"{drafter}: {key} only applies with draft_vocab; set draft_vocab too "
                             f"(e.g. draft_vocab: 1024) or drop {key}")


def frequent_tokens(head_config: dict, path: str, n: int, vocab_size: int, drafter: str, kind: str,
                    device) -> torch.Tensor:
    """Sorted token ids of the n most frequent target picks (the rows a shrunk LM head keeps)."""
    order = head_config.get("tokens_by_frequency")
    if order is None:
        raise ValueError(f"{drafter}: the heads in '{path}' carry no token frequencies, so draft_vocab cannot be "
                         f"used; add them with `draftsman train {kind} --config FILE --eval-only`")
    return top_tokens(order, n, vocab_size, drafter, device)


def top_tokens(order: list[int], n: int, vocab_size: int, drafter: str, device) -> torch.Tensor:
    """Sorted ids of the first n tokens of `order` (most frequent first)."""
    check_fits_vocabulary(n, vocab_size, drafter)
    return torch.tensor(sorted(order[:n]), dtype=torch.long, device=device)


def check_fits_vocabulary(n: int, vocab_size: int, drafter: str) -> None:
    """draft_vocab against the target's vocabulary (the range its Options cannot check)."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"{drafter}: draft_vocab must be between 1 and the vocabulary size {vocab_size}, got {n}: "
                         f"set it to at most {vocab_size}, or leave it unset to draft among all tokens")


def read_token_order(source: str, vocab_size: int, drafter: str, target_model: torch.nn.Module | None = None
                     ) -> list[int]:
    """The token order in `source`: a JSON file (`draftsman vocab` writes one), or a folder holding
    tokens_by_frequency.json or a heads config.json trained for the same target. target_model: the
    target's model, to refuse an order recorded for another target (files that record none still load)."""
    path = Path(source)
    out = path / ORDER_FILE if path.is_dir() else path
    fix = (f"write one with `draftsman vocab --target TARGET_FOLDER --out {out}`, or set vocab_order to a heads "
           "folder trained for this target")
    if path.is_dir():  # its own order file, else a heads config.json that carries the order
        found = [(c, _json_of(c, drafter)) for c in (path / ORDER_FILE, path / "config.json") if c.is_file()]
        found = [(c, data) for c, data in found if isinstance(data, dict) and "tokens_by_frequency" in data]
        if not found:
            raise ValueError(f"{drafter}: draft_vocab needs token frequencies, and '{source}' has neither "
                             f"{ORDER_FILE} nor a config.json with tokens_by_frequency; {fix}")
        path, data = found[0]
    elif path.is_file():
        data = _json_of(path, drafter)
    else:
        raise ValueError(f"{drafter}: vocab_order '{source}' does not exist; {fix}")
    order = data.get("tokens_by_frequency") if isinstance(data, dict) else data
    if not isinstance(order, list) or not order or not all(isinstance(t, int) for t in order):
        raise ValueError(f"{drafter}: '{path}' holds no list of token ids under tokens_by_frequency; {fix}")
    if not all(0 <= t < vocab_size for t in order):
        raise ValueError(f"{drafter}: '{path}' was counted for another vocabulary (token ids up to {max(order)}; the "
                         f"target has {vocab_size} tokens); {fix}")
    if target_model is not None and isinstance(data, dict):
        check_counted_for(data.get("target"), target_model, path, drafter, fix)
    return order


def _json_of(path: Path, drafter: str):
    """A vocab_order file's JSON; one that is not JSON is named with the key and the fix (json's own
    message names only a line and a column)."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{drafter}: vocab_order: '{path}' is not valid JSON ({e}); point vocab_order at the token "
                         f"order `draftsman vocab --target TARGET_FOLDER --out FILE` writes, or at a heads folder "
                         "trained for this target") from None


def check_counted_for(recorded: dict | None, target_model: torch.nn.Module, path: Path, drafter: str,
                      fix: str) -> None:
    """Refuse an order whose record names another target (a heads config.json's or a `draftsman vocab`
    file's target fingerprint): its ranking is another model's picks. None (older files): nothing to check."""
    if not isinstance(recorded, dict) or "lm_head_probe" not in recorded:
        return
    from ..heads.common import fingerprint_difference, target_fingerprint

    why = fingerprint_difference(recorded, target_fingerprint(target_model))
    if why:
        raise ValueError(f"{drafter}: vocab_order '{path}' was trained for another target: {why}; {fix}")


class ShrunkHeadIds:
    """Mixed in by drafters whose logits may cover a draft vocabulary only: `vocab_map` (set per
    round kind; None = every token) maps their logits' indices to token ids."""

    vocab_map: torch.Tensor | None = None

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices into this round's logits -> token ids (they differ under draft_vocab)."""
        return indices if self.vocab_map is None else self.vocab_map[indices]


def full_vocab(probs: torch.Tensor, vocab_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """(..., n) probabilities over a shrunk LM head's rows -> (..., vocab_size), zero elsewhere: the
    q a sampled draft was drawn from, as the verifier reads it."""
    if vocab_map is None:
        return probs
    return probs.new_zeros(*probs.shape[:-1], vocab_size).index_copy_(-1, vocab_map, probs)


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
