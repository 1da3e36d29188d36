"""Medusa heads (Cai et al. 2024): N extra heads on the target's last hidden state; head i
predicts the token i + 2 positions ahead (the target's own LM head predicts the next one).

Each head: residual blocks x + SiLU(Linear(x)), zero-initialised so that a new head starts as the
target's own next-token prediction, then an output projection initialised from the target's LM
head. The target stays frozen; only the heads train.

`share_lm_head`: the heads read out through the target's own frozen LM head instead of their own
copies. Far fewer parameters (4 x V x d saved) and, at batch 1, a quarter of the memory traffic
per draft, which is what a CPU pays for; the residual blocks adapt to the shared projection.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .common import check_fingerprint, load_checkpoint, load_weights, save_checkpoint, target_fingerprint


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # read out through the target's frozen LM head (no copies)


class ResidualBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: the head = the target's LM head
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, target_lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        d, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(nn.Sequential(*[ResidualBlock(d) for _ in range(config.num_layers)])
                                    for _ in range(config.num_heads))
        if config.share_lm_head:
            if target_lm_head is None:
                raise ValueError("share_lm_head: pass the target's LM head")
            self._shared = {"lm_head": target_lm_head}  # a plain dict: not trained, not saved
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(d, V, bias=False) for _ in range(config.num_heads))

    @classmethod
    def for_target(cls, target: nn.Module, num_heads: int = 4, num_layers: int = 1,
                   share_lm_head: bool = False) -> "MedusaHeads":
        lm_head = target.get_output_embeddings()
        V, d = lm_head.weight.shape
        heads = cls(MedusaConfig(d, V, num_heads, num_layers, share_lm_head), lm_head)
        if not share_lm_head:
            with torch.no_grad():
                for head in heads.lm_heads:
                    head.weight.copy_(lm_head.weight.float())
        return heads.to(lm_head.weight.device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) last hidden states -> (num_heads, ..., V) logits."""
        if self.config.share_lm_head:
            lm_head = self._shared["lm_head"]
            features = torch.stack([block(hidden) for block in self.blocks])
            return lm_head(features.to(lm_head.weight.dtype))
        return torch.stack([lm(block(hidden)) for block, lm in zip(self.blocks, self.lm_heads)])

    def restrict_vocabulary(self, keep: torch.Tensor, shrink) -> None:
        """For drafting only: every head's LM head keeps the rows of `keep` (logits come out in
        that order). `shrink(linear, keep)` builds the smaller projection."""
        if self.config.share_lm_head:
            self._shared = {"lm_head": shrink(self._shared["lm_head"], keep)}
        else:
            self.lm_heads = nn.ModuleList(shrink(head, keep.to(head.weight.device)) for head in self.lm_heads)

    def save(self, folder, target: nn.Module, extra: dict | None = None, dtype=torch.bfloat16) -> None:
        config = {"kind": "medusa", **asdict(self.config), "target": target_fingerprint(target), **(extra or {})}
        save_checkpoint(folder, config, {k: v.to(dtype) for k, v in self.state_dict().items()})

    @classmethod
    def load(cls, folder, target: nn.Module) -> tuple["MedusaHeads", dict]:
        config, tensors = load_checkpoint(folder, "medusa")
        check_fingerprint(config["target"], target, folder)
        keys = ("hidden_size", "vocab_size", "num_heads", "num_layers", "share_lm_head")
        heads = cls(MedusaConfig(**{k: config[k] for k in keys if k in config}), target.get_output_embeddings())
        load_weights(heads, {k: v.float() for k, v in tensors.items()}, folder)
        device = next(target.parameters()).device
        return heads.to(device).eval(), config
