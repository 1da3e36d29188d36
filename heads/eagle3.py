"""The parts of an EAGLE-3 head (Li et al. 2025) that differ from EAGLE-1/2 (heads/feature_head.py):

  fusion    Linear_3d->d over the target's residual stream at a low, a middle and a high layer
            (concatenated low to high), instead of its top feature only;
  midlayer  the decoder layer's attention reads 2d = [input_layernorm(embedding); hidden_norm(h)];
            the residual is h. Deeper draft steps feed the layer its own pre-norm output as h;
  readout   its own final norm and LM head over a reduced draft vocabulary (token ids stored with
            the head), trained on the target's distribution, not by regressing features.

Names follow the layout vLLM and SGLang load for EAGLE-3 drafters (midlayer.*, hidden_norm, norm,
lm_head, d2t/t2d: draftsman/export.py), so an export is a renaming.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

_MIDLAYER_CLASSES: dict[type, type] = {}


def default_aux_layers(num_layers: int) -> list[int]:
    """HF `hidden_states` indices (k = the residual entering layer k; num_layers = the top feature)
    the fusion reads, low to high: EAGLE-3's 2, N//2, N-3 when distinct, else spread over the
    layers (small targets)."""
    n = num_layers
    for candidate in ([2, n // 2, n - 3], [1, n // 2, n - 1], [0, (n + 1) // 2, n]):
        if candidate[0] < candidate[1] < candidate[2] and 0 <= candidate[0] and candidate[2] <= n:
            return candidate
    raise ValueError(f"an EAGLE-3 head fuses three distinct layers; this target has {n} layer(s)")


def _midlayer_forward(self, hidden_states, **kwargs):
    """hidden_states (..., 2d) = [embedding; h]; returns (..., d), the pre-norm output. Every other
    argument (mask, positions, the KV cache under either of its transformers 5.x names) goes to the
    attention unchanged, as the original layer's forward passes it."""
    embedding, feature = hidden_states.chunk(2, dim=-1)
    x = torch.cat([self.input_layernorm(embedding), self.hidden_norm(feature)], dim=-1)
    attended, _ = self.self_attn(hidden_states=x, **kwargs)
    h = feature + attended
    out = _mlp(self)(self.post_attention_layernorm(h))
    out = out[0] if isinstance(out, tuple) else out  # an MoE block (GPT-OSS) also returns router scores
    return h + out.view(h.shape)  # Llama 4's returns its tokens flattened


def _mlp(layer: nn.Module) -> nn.Module | None:
    """The layer's feed-forward block: `mlp`, or Llama 4's `feed_forward`."""
    mlp = getattr(layer, "mlp", None)
    return mlp if mlp is not None else getattr(layer, "feed_forward", None)


def midlayer_problem(layer: nn.Module) -> str | None:
    """Why a decoder layer cannot become EAGLE-3's midlayer (with the fix), or None when it can;
    the trainer asks it of the target's layers before it reads the corpus."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")) \
            or not all(hasattr(layer, p) for p in ("input_layernorm", "post_attention_layernorm")) \
            or _mlp(layer) is None:
        return (f"{type(layer).__name__}: an EAGLE-3 head needs a decoder layer with self_attn.q_proj/k_proj/v_proj, "
                "input_layernorm, post_attention_layernorm and mlp (Llama, Qwen2, Mistral family); set `layer: llama` "
                "(a Llama layer of the target's sizes, e.g. --set layer=llama), or use an EAGLE-1/2 head (kind eagle) "
                "for this target")
    return None


def make_midlayer(layer: nn.Module) -> nn.Module:
    """Turn a body's decoder layer (Llama / Qwen2 / Mistral family) into EAGLE-3's midlayer in place:
    q/k/v take 2d inputs, a second input norm for h. The class becomes a subclass of the original,
    so Hugging Face still records its output as a hidden state."""
    problem = midlayer_problem(layer)
    if problem:
        raise NotImplementedError(problem)
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        wide = nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None)
        with torch.no_grad():  # the feature half starts as the original projection, the embedding half at zero
            wide.weight.zero_()
            wide.weight[:, old.in_features:].copy_(old.weight)
            if old.bias is not None:
                wide.bias.copy_(old.bias)
        setattr(attn, name, wide)
    layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
    cls = type(layer)
    if cls not in _MIDLAYER_CLASSES.values():
        layer.__class__ = _MIDLAYER_CLASSES.setdefault(
            cls, type(f"Eagle3{cls.__name__}", (cls,), {"forward": _midlayer_forward}))
    return layer


class DraftReadout(nn.Module):
    """norm -> LM head over the draft vocabulary. It sits in the body's LM-head slot (the body's own
    final norm is the identity), so the body's last hidden state stays the pre-norm output that the
    next draft step feeds on."""

    def __init__(self, norm: nn.Module, hidden_size: int, draft_vocab_size: int):
        super().__init__()
        self.norm = norm
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
