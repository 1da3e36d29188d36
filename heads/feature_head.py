"""Feature-level heads: one decoder layer of the target's own architecture that drafts from the
target's hidden state. Three kinds share the module:

  eagle  (EAGLE-1/2, Li et al. 2024): input at position i = Linear_2d->d([Embed(t_{i+1}); f_i]),
         where f_i is the target's top hidden state (the one its LM head reads); the layer (its
         input norm is the identity, as in EAGLE) predicts f_{i+1}; read out through the
         target's frozen LM head (no extra norm).
  mtp    (DeepSeek-V3 multi-token prediction): input = Linear_2d->d([RMSNorm(Embed(t_{i+1})); RMSNorm(h_i)]),
         then the layer, then the target's own final norm and LM head (shared, frozen).

  eagle3 (EAGLE-3, Li et al. 2025): input = [Embed(t_{i+1}); Linear_3d->d([low_i; mid_i; high_i])]
         (three layers of the target's residual stream); the widened layer (heads/eagle3.py) is
         read out through the head's own norm and LM head over a reduced draft vocabulary.

The fusion has no bias and takes the embedding first, and an eagle layer has no input norm: the
layout vLLM and SGLang load for EAGLE drafters (../docs/training-heads.md, export).

The layer is built as a one-layer Hugging Face model of the target's class whose embeddings, LM
head (and, for mtp, final norm) *are* the target's modules. With `layer: llama` (eagle, eagle3) it
is a Llama layer of the target's sizes and RoPE instead, whatever the target's class: the layer
vLLM and SGLang serve EAGLE heads as, so heads of any target export (draftsman/export.py).
Drafting feeds it `inputs_embeds` through the same CachedLM as the target, so tree attention,
rollback and ragged batches come from the verifier's code. Only the fusion layer, the input norms
and the decoder layer are trained and saved; the layer starts as a copy of the target's top layer.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from dataclasses import asdict, dataclass

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM

from . import eagle3
from .common import check_fingerprint, load_checkpoint, load_weights, save_checkpoint, target_fingerprint

KINDS = ("eagle", "eagle3", "mtp")
LAYERS = ("target", "llama")  # the head's decoder layer: of the target's class, or a Llama layer
_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "embedding_norm", "norm_f")
_INPUT_NORM_NAMES = ("input_layernorm", "ln_1", "operator_norm")
_LAYER_INDEX = re.compile(r"\.(layers|h|layer|blocks)\.0\.")


@dataclass
class FeatureHeadConfig:
    kind: str  # eagle | eagle3 | mtp
    hidden_size: int
    vocab_size: int
    aux_layers: list[int] | None = None  # eagle3: target hidden_states indices fused, low to high
    draft_vocab_size: int | None = None  # eagle3: rows of its own LM head
    layer: str = "target"  # one of LAYERS

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's hidden_states the head reads (-1 = the top feature, after the final norm)."""
        return tuple(self.aux_layers) if self.kind == "eagle3" else (-1,)


def _base(model: nn.Module) -> nn.Module:
    """The model's decoder stack. Hugging Face's base_model falls back to the whole model where the
    class's base_model_prefix names no attribute (Llama4ForCausalLM's says language_model; its
    stack is `model`)."""
    base = model.base_model
    return getattr(model, "model", base) if base is model else base


def final_norm_owner(model: nn.Module) -> tuple[nn.Module, str]:
    """The module that holds the final norm and the norm's attribute name, to read or swap it."""
    base = _base(model)
    for name in _FINAL_NORM_NAMES:
        if isinstance(getattr(base, name, None), nn.Module):
            return base, name
    raise NotImplementedError(f"{type(model).__name__}: cannot find the final norm (looked for {_FINAL_NORM_NAMES})")


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class FeatureHead(nn.Module):
    def __init__(self, config: FeatureHeadConfig, target: nn.Module, body_config=None):
        """body_config: the one-layer config of a decoder layer the caller brings, where it is not
        built from the target's (a native MTP layer, heads/native_mtp.py): the body is then built
        without weights (its layer can be a 256-expert MoE), for the caller to fill."""
        super().__init__()
        if config.kind not in KINDS:
            raise ValueError(f"feature head kind must be one of {list(KINDS)}, got {config.kind!r}")
        if config.layer not in LAYERS:
            raise ValueError(f"a feature head's layer must be one of {list(LAYERS)}, got {config.layer!r}")
        if config.layer == "llama" and config.kind == "mtp":
            raise ValueError("an mtp head's layer is the target's own (it reads out through the target's final "
                             "norm); layer: llama is for eagle and eagle3 heads")
        self.config = config
        d = config.hidden_size
        self.fuse = nn.Linear((3 if config.kind == "eagle3" else 2) * d, d, bias=False)
        if config.kind == "mtp":
            self.norm_hidden, self.norm_embed = RMSNorm(d), RMSNorm(d)
        brought = body_config is not None  # its layer comes from the caller: build no weights
        if brought:
            body_config = copy.deepcopy(body_config)
        elif config.layer == "llama":
            body_config = _llama_layer_config(target.config)
        else:
            body_config = copy.deepcopy(target.config)
            for key in ("num_hidden_layers", "n_layer"):
                if hasattr(body_config, key):
                    setattr(body_config, key, 1)
            _full_attention(body_config, type(target).__name__)
        with init_empty_weights(include_buffers=False) if brought else contextlib.nullcontext():
            body = AutoModelForCausalLM.from_config(body_config, dtype=torch.float32)
        if config.kind == "eagle3":
            eagle3.make_midlayer(decoder_layers(body)[0])
        if config.kind == "eagle":  # EAGLE's layer reads the fused input without normalising it
            layer = decoder_layers(body)[0]
            for name in _INPUT_NORM_NAMES:
                if isinstance(getattr(layer, name, None), nn.Module):
                    setattr(layer, name, nn.Identity())
                    break
            else:
                raise NotImplementedError(f"{type(layer).__name__}: cannot find the input norm ({_INPUT_NORM_NAMES}) "
                                          "an EAGLE head removes; an 'mtp' head keeps it, and `layer: llama` gives "
                                          "the head a Llama layer: train one of those")
        # Shared with the target, never trained or saved: embeddings, LM head, (mtp) final norm.
        # Kept out of this module's parameters so optimizers and state_dict see only the head.
        owner, norm_name = final_norm_owner(body)
        target_owner, target_norm_name = final_norm_owner(target)
        target_norm = target_owner.get_submodule(target_norm_name)
        setattr(owner, norm_name, target_norm if config.kind == "mtp" else nn.Identity())
        body.set_input_embeddings(target.get_input_embeddings())
        if config.kind == "eagle3":  # its own norm and draft-vocabulary LM head, trained
            self.readout = eagle3.DraftReadout(copy.deepcopy(target_norm).float(), d, config.draft_vocab_size)
            self.register_buffer("draft_token_ids", torch.arange(config.draft_vocab_size))
            body.set_output_embeddings(self.readout)
        else:
            body.set_output_embeddings(target.get_output_embeddings())
        body.config.tie_word_embeddings = False
        self._shared = {"body": body, "target": target}  # a plain dict: not registered as submodules
        shared = {id(body.get_input_embeddings()), id(getattr(owner, norm_name))}
        # The body's own parts (decoder layer, rotary tables, GPT-2's position embeddings) are
        # registered here, so .to() and state_dict() reach them and nothing of the target.
        self.parts = nn.ModuleDict({name: module for name, module in _base(body).named_children()
                                    if id(module) not in shared})

    @property
    def body(self) -> nn.Module:
        return self._shared["body"]

    @property
    def embed(self) -> nn.Module:
        return self._shared["target"].get_input_embeddings()

    @classmethod
    def for_target(cls, target: nn.Module, kind: str, draft_token_ids=None, aux_layers=None,
                   layer: str = "target") -> "FeatureHead":
        """A new head whose decoder layer starts as a copy of the target's top layer (layer: llama,
        the parts whose names and shapes a Llama layer shares; the rest at random).
        eagle3: `draft_token_ids` = its draft vocabulary (default: all), `aux_layers` = the target's
        hidden_states it fuses (default: heads/eagle3.py default_aux_layers)."""
        lm_head = target.get_output_embeddings().weight
        V, d = lm_head.shape
        config = FeatureHeadConfig(kind, d, V, layer=layer)
        if kind == "eagle3":
            ids = torch.arange(V) if draft_token_ids is None else torch.as_tensor(sorted(set(draft_token_ids)))
            n = _num_layers(target)
            config.aux_layers = [int(k) for k in (aux_layers or eagle3.default_aux_layers(n))]
            if len(config.aux_layers) != 3 or not all(0 <= k <= n for k in config.aux_layers):
                raise ValueError(f"aux_layers must be 3 hidden_states indices in 0..{n}, got {config.aux_layers}")
            config.draft_vocab_size = len(ids)
        head = cls(config, target)
        target_state = target.state_dict()
        last = _num_layers(target) - 1
        with torch.no_grad():
            for name, tensor in head.body.state_dict().items():
                source = _LAYER_INDEX.sub(lambda m: f".{m.group(1)}.{last}.", name)
                if kind == "eagle3" and name.endswith("hidden_norm.weight"):
                    source = source.replace("hidden_norm", "input_layernorm")
                if source not in target_state or (layer == "llama" and name.endswith("norm.weight")):
                    continue  # a Llama norm scales by w, some targets' by 1 + w (Gemma): it keeps its ones
                if target_state[source].shape == tensor.shape:
                    tensor.copy_(target_state[source].float())
                elif kind == "eagle3" and tensor.shape[1] == 2 * d and target_state[source].shape == (len(tensor), d):
                    tensor[:, d:].copy_(target_state[source].float())  # widened q/k/v: the feature half
            # Start the fusion as "take the (top) feature" so a new head is not pure noise.
            head.fuse.weight.zero_()
            head.fuse.weight[:, -d:].copy_(torch.eye(d))
            if kind == "eagle3":
                head.draft_token_ids.copy_(ids)
                head.readout.lm_head.weight.copy_(lm_head[ids].float())
        return head.to(lm_head.device)

    def fused_inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(..., d) features of positions i and (...) tokens i + 1 -> (..., d) inputs of the layer.
        eagle3: features are the target's (..., 3d) aux states or, deeper in a draft, the head's own
        (..., d) outputs; the layer's input is (..., 2d) [embedding; h]."""
        emb = self.embed(tokens).to(features.dtype)
        if self.config.kind == "eagle3":
            h = self.fuse(features) if features.shape[-1] != self.config.hidden_size else features
            return torch.cat([emb, h], dim=-1)
        if self.config.kind == "mtp":
            features, emb = self.norm_hidden(features), self.norm_embed(emb)
        return self.fuse(torch.cat([emb, features], dim=-1))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, **body_kwargs):
        """Training path: (B, L, d) features, (B, L) next tokens -> (predicted features (B, L, d),
        logits (B, L, V)). The predicted feature is what the LM head reads. Extra keyword arguments
        go to the body (eagle3's training-time test passes a cache, positions and a 4D mask)."""
        out = self.body(inputs_embeds=self.fused_inputs(features, tokens), output_hidden_states=True, **body_kwargs)
        return out.hidden_states[-1], out.logits

    def cast_parameters(self, dtype: torch.dtype) -> "FeatureHead":
        """Parameters to the target's dtype for drafting; buffers (rotary tables) stay float32."""
        for p in self.parameters():
            p.data = p.data.to(dtype)
        return self

    def save(self, folder, target: nn.Module, extra: dict | None = None, dtype=torch.bfloat16) -> None:
        config = {**asdict(self.config), "target": target_fingerprint(target), **(extra or {})}
        save_checkpoint(folder, config, {k: v.to(dtype) if v.is_floating_point() else v
                                         for k, v in self.state_dict().items()})

    @classmethod
    def load(cls, folder, target: nn.Module, kind: str | tuple[str, ...] = KINDS) -> tuple["FeatureHead", dict]:
        """Load heads saved by `save` against this target (refused if it is another target or
        not of `kind`, one kind or a tuple of accepted kinds)."""
        config, tensors = load_checkpoint(folder, kind)
        check_fingerprint(config["target"], target, folder)
        fields = {f.name for f in dataclasses.fields(FeatureHeadConfig)}
        head = cls(FeatureHeadConfig(**{k: v for k, v in config.items() if k in fields}), target)
        load_weights(head, {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, folder)
        device = next(target.parameters()).device
        return head.to(device=device).eval(), config


def _num_layers(model: nn.Module) -> int:
    cfg = model.config
    return getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")


def _llama_layer_config(target_config):
    """A one-layer Llama config of the target's sizes and RoPE, for `layer: llama`. Its activation
    is SiLU, as the engines' Llama MLP requires; a model with RoPE per layer kind (Gemma 3) gives
    its full-attention layers'; RoPE turns the whole head (no partial rotary, as Qwen3.5's, nor
    multimodal sections)."""
    from transformers import LlamaConfig

    text = target_config.get_text_config()
    # a model without attention (Mamba) gets heads of 64 wide, or one head
    heads = getattr(text, "num_attention_heads", None) or max(1, text.hidden_size // 64)
    rope = copy.deepcopy(getattr(text, "rope_parameters", None))
    if isinstance(rope, dict) and "full_attention" in rope:
        rope = rope["full_attention"]
    if isinstance(rope, dict):  # the whole head_dim rotates, on one axis: what the engines' Llama layer does
        rope = {k: v for k, v in rope.items()
                if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    eps = next((getattr(text, k) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
                if getattr(text, k, None) is not None), 1e-6)
    return LlamaConfig(vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_hidden_layers=1,
                       intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
                       num_attention_heads=heads,
                       num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
                       head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, rms_norm_eps=eps,
                       max_position_embeddings=getattr(text, "max_position_embeddings", 4096), hidden_act="silu",
                       tie_word_embeddings=False, **({"rope_parameters": rope} if rope else {}))


def _full_attention(config, target_name: str) -> None:
    """A head's one layer attends to its whole context, whatever the target's layers do (a sliding
    window, as Gemma's or Mistral's; a recurrent mixer, as Qwen3.5's or LFM2's): as vLLM's and
    SGLang's EAGLE heads, and one mask for the training-time test and the drafter alike."""
    try:
        if getattr(config, "layer_types", None) is not None:  # which layers slide is read from here (Gemma,
            config.layer_types = ["full_attention"]  # Qwen2, Qwen3.5), and Gemma still wants its sliding_window set
        elif getattr(config, "sliding_window", None) is not None:  # every layer slides (Mistral, Phi-3)
            config.sliding_window = None
    except AttributeError as e:  # a config that derives its layer kinds (Bamba's layers_block_type)
        raise NotImplementedError(f"{target_name}: a head's one layer must attend, and this config does not let "
                                  f"its layer kinds be set ({e}); train an eagle or eagle3 head with `layer: llama` "
                                  "(a Llama layer of the target's sizes), or draft with 'draft_model' or "
                                  "'ngram'") from e


def decoder_layers(body: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers, whatever the architecture names it."""
    base = _base(body)
    for name in ("layers", "h", "layer", "blocks"):
        if isinstance(getattr(base, name, None), nn.ModuleList):
            return getattr(base, name)
    raise NotImplementedError(f"{type(body).__name__}: cannot find the decoder layers")
