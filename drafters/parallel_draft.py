"""Parallel drafting (PARD, An et al. 2025): a draft model trained to read k - 1 mask tokens after
the context drafts all k tokens in one pass instead of k. The context's last token predicts the
first draft, as in any causal LM; the j-th mask, at the position the j-th draft would take, predicts
the (j + 1)-th. The masks' keys are forgotten after the pass, so the cache holds the context only,
and the next round feeds the tokens the target emitted (`draftsman train pard` adapts a draft
model; AMD's PARD checkpoints, which vLLM loads with `parallel_drafting`, name their mask token
`pard_token` in config.json).

Exactness does not depend on it: a draft at depth j is drawn from the model's distribution at the
(j - 1)-th mask, which depends on the context only, and that distribution is its q, a valid
proposal for rejection sampling however it ignores the drafts above it (it costs acceptance only).
"""
from __future__ import annotations

import warnings

import torch

from ..verifier.cached_model import CachedLM
from ..verifier.tree import TreeBlock

MASK_TOKEN_KEYS = ("pard_token", "ptd_token_id")  # where PARD checkpoints (and vLLM) find the mask
TRAINED_K_KEY = "pard_k"  # config.json: the k `draftsman train pard` trained (AMD's checkpoints name none)


def check_parallel_options(options) -> None:
    """draft_model's options that parallel drafting rules out or needs."""
    if options.mask_token_id is not None and not options.parallel_drafting:
        raise ValueError("draft_model: mask_token_id is parallel_drafting's mask token; set parallel_drafting: true "
                         "or leave mask_token_id unset")
    if options.parallel_drafting and options.top_k > 1:
        raise ValueError(f"draft_model: parallel_drafting drafts one chain per pass, not a tree (top_k="
                         f"{options.top_k}): set drafter.top_k to 1")


def mask_token(options, model: torch.nn.Module) -> int:
    """The mask token a parallel draft model was trained with: the option, else its config's."""
    config = model.config
    token = options.mask_token_id
    if token is None:
        token = next((getattr(config, key) for key in MASK_TOKEN_KEYS if getattr(config, key, None) is not None), None)
    if token is None:
        raise ValueError(f"draft_model: parallel_drafting needs the mask token '{options.path}' was trained with, and "
                         f"its config.json names none ({' / '.join(MASK_TOKEN_KEYS)}): set drafter.mask_token_id, "
                         "or adapt the model with `draftsman train pard`")
    rows = model.get_input_embeddings().weight.shape[0]
    if not 0 <= int(token) < rows:
        raise ValueError(f"draft_model: mask token {token} is outside the {rows}-row embedding of '{options.path}'")
    return int(token)


def warn_if_deeper_than_trained(options, model: torch.nn.Module) -> None:
    """Drafts past the masks a model was trained with are untrained guesses: exact still, but they
    cost a pass position and are rarely accepted, so say so once, at load."""
    trained = getattr(model.config, TRAINED_K_KEY, None)
    if trained is not None and options.k > int(trained):
        warnings.warn(f"draft_model: k={options.k} drafts {options.k - 1} masks, but '{options.path}' was trained "
                      f"with k={trained} (config.json {TRAINED_K_KEY}), so its drafts past depth {trained} are "
                      f"untrained and rarely accepted: set drafter.k to {trained}, or retrain with "
                      f"`draftsman train pard --set k={options.k}`", stacklevel=3)


def feed_with_masks(lm: CachedLM, unseen: list[list[int]], mask: int, k: int) -> torch.Tensor:
    """Commit each row's unseen tokens (one at least) and read the k - 1 masks after them in the
    same pass. Returns the logits (B, k, V): after the last unseen token, then after each mask."""
    block = TreeBlock.chains([row + [mask] * (k - 1) for row in unseen], lm.device)
    at = torch.tensor([[len(row) - 1 + j for j in range(k)] for row in unseen], device=lm.device)
    logits, _ = lm.forward(block, logits_at=at)
    lm.accept([list(range(len(row))) for row in unseen])  # the masks' slots are dropped
    return logits
