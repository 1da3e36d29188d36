"""Logits -> sampling distribution, exactly as the baseline sampler does it, and seeded draws.

Order and tie rules follow Hugging Face's logits warpers (temperature, then top-k, top-p, min-p), so
`drafter: none` through our engine samples the same distribution as `model.generate(do_sample=True)`.
Temperature 0 means greedy: the distribution is one-hot on the first argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None  # drop tokens below min_p x the most likely token's probability

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or null, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or null, got {self.top_p!r}")
        if self.min_p is not None and not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] or null, got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities in float32 or better (float64 stays float64)."""
    work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(work_dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(work_dtype)
    scores = logits / params.temperature
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))  # ties with the k-th are kept
    if params.top_p is not None and params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= (1 - params.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    if params.min_p is not None and params.min_p > 0.0:
        probs = scores.softmax(-1)
        drop = probs < params.min_p * probs.amax(-1, keepdim=True)
        drop.scatter_(-1, probs.argmax(-1, keepdim=True), False)  # always keep the most likely token
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: (B, V) probabilities (not necessarily normalised) and (B,) uniforms in
    [0, 1) -> (B,) token ids. Tokens of zero probability are never returned."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    target = uniforms.to(cdf.dtype).unsqueeze(-1) * total
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total; fall back to the last token with mass.
    last_nonzero = (probs > 0).to(torch.long).cumsum(-1).argmax(-1)
    return torch.minimum(idx, last_nonzero)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample one token per row of (B, V) probabilities with an explicit generator."""
    u = torch.rand(probs.shape[:-1], generator=generator, device=generator.device, dtype=torch.float64)
    return sample_from(probs, u.to(probs.device))
