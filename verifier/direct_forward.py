"""A drafter model's forward without the Hugging Face wrappers around its layers.

A drafter call is tiny (an EAGLE head: one layer over 4 nodes), so what Hugging Face runs around
the layers costs about as much as the layers: argument merging, output capturing hooks, mask
preparation, output dataclasses. On the 2-core CPU an EAGLE-3 head call over 4 nodes took 2.6-2.8
ms through `model(...)`, about 0.85 ms of it matrix products, and 2.0-2.5 ms called part by part:
the model's own rotary table, decoder layers, final norm and LM head, in the order its forward
calls them. Drafting time fell 10-12% for eagle, eagle3, mtp and draft_model (2-3% of a whole
generation; the drafts are unchanged).

Only for Llama and Qwen2 models, whose forward is exactly that order (read in transformers 5.x
modeling_llama.py / modeling_qwen2.py; other families run their own forward), and only for
drafters: the target always runs through its own forward, so what the verifier compares against
is the model as Hugging Face runs it. tests/test_cached_model.py checks that both ways give the
same logits and states, tests/test_feature_heads.py that heads draft the same trees.
"""
from __future__ import annotations

import torch
from torch import nn

# config.model_type of the families whose base model's forward is embed -> rotary table ->
# every decoder layer with the same 4D mask -> final norm, and whose causal LM applies lm_head.
DIRECT_MODEL_TYPES = ("llama", "qwen2")


class DirectForward:
    """Calls a causal LM's parts directly. The LM head is looked up at each call: drafters swap it
    by round kind (set_output_embeddings sets `lm_head` in these families)."""

    def __init__(self, model: nn.Module, cache_kwarg: str):
        self.model = model
        self.base = model.base_model
        self.layers = list(self.base.layers[: model.config.num_hidden_layers])
        self.cache_kwarg = cache_kwarg  # the layers take the cache by the same name as the model

    @classmethod
    def for_model(cls, model: nn.Module, cache_kwarg: str) -> "DirectForward | None":
        """None where the model is not of a family this knows, or has sliding-window layers."""
        base = getattr(model, "base_model", None)
        if getattr(model.config, "model_type", None) not in DIRECT_MODEL_TYPES or base is None:
            return None
        if getattr(base, "has_sliding_layers", False) or not all(
                hasattr(base, part) for part in ("embed_tokens", "rotary_emb", "layers", "norm")) \
                or not hasattr(model, "lm_head"):
            return None
        return cls(model, cache_kwarg)

    def __call__(self, cache, mask: torch.Tensor, position_ids: torch.Tensor, input_ids=None, inputs_embeds=None,
                 logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """mask: the (B, 1, T, S + T) additive 4D mask (never None: no causal shortcut here).
        Returns logits (B, T, V), or (B, V) at logits_at ((B, m, V) at (B, m) indices), and the last
        hidden state (B, T, d) after the final norm, as Hugging Face's hidden_states[-1]."""
        base = self.base
        h = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        position_embeddings = base.rotary_emb(h, position_ids)
        cache = {self.cache_kwarg: cache}
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, use_cache=True,
                      position_embeddings=position_embeddings, **cache)
        h = base.norm(h)
        rows = torch.arange(h.shape[0], device=h.device)
        read = h if logits_at is None else h[rows[:, None] if logits_at.dim() == 2 else rows, logits_at]
        return self.model.lm_head(read), h
