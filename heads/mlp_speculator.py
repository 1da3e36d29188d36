"""IBM's MLP speculator ("Accelerating Production LLMs with Combined Token/Embedding Speculators",
arXiv 2404.19124; fms-extras' MLPSpeculator), as the released `*-accelerator` checkpoints hold it
(vLLM's MLPSpeculator model reads that layout; its V1 engine does not route the method,
vllm-project/vllm#47825).

A Medusa-like stack of `n_predict` stages with a running state, like an RNN: stage i reads the
state and the token drafted before it, and predicts the next token.

    state_0 = the target's last hidden state (before its LM head) at the position that predicted
              the root; RMS-normalised and divided by sqrt(2) first when scale_input
    state_i+1 = GELU(ln_i(proj_i(state_i) + emb_i(token_i) * emb_weight / state_weight))
    logits_i+1 = head_i(state_i+1)          token_0 = the root

ln_i is an RMS norm with a learned scale and shift (eps 1e-6), state_weight = 0.5 ** (0.5 /
n_predict) and emb_weight = sqrt((1 - state_weight ** 2) * inner_dim / 2), fms-extras' constants.
With tie_weights every stage shares stage 0's embedding, head and norm, and stages 2+ stage 1's
projection (stage 0's reads the target's width): such a speculator can run more stages than it
has, each one more of stage 1 (as vLLM's model code runs it past n_predict).

`draftsman train mlp_speculator` trains one on a frozen target (training/heads.py) and saves it in
this layout, with the target's fingerprint in config.json, so what reads the released ones reads it.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..models import heads_drafter
from .common import check_fingerprint, check_same_save, read_heads_config, save_checkpoint, target_fingerprint

MODEL_TYPE = "mlp_speculator"


class RMSNormShifted(nn.Module):
    """x / rms(x), then (when affine) a learned scale and shift: fms' LayerNormParameterized with
    use_mean False."""

    def __init__(self, width: int, affine: bool, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width)) if affine else None
        self.bias = nn.Parameter(torch.zeros(width)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        n, d, vocab = config["n_predict"], config["emb_dim"], config["vocab_size"]
        inner = config.get("inner_dim") or d
        self.config = {"vocab_size": vocab, "emb_dim": d, "inner_dim": inner, "n_predict": n,
                       "tie_weights": bool(config.get("tie_weights")), "scale_input": bool(config.get("scale_input"))}
        self.n_predict, self.inner_dim, self.scale_input = n, inner, bool(config.get("scale_input"))
        self.tied = bool(config.get("tie_weights")) and n > 1
        self.emb = nn.ModuleList(nn.Embedding(vocab, inner) for _ in range(n))
        self.proj = nn.ModuleList(nn.Linear(d if i == 0 else inner, inner, bias=False) for i in range(n))
        self.head = nn.ModuleList(nn.Linear(inner, vocab, bias=False) for _ in range(n))
        self.ln = nn.ModuleList(RMSNormShifted(inner, affine=True) for _ in range(n))
        self.ln0 = RMSNormShifted(d, affine=False) if self.scale_input else None
        state_weight = 0.5 ** (0.5 / n)
        self.token_scale = math.sqrt((1 - state_weight ** 2) * (inner / 2)) / state_weight
        if self.tied:
            for i in range(1, n):
                self.emb[i].weight, self.head[i].weight = self.emb[0].weight, self.head[0].weight
                self.ln[i].weight, self.ln[i].bias = self.ln[0].weight, self.ln[0].bias
                if i >= 2:
                    self.proj[i].weight = self.proj[1].weight

    @classmethod
    def for_target(cls, target: nn.Module, n_predict: int = 3, inner_dim: int = 0, tie_weights: bool = False,
                   scale_input: bool = True) -> "MLPSpeculator":
        """A new speculator for `target`, initialised as fms-extras initialises one (every
        embedding and projection N(0, 1 / sqrt(inner_dim)), unit norms)."""
        V, d = target.get_output_embeddings().weight.shape
        model = cls({"vocab_size": V, "emb_dim": d, "inner_dim": inner_dim, "n_predict": n_predict,
                     "tie_weights": tie_weights, "scale_input": scale_input})
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (nn.Embedding, nn.Linear)):
                    nn.init.normal_(module.weight, 0.0, 1 / math.sqrt(model.inner_dim))
        return model.to(target.get_output_embeddings().weight.device)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Training, teacher-forced: the target's states (B, L, emb_dim) and each stage's input
        token at each position (B, L, n_predict) -> every stage's logits (n_predict, B, L, vocab)."""
        state, logits = self.first_state(hidden), []
        for stage in range(self.n_predict):
            state, stage_logits = self.step(stage, state, tokens[..., stage])
            logits.append(stage_logits)
        return torch.stack(logits)

    def save(self, folder, target: nn.Module, extra: dict | None = None, dtype=torch.bfloat16) -> None:
        """fms-extras' layout (config.json with model_type mlp_speculator, tensors under their fms
        names, each shared one once), plus the target's fingerprint and `extra`."""
        n = self.n_predict
        config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": MODEL_TYPE, **self.config,
                  # fms-extras' own tree (draftsman drafts its top_k tree instead); one entry per stage
                  "top_k_tokens_per_head": [max(2, 4 - i) for i in range(n)], "n_candidates": 5,
                  "target": target_fingerprint(target), **(extra or {})}
        save_checkpoint(folder, config, {k: v.to(dtype) for k, v in self.named_parameters()})  # (tied: once)

    def first_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states (..., emb_dim) as stage 0 reads them."""
        return hidden if self.ln0 is None else self.ln0(hidden) / math.sqrt(2)

    def advance(self, stage: int, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Stage `stage` on states (..., width) and the tokens (...) drafted before it -> the next
        states (..., inner_dim). A tied speculator's stages past its last are its last (all
        stages from 1 on are the same)."""
        stage = self._stored(stage)
        mixed = self.proj[stage](state) + self.emb[stage](token) * self.token_scale
        return nn.functional.gelu(self.ln[stage](mixed))

    def readout(self, stage: int) -> nn.Linear:
        """The LM head that reads stage `stage`'s states."""
        return self.head[self._stored(stage)]

    def step(self, stage: int, state: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """advance(), then the stage's logits (..., vocab)."""
        state = self.advance(stage, state, token)
        return state, self.readout(stage)(state)

    def _stored(self, stage: int) -> int:
        return min(stage, self.n_predict - 1) if self.tied else stage


def read_config(folder: Path, drafter: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{drafter}: '{folder}' holds no config.json; set drafter.path to the folder of an "
                                "MLP speculator (e.g. a released *-accelerator checkpoint)")
    config = read_heads_config(path)
    heads = heads_drafter(config.get("kind"))
    if heads is not None:  # (it said "holds a None model")
        raise ValueError(f"{drafter}: '{folder}' holds {config['kind']} heads (draftsman train {config['kind']}), not "
                         f"an MLP speculator: use drafter: {heads} with path set to this folder")
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{drafter}: '{folder}' holds a {config.get('model_type')!r} model, not an MLP speculator "
                         f"(model_type {MODEL_TYPE!r}); for a small causal LM use drafter 'draft_model', for Medusa "
                         "heads 'medusa'")
    return config


def load_mlp_speculator(folder: str | Path, target: nn.Module,
                        drafter: str = "mlp_speculator") -> tuple[MLPSpeculator, dict]:
    """The speculator in `folder` (config.json + model.safetensors or pytorch_model.bin), checked
    against the target it drafts for, in the target's dtype and on its device; and its config.json."""
    folder = Path(folder).expanduser()
    config = read_config(folder, drafter)
    hidden, vocab = target.config.get_text_config().hidden_size, target.get_output_embeddings().weight.shape[0]
    problems = []
    if config["emb_dim"] != hidden:
        problems.append(f"it reads states {config['emb_dim']} wide, the target's are {hidden}")
    if config["vocab_size"] > vocab:
        problems.append(f"its vocabulary has {config['vocab_size']} tokens, the target's {vocab}")
    if problems:
        raise ValueError(f"{drafter}: the speculator in '{folder}' was made for another target: {'; '.join(problems)}."
                         " Use the speculator released (or trained) for this target")
    if "target" in config:  # trained by draftsman: the target it was trained for is on record
        check_fingerprint(config["target"], target, folder)
    check_same_save(folder, config)
    model = MLPSpeculator(config)
    model.load_state_dict(_weights(folder, model, drafter))
    weight = target.get_output_embeddings().weight
    return model.to(device=weight.device, dtype=weight.dtype).eval(), config


def _weights(folder: Path, model: MLPSpeculator, drafter: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the module's names: fms-extras' Hugging Face wrapper saves
    them under `speculator.`; a tied checkpoint may keep each shared tensor once."""
    if (folder / "model.safetensors").is_file():
        saved = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        saved = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{drafter}: '{folder}' holds no model.safetensors or pytorch_model.bin: the "
                                "speculator's weights are missing")
    saved = {key.removeprefix("speculator."): value for key, value in saved.items()}
    names_of: dict[int, list[str]] = {}  # each parameter's names (several when tied)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    weights, missing = {}, []
    for names in names_of.values():
        given = next((saved[name] for name in names if name in saved), None)
        if given is None:
            missing.append(names[0])
        else:
            weights.update({name: given for name in names})
    unknown = sorted(set(saved) - {name for names in names_of.values() for name in names})
    if missing or unknown:
        raise ValueError(f"{drafter}: the weights in '{folder}' do not fit its config.json (n_predict "
                         f"{model.n_predict}, tie_weights, scale_input): missing {missing[:6]}, unknown "
                         f"{unknown[:6]}")
    return weights
