"""Losses and held-out evaluation for feature-level heads (heads/feature_head.py: eagle, mtp).

Alignment, for a window x of the corpus run through the frozen target (features f, greedy g):
the head's input at position i is (f_i, x_{i+1}); it predicts the feature f_{i+1} (eagle) and the
token after x_{i+1}, whose label is labels[i + 1] (the target's greedy choice there, or the corpus
token). Positions 0..L-2 have inputs; the last has no next token.

  eagle  SmoothL1(predicted feature, f_{i+1}) + ce_weight * CE, with uniform noise on the input
         features (EAGLE-1: the head must tolerate its own imperfect features when it chains).
  mtp    CE only (DeepSeek-V3's MTP loss for one module).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from .heads import all_positions, masked_cross_entropy, masked_mean


def feature_head_loss(head, features: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, cfg: dict,
                      generator: torch.Generator | None = None, step_counts: torch.Tensor | None = None):
    """Returns the loss and the depth-1 top-1 accuracy against the labels (a 1-element tensor). The
    kind is the config's: `head` may be the wrapper several processes train it in
    (DistributedDataParallel). step_counts: masked_mean's (training/heads.py)."""
    kind = cfg["kind"]
    f_in = features[:, :-1]
    if kind == "eagle" and cfg["feature_noise"] > 0:
        noise = torch.rand(f_in.shape, generator=generator, device=f_in.device) * 2 - 1
        f_in = f_in + cfg["feature_noise"] * noise
    predicted, logits = head(f_in, x[:, 1:])
    target_tokens = labels[:, 1:]
    learned = target_tokens != -100  # the feature at i + 1 is learned where its token is
    ce = masked_cross_entropy(logits, target_tokens, step_counts)
    loss = ce
    if kind == "eagle":
        regression = F.smooth_l1_loss(predicted.float(), features[:, 1:].float(), reduction="none").mean(-1)
        loss = masked_mean((regression * learned).sum(), learned, step_counts) + cfg["ce_weight"] * ce
    accuracy = masked_mean(((logits.argmax(-1) == target_tokens) & learned).float().sum(), learned, step_counts)
    return loss, accuracy.reshape(1)


@torch.no_grad()
def evaluate_feature_head(head, target_pass, windows: torch.Tensor, autocast, depths: int = 4,
                          batch: int = 4, learned: torch.Tensor | None = None) -> dict:
    """Agreement with the target's greedy token on held-out text, by draft depth.

    Depth 1 is teacher-forced (true features, as after every verification). Depth k > 1 chains the
    head on its own predicted features, k - 1 times, with the true tokens as inputs: the head
    drafting k tokens ahead when its earlier guesses were right, which is what acceptance at depth
    k needs. (Its attention history is the chained sequence, a close proxy for the drafter's.)
    learned: which positions' next tokens count (training/heads.py learned_positions); None: all."""
    top1 = torch.zeros(depths)
    top5 = torch.zeros(depths)
    counts = torch.zeros(depths)
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].to(next(head.parameters()).device)
        keep = all_positions(x) if learned is None else learned[i:i + batch].to(x.device)
        features, greedy = target_pass(x)
        f_in = features[:, :-1]
        L = x.shape[1]
        for k in range(depths):
            n = L - 1 - k  # positions that have a label k steps later
            if n <= 0:
                break
            predicted, logits = head(f_in[:, :n], x[:, 1 + k: 1 + k + n])
            truth = greedy[:, 1 + k: 1 + k + n]
            counted = keep[:, 1 + k: 1 + k + n]
            cand = logits.topk(5, dim=-1).indices
            top1[k] += ((cand[..., 0] == truth) & counted).float().sum().cpu()
            top5[k] += ((cand == truth[..., None]).any(-1) & counted).float().sum().cpu()
            counts[k] += counted.sum().cpu()
            f_in = predicted[:, : n - 1]  # the head's own features feed the next depth
    return {"top1": (top1 / counts.clamp_min(1)).tolist(), "top5": (top5 / counts.clamp_min(1)).tolist()}


COVERAGE_SIZES = (256, 1024, 2048, 4096)


@torch.no_grad()
def tokens_by_frequency(target_pass, windows: torch.Tensor, vocab_size: int, batch: int = 4,
                        learned: torch.Tensor | None = None, draft_vocab: int | None = None) -> dict:
    """Token ids ordered by how often the target picks them (greedy) on training text, and the
    share of picks the top 256 / 1024 / 2048 / 4096 cover, and the top draft_vocab (the size a head
    or drafter is configured with, when given: the fixed sizes may all be past a small vocabulary,
    where they read 1.0). A drafter can restrict its candidates to
    the first N (option draft_vocab: its LM head shrinks to N rows; EAGLE-3's reduced draft
    vocabulary). Drafts stay exact: they are proposals, whatever set they come from.
    learned: which positions' picks count (assistant_only_loss: those inside replies); None: all."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(0, len(windows), batch):
        _, greedy = target_pass(windows[i:i + batch])
        picks = greedy.cpu() if learned is None else greedy.cpu()[learned[i:i + batch]]
        counts += torch.bincount(picks.reshape(-1), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(counts, descending=True, stable=True)
    cumulative = counts[order].cumsum(0).float() / counts.sum().clamp_min(1)
    sizes = sorted(set(COVERAGE_SIZES) | ({draft_vocab} if draft_vocab else set()))
    coverage = {str(n): round(float(cumulative[min(n, vocab_size) - 1]), 4) for n in sizes}
    return {"order": order.tolist(), "coverage": coverage}
