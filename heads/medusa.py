"""Medusa heads (Cai et al. 2024): N extra heads on the target's last hidden state; head i
predicts the token i + 2 positions ahead (the target's own LM head predicts the next one).

Each head: residual blocks x + SiLU(Linear(x)), zero-initialised so that a new head starts as the
target's own next-token prediction, then an output projection initialised from the target's LM
head. The target stays frozen; only the heads train.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .common import check_fingerprint, load_checkpoint, save_checkpoint, target_fingerprint


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head


class ResidualBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: the head = the target's LM head
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        d, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(nn.Sequential(*[ResidualBlock(d) for _ in range(config.num_layers)])
                                    for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(d, V, bias=False) for _ in range(config.num_heads))

    @classmethod
    def for_target(cls, target: nn.Module, num_heads: int = 4, num_layers: int = 1) -> "MedusaHeads":
        lm_head = target.get_output_embeddings().weight
        heads = cls(MedusaConfig(lm_head.shape[1], lm_head.shape[0], num_heads, num_layers))
        with torch.no_grad():
            for head in heads.lm_heads:
                head.weight.copy_(lm_head.float())
        return heads.to(lm_head.device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) last hidden states -> (num_heads, ..., V) logits."""
        return torch.stack([lm(block(hidden)) for block, lm in zip(self.blocks, self.lm_heads)])

    def save(self, folder, target: nn.Module, extra: dict | None = None, dtype=torch.bfloat16) -> None:
        config = {"kind": "medusa", **asdict(self.config), "target": target_fingerprint(target), **(extra or {})}
        save_checkpoint(folder, config, {k: v.to(dtype) for k, v in self.state_dict().items()})

    @classmethod
    def load(cls, folder, target: nn.Module) -> tuple["MedusaHeads", dict]:
        config, tensors = load_checkpoint(folder, "medusa")
        check_fingerprint(config["target"], target, folder)
        heads = cls(MedusaConfig(**{k: config[k] for k in ("hidden_size", "vocab_size", "num_heads", "num_layers")}))
        heads.load_state_dict({k: v.float() for k, v in tensors.items()})
        device = next(target.parameters()).device
        return heads.to(device).eval(), config
