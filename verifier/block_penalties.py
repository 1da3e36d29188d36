"""Penalties over a verification block, each position for its own context, without (B, T, V) tables.

A position's context is the committed text (one (B, V) table per row, verifier/context_tokens.py)
plus its ancestors in the block. Expanding the row's table to every position and marking the
ancestors there cost (B, T, V) tables and scans of them per round. Repetition + presence /
frequency at batch 16 with a 21-node tree on the 2-core CPU: 10.7 + 16.0 ms with the bundled
8192-token vocabulary, 90 + 377 ms with a 128k one; done as below, 2.0 + 1.3 and 4.3 + 2.8 ms.

Done here, only the entries that change are touched: the row's tokens at every position (a gather over
T) and, once each, the (row, position, token) entries its ancestors add. Those few are penalised
from their original logits with their whole count, so every entry sees the same arithmetic as
the dense formula in verifier/sampling.py: the result is bit-identical
(tests/test_block_penalties.py), and a token reached through the tree is penalised exactly as
the same token committed.

Each penalty is one number for every row, or a (B,) tensor of one per row (rows of one batch
with their own); a row's neutral value (repetition 1, presence / frequency 0) leaves its logits
bit-identical.
"""
from __future__ import annotations

import torch

from .sampling import penalize_counts


def _ancestor_entries(tokens: torch.Tensor, ancestors: torch.Tensor, vocab_size: int, with_root: bool):
    """The (row, position, token) entries a position's ancestors add, each once, and how many of
    its ancestors hold that token: (b, j, v, count), each (n,)."""
    T, V = tokens.shape[1], vocab_size
    b, j, k = (ancestors if with_root else ancestors[:, :, 1:]).nonzero(as_tuple=True)
    v = tokens[b, k if with_root else k + 1]
    keys, count = torch.unique((b * T + j) * V + v, return_counts=True)  # a token twice on a path: one entry
    return keys // (T * V), keys // V % T, keys % V, count


def _per_entry(value, rows: torch.Tensor, dtype: torch.dtype):
    """A penalty for entries of these rows: the number itself, or each entry's row's value."""
    return value.to(dtype)[rows] if isinstance(value, torch.Tensor) else value


def writable(logits: torch.Tensor) -> torch.Tensor:
    """float32 or float64 logits are penalised in place (the engine's own, fresh from the target
    pass: copying them cost more than the penalty at a large vocabulary); others in a float32 copy."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def penalize_block_repeats_(logits: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor,
                           seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """Hugging Face's repetition penalty on (B, T, V) block logits: position j's context holds the
    row's committed tokens (seen: (B, V) bool) and the tokens of its ancestors, itself included (a
    node's logits predict the token after it). (B, T) tokens, (B, T, T) ancestor-or-self mask."""
    logits = writable(logits)
    b, j, v, _ = _ancestor_entries(tokens, ancestors, logits.shape[-1], with_root=True)
    original = logits[b, j, v]  # before the row's tokens are penalised: some are among them
    rows, held = seen.nonzero(as_tuple=True)
    values = logits[rows, :, held]  # (n, T): the row's tokens at every position
    at_rows = _per_entry(penalty, rows, logits.dtype)
    at_rows = at_rows[:, None] if isinstance(at_rows, torch.Tensor) else at_rows
    logits[rows, :, held] = torch.where(values < 0, values * at_rows, values / at_rows)
    at_b = _per_entry(penalty, b, logits.dtype)
    logits[b, j, v] = torch.where(original < 0, original * at_b, original / at_b)
    return logits


def penalize_block_counts_(logits: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor,
                          generated: torch.Tensor, presence: float | torch.Tensor | None,
                          frequency: float | torch.Tensor | None) -> torch.Tensor:
    """vLLM's presence / frequency penalties on (B, T, V) block logits: position j counts the
    row's generated tokens (generated: (B, V) counts) and its ancestors' tokens, the root (column
    0, the prompt's last token or an already counted one) excepted."""
    logits = writable(logits)
    b, j, v, added = _ancestor_entries(tokens, ancestors, logits.shape[-1], with_root=False)
    original = logits[b, j, v]
    rows, held = generated.nonzero(as_tuple=True)
    counts = generated[rows, held][:, None]  # (n, 1): the same count at every position
    column = lambda value: value[:, None] if isinstance(value, torch.Tensor) else value  # noqa: E731
    logits[rows, :, held] = penalize_counts(logits[rows, :, held], counts.expand(-1, tokens.shape[1]),
                                            column(_per_entry(presence, rows, logits.dtype)),
                                            column(_per_entry(frequency, rows, logits.dtype)))
    logits[b, j, v] = penalize_counts(original, generated[b, v] + added, _per_entry(presence, b, logits.dtype),
                                      _per_entry(frequency, b, logits.dtype))
    return logits
