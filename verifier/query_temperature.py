"""Llama 4's attention temperature, taken at the positions draftsman passes.

Llama 4's layers without RoPE multiply their queries by log1p(floor((p + 1) / floor_scale)) *
attn_scale + 1, a factor that grows with the position p (Nakanishi 2025, scalable softmax).
Hugging Face takes p from the cache: its slot count plus the token's index in the block. In
draftsman's cache a slot is not a position (holes left by rejected drafts, padding of ragged rows,
tree nodes at their depth), so during draftsman's forward the layers' own scaling is switched off
and a hook on their q_proj applies the same factor at each token's own position.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class QueryTemperature:
    def __init__(self, attentions: list[nn.Module], floor_scale: float, attn_scale: float):
        self.attentions = attentions
        self.floor_scale = floor_scale
        self.attn_scale = attn_scale

    @classmethod
    def for_model(cls, model: nn.Module) -> "QueryTemperature | None":
        """None where the model scales no queries by position (every model but Llama 4)."""
        text = model.config.get_text_config()
        if not getattr(text, "attn_temperature_tuning", False):
            return None
        attentions = [m for m in model.modules()
                      if hasattr(m, "attn_temperature_tuning") and not getattr(m, "use_rope", True)]
        if not attentions:
            return None
        if not all(isinstance(getattr(m, "q_proj", None), nn.Module) for m in attentions):
            raise NotImplementedError(f"{type(attentions[0]).__name__} scales its queries by position but has no "
                                      "q_proj to take that scaling at draftsman's positions")
        return cls(attentions, text.floor_scale, text.attn_scale)

    def scale(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) positions -> (B, T, 1) float32 factors, Hugging Face's formula."""
        steps = torch.floor((position_ids.float() + 1.0) / self.floor_scale)
        return (torch.log1p(steps) * self.attn_scale + 1.0)[..., None]

    @contextmanager
    def at(self, position_ids: torch.Tensor):
        """Within: the queries of the NoPE layers are scaled at `position_ids`, not at slots."""
        scale = self.scale(position_ids)

        def scaled(module, args, output):  # as HF does it: float32 product, cast back
            return (output * scale).to(output.dtype)

        handles = [attention.q_proj.register_forward_hook(scaled) for attention in self.attentions]
        for attention in self.attentions:
            attention.attn_temperature_tuning = False
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for attention in self.attentions:
                attention.attn_temperature_tuning = True
